"""Host page allocator with reference counts (the paged state's pages).

Page ids index the device pools of compressed rows (`paged_state.PagedState.pools`). Page 0
is the null page: never handed out, never written; unused block-table entries point at it
(its rows are never visible: row visibility is positional). A page is shared by every
request whose block table holds it and by the prefix cache's radix tree; it returns to the
free list when the last reference is dropped.
"""

from __future__ import annotations

NULL_PAGE = 0


class PageAllocator:
    """Pages 1 .. num_pages - 1 with reference counts."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages (refcount 1 each), or None (nothing allocated) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, page: int) -> None:
        if page == NULL_PAGE or self._refs[page] <= 0:
            raise ValueError(f"retain of page {page} that is not allocated")
        self._refs[page] += 1

    def release(self, page: int) -> None:
        if page == NULL_PAGE or self._refs[page] <= 0:
            raise ValueError(f"release of page {page} that is not allocated")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)
