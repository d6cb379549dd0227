"""Prefix cache: a radix tree over page-sized token blocks.

Each node is one block of `page_size` tokens (the edge label) and owns a reference to the
page holding the compressed rows (CSA main + indexer rows, HCA rows) of exactly those token
positions. Rows of a block depend only on the tokens up to the block's end (docs/MODEL.md
§7), so the path from the root names them completely. A request whose prompt starts with a
cached path shares those pages (refcount) instead of recomputing them; the sliding-window
state is not cached (it is rebuilt by replay, `scheduler.py`).

Eviction: least-recently-used leaves whose page no request holds (refcount 1 = the tree's own
reference) are dropped first, and only as many as the caller needs (`Scheduler._allocate`).
"""

from __future__ import annotations

import heapq
import itertools

from deepinfer_fn.engine.pages import PageAllocator


class _Node:
    __slots__ = ("block", "page", "parent", "children", "last_use")

    def __init__(self, block, page, parent):
        self.block, self.page, self.parent = block, page, parent
        self.children: dict[tuple, _Node] = {}
        self.last_use = 0


class RadixCache:
    def __init__(self, page_size: int, pages: PageAllocator):
        self.page_size = page_size
        self.pages = pages
        self.root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_nodes = 0

    def _blocks(self, tokens, n_blocks):
        ps = self.page_size
        return [tuple(tokens[i * ps:(i + 1) * ps]) for i in range(n_blocks)]

    def match(self, tokens, max_blocks: int | None = None) -> list[int]:
        """Pages of the longest cached block-aligned prefix of `tokens` (at most max_blocks
        blocks). Touches the path (LRU). The caller retains the pages it keeps."""
        n = len(tokens) // self.page_size
        if max_blocks is not None:
            n = min(n, max_blocks)
        node, out, now = self.root, [], next(self._clock)
        for block in self._blocks(tokens, n):
            node = node.children.get(block)
            if node is None:
                break
            node.last_use = now
            out.append(node.page)
        return out

    def peek(self, tokens, max_blocks: int | None = None) -> int:
        """How many blocks `match` would return, without touching the path (LRU unchanged)."""
        n = len(tokens) // self.page_size
        if max_blocks is not None:
            n = min(n, max_blocks)
        node, found = self.root, 0
        for block in self._blocks(tokens, n):
            node = node.children.get(block)
            if node is None:
                break
            found += 1
        return found

    def insert(self, tokens, pages: list[int]) -> int:
        """Caches the first len(pages) blocks of `tokens`, block i stored in pages[i]. Blocks
        already cached keep their existing page. Returns the number of new nodes."""
        node, added, now = self.root, 0, next(self._clock)
        for block, page in zip(self._blocks(tokens, len(pages)), pages):
            child = node.children.get(block)
            if child is None:
                child = _Node(block, page, node)
                node.children[block] = child
                self.pages.retain(page)
                added += 1
            child.last_use = now
            node = child
        self.num_nodes += added
        return added

    def evict(self, n_pages: int) -> int:
        """Frees up to n_pages pages by dropping LRU leaves no request holds (a parent whose
        last child goes becomes a candidate in turn); returns how many were freed."""
        def evictable(nd):
            return not nd.children and self.pages.refcount(nd.page) == 1
        heap = [(nd.last_use, id(nd), nd) for nd in self._iter_nodes() if evictable(nd)]
        heapq.heapify(heap)
        freed = 0
        while freed < n_pages and heap:
            _, _, nd = heapq.heappop(heap)
            parent = nd.parent
            del parent.children[nd.block]
            self.pages.release(nd.page)
            self.num_nodes -= 1
            freed += 1
            if parent is not self.root and evictable(parent):
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def evictable(self) -> int:
        """How many pages `evict` could free at most: nodes whose subtree holds no page a
        request references."""
        free = {}                                   # id(node) -> whole subtree evictable
        count = 0
        for nd in reversed(list(self._iter_nodes())):   # children before parents
            ok = (self.pages.refcount(nd.page) == 1
                  and all(free[id(c)] for c in nd.children.values()))
            free[id(nd)] = ok
            count += ok
        return count

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            yield nd
            stack.extend(nd.children.values())
