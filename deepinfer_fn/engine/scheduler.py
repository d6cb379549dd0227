"""Host scheduling policy: admission, page allocation, preemption, batch building.

Nothing here touches the device. `Scheduler.schedule()` returns a `StepPlan` (the prefill rows
and decode rows of one engine step, with their packed inputs); `Scheduler.commit_results()`
applies the tokens a step sampled once they are known on the host.

Token bookkeeping per sequence (`Seq`): `ext` = the tokens to prefill at this admission (the
prompt, or prompt + generated tokens after a preemption); `pos` = positions already dispatched
into the device state; `generated` = tokens known on the host; `in_flight` = sampled tokens
dispatched but not yet known. Positions are host-determined (a prefill chunk advances by n, a
decode row by 1), so the host never waits for the device to build the next step; only stop
tokens are seen one step late in asynchronous mode, and the extra token of a row that already
stopped is discarded (`epoch` also discards the results of rows preempted while in flight).

Speculative engines (`spec_width` = γ + 1 > 0, engine/spec_step.py): a decode row advances by
1..γ+1 positions, known only on the device (`PagedState.spec`). `pos` is then an upper bound
(+γ+1 per dispatched step, capped at the last position the request can write), used to allocate
pages; `commit_spec_results` sets it back to the exact length the step reports plus γ+1 per
step still in flight. A decode row costs γ+1 tokens of the step budget. A request resumed after
preemption re-prefills prompt + generated[:-1] without sampling and takes generated[-1] as its
anchor (`resume_anchor`), so its next verify step is the one an uninterrupted run would take
(same step counter `spec_steps`, same random streams).

Policy:
* decode rows first (every running sequence whose prompt is done and whose generation is not
  finished), then chunked prefill rows under the rest of the token budget, oldest first;
* admission (FIFO, preempted sequences at the front) while a slot is free and the first chunk's
  pages can be allocated; a prefix-cache hit of h tokens (page-aligned, leaving >= 1 token to
  prefill) shares the cached pages and starts the prefill at h - R (bounded replay, rows below
  h kept: `row_floor = h`; rounded down to a multiple of `replay_align`) or at 0 (exact mode);
* pages are allocated as positions advance; when too few are free the prefix cache evicts
  just the missing number of LRU leaves no running sequence holds (admission evicts nothing
  unless that is enough to admit), and then the most recently admitted running sequence is
  preempted (recompute: its slot and pages are released, it is requeued with prompt +
  generated tokens; with the prefix cache on, its full blocks are cached first, so it resumes
  from a hit);
* a plain row whose last token is dispatched hands its slot on at once (`_hand_on_slots`):
  the next admission's prefill runs behind its last step on the device, without the host
  first waiting for that step's results (its pages are freed when they arrive).

Batch shards (`shards` = n > 1: the engine on a dp x ep mesh): shard i owns slots [i * S, (i +
1) * S) (S = max_batch / n), its own page allocator and prefix cache (`pages`, `cache` given as
n-item lists; block tables hold shard-local page ids). A request is assigned to one shard at
admission (`_shard_order`: a shard with a free slot, preferring the longest prefix-cache hit,
then the most free slots, the fewest running tokens, the most free pages); pages, eviction
and preemption victims stay within its shard. A sub-batch of R rows gives each shard R / n
rows (row block i = shard i's rows, `row_positions`); decode buckets and prefill rows are
multiples of n. With n = 1 every rule above is the single pool's.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from deepinfer_fn.engine.pages import NULL_PAGE, PageAllocator
from deepinfer_fn.engine.radix import RadixCache
from deepinfer_fn.engine.request import Request


@dataclasses.dataclass(eq=False)
class Seq:
    req: Request
    index: int                      # submission order
    prompt: list[int]
    stops: frozenset
    t_submit: float
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ext: list[int] = dataclasses.field(default_factory=list)
    ext_arr: np.ndarray | None = None       # ext as int32 (set at admission, for packing)
    slot: int | None = None         # None: waiting, finished or handed on (last step in flight)
    pages: list[int] = dataclasses.field(default_factory=list)
    pos: int = 0
    row_floor: int = 0
    fresh: bool = False
    in_flight: int = 0
    epoch: int = 0
    admit_order: int = -1
    shard: int = 0                  # the batch shard holding its slot and pages
    finish: str | None = None
    t_first: float | None = None
    t_last: float | None = None
    cached_tokens: int = 0
    replayed_tokens: int = 0
    preemptions: int = 0
    matcher: object = None          # structured.Matcher of a constrained request (else None)
    spec_steps: int = 0             # verify steps whose results the host applied (speculative)
    resume_anchor: int | None = None  # speculative resume: the anchor token (not re-sampled)
    spec_log: list = dataclasses.field(default_factory=list)   # (verified ell, accepted g)
    imported: object = None         # transfer.RequestState to admit from (prefill elsewhere)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.ext)

    def wants_decode(self) -> bool:
        return (self.finish is None and not self.prefilling
                and len(self.generated) + self.in_flight < self.req.max_new_tokens)


@dataclasses.dataclass(slots=True)
class Row:
    seq: Seq
    epoch: int
    start: int
    n: int
    samples: bool        # the row's sampled token is a real output token
    shard: int = 0       # seq.shard when planned (its row block; seq may move after preemption)


@dataclasses.dataclass
class StepPlan:
    prefill: list[Row]
    decode: list[Row]
    prefill_shape: tuple[int, int] = (0, 0)     # (rows, width) of the prefill sub-batch
    decode_steps: int = 1       # decode steps of this plan's device call (row.n <= this)

    def __bool__(self):
        return bool(self.prefill or self.decode)


META_COLUMNS = ("slot", "start", "n_new", "row_floor", "fresh", "top_k", "seed")
SPEC_COLUMNS = ("spec_init", "spec_left", "spec_step", "spec_anchor")   # columns 10..13
PACK_HEAD = 14          # meta (7 int32 columns) + fparams (temperature, top_p, min_p as f32
#                         bits) + SPEC_COLUMNS (speculative prefill rows: on the final chunk,
#                         init = 1, the token budget after it, the step counter, the anchor or -1)


def buckets_up_to(n: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return tuple(out) + (n,)


def default_admit_batch(max_batch: int) -> int:
    """Free slots an engine of max_batch slots gathers before admitting while others decode:
    half the batch, at most 8 (one admission per slot ends decode calls after a step or two
    when speculative rows finish at staggered steps)."""
    return max(1, min(8, max_batch // 2))


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} rows exceed the largest bucket {sizes[-1]}")


class Scheduler:
    def __init__(self, *, max_batch: int, max_tokens_per_step: int,
                 prefill_shapes: tuple[tuple[int, int], ...], page_size: int, max_pages: int,
                 pages: PageAllocator | list[PageAllocator],
                 cache: RadixCache | None | list[RadixCache | None], replay_tokens: int | None,
                 spec_width: int = 0, decode_steps: int = 1, shards: int = 1,
                 replay_align: int = 1, step_counts: tuple[int, ...] | None = None,
                 admit_batch: int = 1):
        """pages / cache: a PageAllocator / RadixCache-or-None, or one per shard (lists).
        replay_align: a bounded replay starts at a multiple of it (V4.1 with code-2 sources:
        2, so the replay begins on a pair boundary). step_counts: the decode steps a device
        call may run (the compiled loop lengths of a fixed-count decode loop, 1 among them);
        a plan's count is rounded down to one of them, since a fixed loop runs the rounded-up
        count in full (its masked steps cost a whole forward). None: any of 1..decode_steps.
        admit_batch: while other rows decode, waiting requests are admitted once this many
        slots are free (or as many as wait), or once a free slot has waited decode_steps
        steps: admissions come in batches, so decode calls stay long when rows finish at
        staggered steps (speculative decoding)."""
        assert admit_batch >= 1, admit_batch
        assert replay_align >= 1 and page_size % replay_align == 0, (replay_align, page_size)
        assert decode_steps >= 1, decode_steps
        assert shards >= 1 and max_batch % shards == 0, (max_batch, shards)
        assert all(r % shards == 0 for r, _ in prefill_shapes), (prefill_shapes, shards)
        self.shards, self.slots_per_shard = shards, max_batch // shards
        self.shard_pages = list(pages) if isinstance(pages, (list, tuple)) else [pages]
        self.shard_caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
        assert len(self.shard_pages) == len(self.shard_caches) == shards
        self.max_batch, self.budget = max_batch, max_tokens_per_step
        self.decode_steps = decode_steps      # most decode steps per device call (plain)
        self.admit_batch = admit_batch
        self.slot_wait_steps = 0              # steps a free slot has waited for admission
        self.step_counts = tuple(sorted(step_counts or range(1, decode_steps + 1)))
        assert self.step_counts[0] == 1 and self.step_counts[-1] <= decode_steps, step_counts
        self.prefill_shapes = tuple(prefill_shapes)
        self.chunk = max(w for _, w in prefill_shapes)
        self.prefill_rows = max(r for r, _ in prefill_shapes)
        self.page_size, self.max_pages = page_size, max_pages
        # shard 0's allocator and cache (the only ones with one shard)
        self.pages, self.cache = self.shard_pages[0], self.shard_caches[0]
        self.replay = replay_tokens
        self.replay_align = replay_align
        self.spec_width = spec_width          # γ + 1 (speculative engine) or 0
        self.decode_cost = spec_width or 1    # budget tokens per decode row
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []          # admission order
        S = self.slots_per_shard          # per shard: free slots, pop() gives the lowest
        self.shard_free = [list(range((i + 1) * S - 1, i * S - 1, -1)) for i in range(shards)]
        # Per slot, the packed row of `pack` (PACK_HEAD columns, then the block table): the
        # per-request columns are written once at admission, the block table as pages come.
        self.slot_rows = np.zeros((max_batch, PACK_HEAD + max_pages), np.int32)
        self.block_table = self.slot_rows[:, PACK_HEAD:]          # a view
        self._pad_row = np.zeros(PACK_HEAD + max_pages, np.int32)
        self._pad_row[0] = max_batch                              # out-of-range slot
        self._pad_row[7:10] = np.array([0.0, 1.0, 0.0], np.float32).view(np.int32)
        self._admissions = 0
        self.shard_admissions = [0] * shards  # admissions per shard (load balance)
        self.preemptions = 0
        self.cache_hit_tokens = 0
        self.prefill_tokens = 0               # computed prefill positions (replay included)
        self.finished: list[Seq] = []         # finished since the last drain
        # speculative statistics (docs/MODEL.md §D4.1): applied verify steps over rows, drafts
        # verified / accepted in them, tokens they committed (g + 1 each, bonus included)
        self.spec_row_steps = self.spec_verified = self.spec_accepted = self.spec_committed = 0
        # prefill / decode separation (engine/transfer.py): on_finish(seq, reason) is called
        # before a running sequence's slot and pages are released; on_import(seq, state) when
        # a request is admitted from a RequestState (the engine writes it into the device
        # state then, before anything can read, cache or preempt its pages)
        self.on_finish = None
        self.on_import = None

    @property
    def free_slots(self) -> list[int]:
        """Free slots of every shard."""
        if self.shards == 1:
            return self.shard_free[0]
        return [s for free in self.shard_free for s in free]

    # ------------------------------------------------------------------ lifecycle
    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cancel(self, request_ids) -> None:
        for seq in list(self.waiting):
            if seq.req.request_id in request_ids:
                self.waiting.remove(seq)
                self.finish(seq, "cancelled")
        for seq in list(self.running):
            if seq.req.request_id in request_ids and seq.finish is None:
                self.finish(seq, "cancelled")

    def finish(self, seq: Seq, reason: str) -> None:
        seq.finish = reason
        if seq in self.running:
            if self.on_finish is not None:
                self.on_finish(seq, reason)
            self._release(seq, cache_blocks=reason != "cancelled")
            self.running.remove(seq)
        self.finished.append(seq)

    def _release(self, seq: Seq, cache_blocks: bool) -> None:
        """Frees the slot and the pages (full blocks of known, fed tokens go to the cache)."""
        cache = self.shard_caches[seq.shard]
        if cache is not None and cache_blocks:
            known = seq.prompt + seq.generated
            # speculative: pos is an upper bound; the last known token (the anchor) may be
            # unprocessed, every earlier one is processed and committed
            done = min(seq.pos, len(known) - 1) if self.spec_width else min(seq.pos, len(known))
            n_blocks = min(done, len(seq.pages) * self.page_size) // self.page_size
            # A block is complete once every position in it was dispatched.
            cache.insert(known, seq.pages[:n_blocks])
        self._release_slot(seq)

    def _release_slot(self, seq: Seq) -> None:
        """Drops the request's page references and returns its slot to the free list."""
        pages = self.shard_pages[seq.shard]
        for p in seq.pages:
            pages.release(p)
        seq.pages = []
        if seq.slot is not None:            # None: handed on early (`_hand_on_slots`)
            self._free_slot(seq)

    def _free_slot(self, seq: Seq) -> None:
        self.block_table[seq.slot] = NULL_PAGE
        self.shard_free[seq.shard].append(seq.slot)
        seq.slot = None

    def _hand_on_slots(self) -> None:
        """Frees the slots of plain rows whose every remaining token is already dispatched
        while requests wait: they finish once the in-flight steps are known, and nothing
        reads their slot after those steps, so a prefill issued now (behind them on the
        device) may take it; the host need not wait for the results before admitting. Their
        pages stay held until the results are applied (`finish`). Not for speculative rows
        (their lengths are known only on the device), constrained rows, or while finished
        requests are exported (`on_finish` reads the slot)."""
        if self.spec_width or self.on_finish is not None or not self.waiting:
            return
        for seq in self.running:
            if (seq.slot is not None and seq.finish is None and seq.matcher is None
                    and seq.in_flight > 0 and not seq.prefilling and self._remaining(seq) <= 0):
                self._free_slot(seq)

    # ------------------------------------------------------------------ pages
    def _blocks_needed(self, seq: Seq, end: int) -> int:
        return -(-end // self.page_size) - len(seq.pages)

    def _allocate(self, seq: Seq, end: int, plan: StepPlan | None, may_preempt: bool) -> bool:
        """Pages so that seq covers positions < end. Evicts only the missing number of LRU
        cache leaves; may then preempt (the victims are removed from `plan`). Without
        preemption nothing is evicted unless eviction alone covers the need. False if seq
        itself cannot get them."""
        need = self._blocks_needed(seq, end)
        pages, cache = self.shard_pages[seq.shard], self.shard_caches[seq.shard]
        while need > 0:
            got = pages.allocate(need)
            if got is not None:
                for p in got:
                    self.block_table[seq.slot, len(seq.pages)] = p
                    seq.pages.append(p)
                return True
            short = need - pages.free_count
            if (cache is not None and (may_preempt or cache.evictable() >= short)
                    and cache.evict(short)):
                continue
            if not may_preempt:
                return False
            victim = (self.running[-1] if self.shards == 1 else
                      [s for s in self.running if s.shard == seq.shard][-1])
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Seq, plan: StepPlan | None) -> None:
        self._release(seq, cache_blocks=True)
        self.running.remove(seq)
        seq.epoch += 1
        seq.in_flight = 0
        seq.preemptions += 1
        self.preemptions += 1
        if plan is not None:
            plan.prefill[:] = [r for r in plan.prefill if r.seq is not seq]
            plan.decode[:] = [r for r in plan.decode if r.seq is not seq]
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ admission
    def _end_cap(self, seq: Seq) -> int:
        """Speculative: one past the last position the request can ever write."""
        return len(seq.prompt) + seq.req.max_new_tokens - 1

    def _shard_order(self, seq: Seq) -> list[int]:
        """The shards with a free slot, best first for seq (its ext set): longest prefix-cache
        hit, then most free slots, fewest running tokens, most free pages, lowest index."""
        open_ = [i for i in range(self.shards) if self.shard_free[i]]
        if self.shards == 1:
            return open_
        max_blocks = (len(seq.ext) - 1) // self.page_size
        tokens = [0] * self.shards
        for s in self.running:
            tokens[s.shard] += s.pos

        def key(i):
            cache = self.shard_caches[i]
            hit = cache.peek(seq.ext, max_blocks) if cache is not None else 0
            return (-hit, -len(self.shard_free[i]), tokens[i], -self.shard_pages[i].free_count, i)
        return sorted(open_, key=key)

    def _admit(self, seq: Seq) -> bool:
        if seq.imported is not None:
            return self._admit_imported(seq)
        seq.ext = seq.prompt + seq.generated
        seq.resume_anchor = None
        if self.spec_width and seq.generated:   # resume: re-prefill up to the anchor
            seq.ext, seq.resume_anchor = seq.ext[:-1], seq.generated[-1]
        return any(self._admit_at(seq, shard) for shard in self._shard_order(seq))

    def _admit_at(self, seq: Seq, shard: int) -> bool:
        """Admits seq (ext set) into a free slot of `shard` if its first chunk's pages fit."""
        seq.shard = shard
        seq.slot = self.shard_free[shard].pop()
        pages, cache = self.shard_pages[shard], self.shard_caches[shard]
        hit_pages = []
        if cache is not None:
            hit_pages = cache.match(seq.ext, max_blocks=(len(seq.ext) - 1) // self.page_size)
            for p in hit_pages:
                pages.retain(p)
        h = len(hit_pages) * self.page_size
        for i, p in enumerate(hit_pages):
            self.block_table[seq.slot, i] = p
        seq.pages = list(hit_pages)
        start = 0 if (h == 0 or self.replay is None) else max(0, h - self.replay)
        start -= start % self.replay_align
        seq.pos, seq.row_floor, seq.fresh = start, h, True
        first_end = min(len(seq.ext), start + self.chunk)
        if not self._allocate(seq, max(first_end, h), None, may_preempt=False):
            self._release_slot(seq)
            return False
        seq.cached_tokens = h
        seq.replayed_tokens = h - start
        r = seq.req
        head = self.slot_rows[seq.slot, :PACK_HEAD]
        head[:7] = (seq.slot, 0, 0, h, 0, r.top_k, np.array(r.seed, np.uint32).view(np.int32))
        head[7:10] = np.array([r.temperature, r.top_p, r.min_p], np.float32).view(np.int32)
        seq.ext_arr = np.asarray(seq.ext, np.int32)
        self.cache_hit_tokens += h
        seq.admit_order = self._admissions
        self._admissions += 1
        self.shard_admissions[seq.shard] += 1
        self.running.append(seq)
        return True

    # ------------------------------------------------------------------ one step
    def _remaining(self, seq: Seq) -> int:
        """Tokens the request may still sample beyond those known or in flight."""
        return seq.req.max_new_tokens - len(seq.generated) - seq.in_flight

    def plan_decode_steps(self) -> int:
        """Decode steps for the next device call: `decode_steps` while no
        request is prefilling, none is to be admitted now (`admit_now`) and none is
        constrained (its mask needs each token on the host); while requests wait for a slot,
        no more steps than until enough running requests reach max_new_tokens for the next
        admission (`admit_batch` free slots; a speculative row is expected to get there at
        `spec_tokens_per_step` tokens per step), and no more than a free slot may still wait,
        so a waiting request is delayed by at most `decode_steps` steps. The count is rounded
        down to one of `step_counts`."""
        return max(t for t in self.step_counts if t <= self._decode_steps_wanted())

    def admit_now(self) -> bool:
        """Whether waiting requests are admitted this step: a slot is free and no row decodes,
        or `admit_batch` slots are free (as many as requests wait), or a free slot has waited
        `decode_steps` steps."""
        free = len(self.free_slots)
        if not (self.waiting and free):
            return False
        if not any(s.finish is None and s.wants_decode() for s in self.running):
            return True
        return (free >= min(self.admit_batch, len(self.waiting))
                or self.slot_wait_steps >= self.decode_steps)

    def _decode_steps_wanted(self) -> int:
        K = self.decode_steps
        if K == 1 or self.admit_now():
            return 1
        live = [s for s in self.running if s.finish is None]
        if any(s.prefilling or s.matcher is not None for s in live):
            return 1
        if self.waiting:
            # speculative: a step emits 1..γ+1 tokens; a row is expected to free its slot
            # after (tokens left) / tau more steps, tau = tokens per step measured so far
            tau = self.spec_tokens_per_step()
            left = sorted(math.ceil((self._remaining(s) + s.in_flight - tau * s.in_flight) / tau)
                          for s in live if s.wants_decode())
            free = len(self.free_slots)
            need = max(1, min(self.admit_batch, len(self.waiting)) - free)
            if left:
                K = min(K, left[min(need, len(left)) - 1])
            if free:
                K = min(K, self.decode_steps - self.slot_wait_steps)
        return max(1, K)

    def spec_tokens_per_step(self) -> float:
        """Tokens a decode row commits per step: 1 (plain), else the speculative steps'
        mean so far (γ + 1 before any)."""
        if not self.spec_width:
            return 1.0
        if not self.spec_row_steps:
            return float(self.spec_width)
        return min(float(self.spec_width), max(1.0, self.spec_committed / self.spec_row_steps))

    def schedule(self) -> StepPlan:
        plan = StepPlan([], [])
        self._hand_on_slots()
        budget, ps, decode = self.budget, self.page_size, plan.decode
        cost = self.decode_cost
        K = plan.decode_steps = self.plan_decode_steps()
        admit = self.admit_now()
        if admit or not self.waiting:
            self.slot_wait_steps = 0
        elif self.free_slots:
            self.slot_wait_steps += K
        for seq in list(self.running):
            if (len(decode) + 1) * cost > budget:
                break
            # seq.slot is None: preempted by an earlier row's allocation this step
            if seq.slot is None or not seq.wants_decode():
                continue
            n = min(K, self._remaining(seq))
            end = (min(seq.pos + n * self.spec_width, self._end_cap(seq)) if self.spec_width
                   else seq.pos + n)
            if end <= len(seq.pages) * ps or self._allocate(seq, end, plan, may_preempt=True):
                decode.append(Row(seq, seq.epoch, seq.pos, n, True, seq.shard))
        budget -= len(decode) * cost
        if admit and budget > 0:
            n_prefilling = sum(1 for s in self.running if s.pos < len(s.ext))
            while (self.waiting and self.free_slots and budget > 0
                   and n_prefilling < self.prefill_rows):
                if not self._admit(self.waiting[0]):
                    break
                self.waiting.popleft()
                n_prefilling += self.running[-1].prefilling
        cands = [s for s in self.running if s.pos < len(s.ext) and s.finish is None]
        shape, picked = self._prefill_shape(cands, budget)
        for seq, n in picked:
            if seq.slot is None:                     # preempted by an earlier row's allocation
                continue
            if self._allocate(seq, seq.pos + n, plan, may_preempt=True):
                final = seq.pos + n == len(seq.ext)
                plan.prefill.append(Row(seq, seq.epoch, seq.pos, n,
                                        final and seq.resume_anchor is None, seq.shard))
        plan.prefill_shape = shape
        return plan

    def _prefill_shape(self, cands: list[Seq], budget: int):
        """The prefill shape (rows, width) that moves the most prompt tokens this step (ties:
        the smaller padded shape), and its rows [(seq, n)] (oldest first, n <= width)."""
        best = None
        for rows, width in self.prefill_shapes:
            left, picked = budget, []
            for seq in self._fit_rows(cands, rows):
                n = min(width, len(seq.ext) - seq.pos, left)
                if n <= 0:
                    break
                picked.append((seq, n))
                left -= n
            key = (budget - left, -rows * width)
            if best is None or key > best[0]:
                best = (key, (rows, width), picked)
        return best[1], best[2]

    def _fit_rows(self, cands: list[Seq], rows: int) -> list[Seq]:
        """The first candidates (in order) that a sub-batch of `rows` rows holds: rows / n per
        shard (n = 1: the first `rows`)."""
        if self.shards == 1:
            return cands[:rows]
        cap, used, out = rows // self.shards, [0] * self.shards, []
        for seq in cands:
            if used[seq.shard] < cap:
                used[seq.shard] += 1
                out.append(seq)
        return out

    def sub_batch_rows(self, rows: list[Row], buckets: tuple[int, ...]) -> int:
        """The smallest bucket (a multiple of n) whose rows / n per shard hold every shard's
        rows."""
        if self.shards == 1:
            return bucket(len(rows), buckets)
        counts = np.bincount([row.shard for row in rows], minlength=self.shards)
        return bucket(self.shards * int(counts.max(initial=0)), buckets)

    def row_positions(self, rows: list[Row], n_rows: int) -> np.ndarray:
        """Where each row sits in a packed sub-batch of n_rows: shard i's rows (in order) at
        the start of row block [i * n_rows / n, (i + 1) * n_rows / n); n = 1: 0..len - 1."""
        if self.shards == 1:
            return np.arange(len(rows))
        block, used = n_rows // self.shards, [0] * self.shards
        out = np.empty(len(rows), np.int64)
        for k, row in enumerate(rows):
            i = row.shard
            assert used[i] < block, f"shard {i} has more than {block} rows of {n_rows}"
            out[k] = i * block + used[i]
            used[i] += 1
        return out

    def commit_plan(self, plan: StepPlan) -> None:
        """The plan was dispatched: advance positions, count in-flight samples, and cache the
        prompt blocks that are now complete (later steps run after this one on the device)."""
        for row in plan.decode:
            seq = row.seq
            seq.pos = (min(seq.pos + row.n * self.spec_width, self._end_cap(seq))
                       if self.spec_width else seq.pos + row.n)
            seq.fresh = False
            seq.in_flight += row.n
        for row in plan.prefill:
            seq = row.seq
            seq.pos += row.n
            seq.fresh = False
            seq.in_flight += row.samples
            self.prefill_tokens += row.n
            cache = self.shard_caches[seq.shard]
            if cache is not None:
                n_blocks = min(seq.pos, len(seq.pages) * self.page_size) // self.page_size
                if n_blocks > seq.row_floor // self.page_size:
                    cache.insert(seq.ext, seq.pages[:n_blocks])

    def commit_results(self, rows: list[Row], tokens: np.ndarray, logprobs: np.ndarray,
                       now: float) -> None:
        """Applies one dispatched step's sampled tokens (known on the host now)."""
        for row, tok, lp in zip(rows, tokens, logprobs):
            seq = row.seq
            if not row.samples or row.epoch != seq.epoch:
                continue
            seq.in_flight -= 1
            if seq.finish is not None:
                continue                       # a token past a stop (async lag): discarded
            tok = int(tok)
            seq.generated.append(tok)
            seq.logprobs.append(float(lp))
            if seq.t_first is None:
                seq.t_first = now
            seq.t_last = now
            if seq.matcher is not None:      # drawn under its mask: accepted (EOS only when
                seq.matcher.consume(tok)     # the text matches); EOS ends the constraint
                if seq.matcher.is_finished():
                    self.finish(seq, "error" if seq.matcher.error else "stop")
                    continue
            if tok in seq.stops:
                self.finish(seq, "stop")
            elif len(seq.generated) >= seq.req.max_new_tokens:
                self.finish(seq, "length")

    def commit_decode_results(self, rows: list[Row], out: np.ndarray, now: float) -> None:
        """Applies a multi-step decode call's results: out int32 [B, K, 2] (token, logprob
        f32 bits) per step; row b sampled its first rows[b].n steps."""
        lps = out[..., 1].view(np.float32)
        for i in range(out.shape[1]):
            live = [b for b, row in enumerate(rows) if row.n > i]
            if not live:
                break
            self.commit_results([rows[b] for b in live], out[live, i, 0].tolist(),
                                lps[live, i].tolist(), now)

    def commit_spec_steps(self, rows: list[Row], out: np.ndarray, now: float) -> None:
        """Applies a speculative decode call's results out int32 [B, K, 2(γ+1) + 4], step by
        step (row b ran its first rows[b].n steps)."""
        for i in range(out.shape[1]):
            live = [b for b, row in enumerate(rows) if row.n > i]
            if not live:
                break
            self.commit_spec_results([rows[b] for b in live], out[live, i], now)

    def commit_spec_results(self, rows: list[Row], out: np.ndarray, now: float) -> None:
        """Applies one speculative decode sub-step's results: out int32 [B, 2K + 4] (K = γ+1)
        = tokens [K], logprob f32 bits [K], n_emit, accepted g, verified ell, new committed
        length (`spec_step.spec_decode_packed`). Tokens after a stop token or past
        max_new_tokens are discarded; the row's position becomes exact again (+ K per step
        still in flight)."""
        K = self.spec_width
        lps = out[:, K:2 * K].view(np.float32)
        for i, row in enumerate(rows):
            seq = row.seq
            if row.epoch != seq.epoch:
                continue
            seq.in_flight -= 1
            n_emit, g, ell, length = (int(v) for v in out[i, 2 * K:2 * K + 4])
            if n_emit == 0 or seq.finish is not None:
                continue                       # inactive, or past a stop (async lag)
            seq.spec_steps += 1
            seq.spec_log.append((ell, g))
            seq.pos = min(length + K * seq.in_flight, self._end_cap(seq))
            self.spec_row_steps += 1
            self.spec_verified += ell
            self.spec_accepted += g
            self.spec_committed += n_emit
            if seq.t_first is None:
                seq.t_first = now
            seq.t_last = now
            for tok, lp in zip(out[i, :n_emit].tolist(), lps[i, :n_emit].tolist()):
                seq.generated.append(tok)
                seq.logprobs.append(lp)
                if tok in seq.stops:
                    self.finish(seq, "stop")
                    break
                if len(seq.generated) >= seq.req.max_new_tokens:
                    self.finish(seq, "length")
                    break

    def pack(self, rows: list[Row], n_rows: int, width: int | None) -> np.ndarray:
        """The packed inputs of a sub-batch padded to n_rows: int32 [n_rows, PACK_HEAD +
        max_pages + (width or 0)], per row meta (META_COLUMNS), fparams (temperature, top_p,
        min_p as f32 bits), the block table, then the prefill tokens (`step.unpack`).
        Padding rows: slot = max_batch, n_new = 0, top_p = 1. Row k sits at
        `row_positions(rows, n_rows)[k]` (k itself with one shard)."""
        H = PACK_HEAD + self.max_pages
        out = np.zeros((n_rows, H + (width or 0)), np.int32)
        k = len(rows)
        if self.shards == 1:
            at = slice(None, k)
            out[k:, :H] = self._pad_row
        else:
            at = self.row_positions(rows, n_rows)
            out[:, :H] = self._pad_row
        if k:
            out[at, :H] = self.slot_rows[[row.seq.slot for row in rows]]
            out[at, 1] = [row.start for row in rows]
            out[at, 2] = [row.n for row in rows]
            out[at, 4] = [row.seq.fresh for row in rows]
            if width is not None:
                at = range(k) if self.shards == 1 else at
                for i, row in zip(at, rows):
                    seq = row.seq
                    out[i, H:H + row.n] = seq.ext_arr[row.start:row.start + row.n]
                    if self.spec_width and row.start + row.n == len(seq.ext):
                        anchor = -1 if seq.resume_anchor is None else seq.resume_anchor
                        out[i, 10:14] = (1, seq.req.max_new_tokens - len(seq.generated)
                                         - (anchor < 0), seq.spec_steps, anchor)
        return out

    # ------------------------------------------------------------------ imported requests
    def _admit_imported(self, seq: Seq) -> bool:
        """Admission of a request whose prefill ran in another engine (`seq.imported`, a
        `transfer.RequestState`; seq.generated already holds its tokens): a slot and fresh
        pages for its `position` positions, no prefill (generated[-1] is the next decode
        input); `on_import` writes the state into them."""
        rs = seq.imported
        assert self.on_import is not None, "an imported request needs on_import"
        seq.ext = seq.prompt + seq.generated[:-1]
        for shard in self._shard_order(seq):
            seq.shard, seq.slot, seq.pages = shard, self.shard_free[shard].pop(), []
            if self._allocate(seq, rs.position, None, may_preempt=False):
                break
            self._release_slot(seq)
        else:
            return False
        seq.ext_arr = np.asarray(seq.ext, np.int32)
        seq.pos, seq.row_floor, seq.fresh, seq.resume_anchor = len(seq.ext), 0, False, None
        seq.cached_tokens = seq.replayed_tokens = 0
        r = seq.req
        head = self.slot_rows[seq.slot, :PACK_HEAD]
        head[:7] = (seq.slot, 0, 0, 0, 0, r.top_k, np.array(r.seed, np.uint32).view(np.int32))
        head[7:10] = np.array([r.temperature, r.top_p, r.min_p], np.float32).view(np.int32)
        seq.admit_order = self._admissions
        self._admissions += 1
        self.shard_admissions[seq.shard] += 1
        self.running.append(seq)
        self.on_import(seq, rs)
        seq.imported = None                 # a later preemption resumes by re-prefilling
        return True
