"""Engine prefix cache under both scheduling modes, eviction under pool pressure, cancel.

Oracle: `di.generate` (contiguous state, no cache) on the embedded default model in f32, and,
for eviction, brute-force page accounting on the host. Every engine here has the same device
shapes (max_batch 2, 16-token pages, a 41-page pool = two full-length requests, prefill rows
[2, 32], decode rows [2, 1]), so the sub-step compiles once per session.
"""

import functools
import threading

import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.engine import Engine, Request
from deepinfer_fn.engine.pages import PageAllocator
from deepinfer_fn.engine.radix import RadixCache
from deepinfer_fn.engine.scheduler import Scheduler, Seq
from test_engine import params

N_NEW = 4
SHAPES = dict(max_batch=2, page_size=16, max_len=320, num_pages=41, max_tokens_per_step=70,
              prefill_shapes=((2, 32),), decode_buckets=(2,), progress=False)
HIT = 288           # 18 full pages of the 300-token shared prefix


def engine(**kw):
    return Engine(params(), **{**SHAPES, **kw})


@functools.cache
def prompts():
    """Four prompts sharing a 300-token prefix (P), two sharing another one (Q)."""
    rng = np.random.default_rng(5)
    p, q = rng.integers(2, 4096, 300).tolist(), rng.integers(2, 4096, 300).tolist()
    ps = [p + rng.integers(2, 4096, k).tolist() for k in (3, 5, 7, 4)]
    qs = [q + rng.integers(2, 4096, k).tolist() for k in (6, 2)]
    return tuple(map(tuple, ps + qs))


@functools.cache
def reference() -> list[list[int]]:
    """generate() of all six prompts in one ragged batch."""
    ps = prompts()
    toks = np.zeros((len(ps), max(map(len, ps))), np.int32)
    for i, p in enumerate(ps):
        toks[i, :len(p)] = p
    out = di.generate(params(), toks, lengths=np.array([len(p) for p in ps]),
                      max_new_tokens=N_NEW)
    return [row.tolist() for row in np.asarray(out.tokens)]


@pytest.mark.parametrize("replay", [None, 128])
def test_shared_prefix_reuse_is_the_same_in_both_modes(replay):
    """Four requests sharing a 300-token prefix, two slots: the later two reuse the 18 cached
    pages in asynchronous and synchronous scheduling alike (the pool is mostly free, so
    nothing is evicted); exact mode (replay None) gives generate()'s tokens, and both modes
    give the same tokens for either replay setting."""
    req = [list(p) for p in prompts()[:4]]
    got = {}
    for mode in (True, False):
        eng = engine(async_scheduling=mode, replay_tokens=replay)
        outs = eng.generate(req, max_new_tokens=N_NEW)
        got[mode] = ([o.metrics.cached_tokens for o in outs], [o.tokens for o in outs])
        assert all(o.finish_reason == "length" for o in outs)
        assert eng.last_run.cache_hit_tokens == 2 * HIT
        assert eng.pages.free_count + eng.cache.num_nodes == eng.pages.capacity
    assert got[True][0] == got[False][0] == [0, 0, HIT, HIT]
    assert got[True][1] == got[False][1]
    if replay is None:
        assert got[True][1] == reference()[:4]


@pytest.mark.parametrize("mode", [True, False])
def test_eviction_under_pool_pressure(mode):
    """Two prefixes interleaved (P, Q, P, Q): the first pair fills the whole pool, whose blocks
    all go to the cache; admitting the second pair evicts only the pages it lacks (LRU leaves
    past the shared prefixes), so both still hit 288 tokens; tokens equal generate() (exact
    mode); at the end every page is free or cached."""
    ps = prompts()
    order = [0, 4, 1, 5]
    eng = engine(async_scheduling=mode, replay_tokens=None)
    outs = eng.generate([list(ps[i]) for i in order], max_new_tokens=N_NEW)
    assert [o.tokens for o in outs] == [reference()[i] for i in order]
    assert [o.metrics.cached_tokens for o in outs] == [0, 0, HIT, HIT]
    assert eng.last_run.preemptions == 0
    assert eng.pages.free_count + eng.cache.num_nodes == eng.pages.capacity
    # The first pair left 2 x 19 cached blocks (the pool's 40 pages minus two partial ones);
    # the second pair's two extra pages each came from the 2 free ones and 2 evicted leaves,
    # and it cached 2 new 19th blocks: 38 nodes, 2 pages free.
    assert eng.cache.num_nodes == 38 and eng.pages.free_count == 2


def _cache_path(cache: RadixCache, pages: PageAllocator, tokens: list[int]) -> list[int]:
    """Caches the blocks of `tokens` as a finished request would leave them (tree-held only)."""
    got = pages.allocate(len(tokens) // cache.page_size)
    cache.insert(tokens, got)
    for p in got:
        pages.release(p)
    return got


def _seq(i: int, tokens: list[int], max_new_tokens: int) -> Seq:
    return Seq(Request(tokens, max_new_tokens=max_new_tokens, request_id=i), i, tokens,
               frozenset(), 0.0)


def test_admission_evicts_only_the_shortfall_lru_first():
    """Host scheduler, 4-token pages, 10 usable pages: admission evicts exactly the pages it
    lacks, least recently used leaf first; it evicts nothing when eviction could not admit
    the request anyway; a page a running request holds is never evicted (brute-force page
    accounting)."""
    pages = PageAllocator(11)
    cache = RadixCache(4, pages)
    sched = Scheduler(max_batch=2, max_tokens_per_step=64, prefill_shapes=((2, 32),),
                      page_size=4, max_pages=8, pages=pages, cache=cache, replay_tokens=None)
    old = _cache_path(cache, pages, list(range(100, 116)))     # 4 blocks
    new = _cache_path(cache, pages, list(range(200, 216)))     # 4 blocks, more recent
    assert pages.free_count == 2 and cache.evictable() == 8
    # a: 12 tokens, no hit, first chunk 3 pages: 1 short -> the LRU leaf (old's last block).
    a = _seq(0, list(range(300, 312)), max_new_tokens=1)
    sched.add(a)
    plan = sched.schedule()
    assert [r.seq for r in plan.prefill] == [a] and len(a.pages) == 3 and old[3] in a.pages
    assert cache.num_nodes == 7 and pages.free_count == 0
    assert all(pages.refcount(p) == 1 for p in old[:3] + new)
    sched.commit_plan(plan)                 # a's 3 blocks are cached too (held by a)
    assert cache.num_nodes == 10 and cache.evictable() == 7
    # b: hits new[:3] (retained), first chunk 8 pages -> 5 short, only 4 other pages are
    # evictable (a's are held): not admitted, and nothing is evicted.
    b = _seq(1, list(range(200, 212)) + list(range(400, 420)), max_new_tokens=1)
    sched.add(b)
    assert not sched.schedule()
    assert b.slot is None and list(sched.waiting) == [b]
    assert cache.num_nodes == 10 and pages.free_count == 0
    assert all(pages.refcount(p) == 1 for p in old[:3] + new)
    # Evicting everything possible leaves exactly the pages the running request holds.
    assert cache.evict(100) == 7
    assert cache.num_nodes == 3 and pages.free_count == 7
    assert all(pages.refcount(p) == 2 for p in a.pages)


def test_cancel_applies_only_to_submitted_requests():
    """cancel(id): an unknown id raises ValueError naming it; a finished request's id is a
    no-op and a later request reusing the id runs to the end; a cancel from another thread
    mid-run ends that request alone ("cancelled", a prefix of its tokens) and does not carry
    over to the next run; a stream's requests can be cancelled before its first event."""
    ps = [list(p[-20:]) for p in prompts()[:3]]
    eng = engine()
    with pytest.raises(ValueError, match="'ghost'"):
        eng.cancel("ghost")
    base = eng.generate([Request(p, max_new_tokens=N_NEW, request_id=i)
                         for i, p in enumerate(ps)])
    assert all(o.finish_reason == "length" for o in base)
    eng.cancel(0)                                  # finished: no-op
    again = eng.generate([Request(ps[0], max_new_tokens=N_NEW, request_id=0)])[0]
    assert again.finish_reason == "length" and again.tokens == base[0].tokens

    outs, cancelled = {}, False
    reqs = [Request(ps[0], max_new_tokens=N_NEW, request_id="keep"),
            Request(ps[1], max_new_tokens=3 * N_NEW, request_id="late")]
    for ev in eng.stream(reqs):
        if ev.request_id == "late" and ev.tokens and not cancelled:
            t = threading.Thread(target=eng.cancel, args=("late",))
            t.start()
            t.join()
            cancelled = True
        if ev.request_id == "keep" and ev.output is not None:
            eng.cancel("keep")                     # finished within the run: no-op
        if ev.output is not None:
            outs[ev.request_id] = ev.output
    assert outs["keep"].finish_reason == "length" and outs["keep"].tokens == base[0].tokens
    late = outs["late"]
    assert late.finish_reason == "cancelled" and 0 < len(late.tokens) < 3 * N_NEW
    assert late.tokens[:N_NEW] == base[1].tokens[:len(late.tokens)]
    eng.cancel("late")                             # ended: no-op, and it does not outlive it
    out = eng.generate([Request(ps[1], max_new_tokens=N_NEW, request_id="late")])[0]
    assert out.finish_reason == "length" and out.tokens == base[1].tokens

    it = eng.stream([Request(ps[2], max_new_tokens=N_NEW, request_id="early"),
                     Request(ps[0], max_new_tokens=N_NEW, request_id="other")])
    eng.cancel("early")
    finals = {ev.request_id: ev.output for ev in it if ev.output is not None}
    assert finals["early"].finish_reason == "cancelled" and finals["early"].tokens == []
    assert finals["other"].tokens == base[0].tokens
    assert eng.pages.free_count + eng.cache.num_nodes == eng.pages.capacity
