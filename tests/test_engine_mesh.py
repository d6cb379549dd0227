"""The offline engine on a dp x ep mesh (8 fake CPU devices, golden cfg_a params, f32).

Each of the n = dp x ep batch shards owns max_batch / n slots and its own page pool and
prefix cache; requests are assigned to shards at admission. Oracle: the single-device engine
(same request stream, a pool large enough that nothing is preempted): identical tokens and
logprobs for greedy and sampled requests, with preemptions and a prefix-cache hit on the mesh.
The compiled steps are checked for all-gathers of the slot rings and page pools. Heavy: the
speculative engines (MTP, DSpark) on dp=2,ep=4 with preemption; the dp=8, ep=8 and
dp=2,ep=2,tp=2 meshes; request states moved between the mesh and one device.
"""

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardings
from conftest import golden_params
from deepinfer_fn.engine import Engine, Request
from deepinfer_fn.engine.pages import PageAllocator
from deepinfer_fn.engine.paged_state import shard_axes
from deepinfer_fn.engine.radix import RadixCache
from deepinfer_fn.engine.scheduler import Scheduler, Seq
from deepinfer_fn.engine.step import decode_steps_packed, substep_packed
from deepinfer_fn.errors import ArgumentError

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

N_NEW = 6
# 16 slots = 2 per shard; one prefill row and two decode rows per shard; 5 usable pages (80
# tokens) per shard on the mesh: two of the longer requests in one shard preempt.
SHAPES = dict(max_batch=16, page_size=16, max_len=128, max_tokens_per_step=256,
              prefill_shapes=((8, 32),), decode_buckets=(16,), progress=False)
MESH_PAGES = 6


def _mesh_params(name="cfg_a", **mesh):
    return shardings.shard_params(golden_params(name), shardings.make_mesh(**mesh))


@functools.cache
def prompts():
    rng = np.random.default_rng(5)
    return tuple(tuple(rng.integers(2, 256, n).tolist())
                 for n in (44, 20, 58, 37, 9, 50, 26, 41, 33, 47, 15, 53))


def requests(ps, offset=0):
    """Alternating greedy and sampled (temperature 1, some with top_k) requests."""
    return [Request(list(p), max_new_tokens=N_NEW, temperature=0.0 if i % 2 else 1.0,
                    top_k=0 if i % 3 else 20, seed=100 + offset + i, request_id=offset + i)
            for i, p in enumerate(ps)]


def second_call(ps):
    """Requests sharing a cached 48-token prefix of the first call's prompts."""
    rng = np.random.default_rng(6)
    return [list(ps[i][:48]) + rng.integers(2, 256, 7).tolist() for i in (2, 5)]


@pytest.fixture(scope="module")
def runs():
    """(mesh engine, mesh outputs, single-device outputs) of two generate calls."""
    ps = prompts()
    mesh_eng = Engine(_mesh_params(dp=2, ep=4), num_pages=MESH_PAGES, **SHAPES)
    single = Engine(golden_params("cfg_a"), **SHAPES)
    outs = {}
    for name, eng in (("mesh", mesh_eng), ("single", single)):
        first = eng.generate(requests(ps))
        pre = eng.last_run.preemptions
        second = eng.generate(requests(second_call(ps), offset=100))
        outs[name] = (first, second, pre)
    return mesh_eng, outs["mesh"], outs["single"], single


def test_mesh_engine_equals_single_device_engine(runs):
    eng, (m1, m2, pre), (s1, s2, single_pre), _ = runs
    assert eng.shards == 8 and single_pre == 0
    assert pre > 0, "the mesh engine's small per-shard pools should preempt"
    for a, b in zip(m1 + m2, s1 + s2):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.tokens == b.tokens, a.request_id
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert sum(o.metrics.preemptions for o in m1) == pre
    assert max(o.metrics.cached_tokens for o in m2) >= 32, "the shared prefix should hit"


def test_requests_spread_over_shards_and_pools_are_whole_again(runs):
    eng, *_ = runs
    sched = eng.scheduler
    assert min(sched.shard_admissions) >= 1, sched.shard_admissions
    assert not sched.has_work()
    assert sorted(sched.free_slots) == list(range(eng.max_batch))
    for pages, cache in zip(eng.shard_pages, eng.shard_caches):
        assert pages.free_count + cache.num_nodes == pages.capacity
    # the state keeps its split: slots / pages over the batch shards after every step
    axes = jax.tree.leaves(shard_axes(eng.state))
    want = shardings.mesh.batch_split_shardings(axes, eng.mesh)
    for leaf, ax, sh in zip(jax.tree.leaves(eng.state), axes, want):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), (leaf.shape, leaf.sharding)
        assert leaf.addressable_shards[0].data.shape[ax] * 8 == leaf.shape[ax]


@pytest.mark.parametrize("program", ["prefill", "decode"])
def test_compiled_step_gathers_no_pool(runs, program):
    """No all-gather in the compiled prefill sub-step / multi-step decode call produces a
    whole (global) ring or pool: the gathers and scatters of slots and pages run per shard."""
    eng, *_ = runs
    rows, width = eng.prefill_shapes[0] if program == "prefill" else (eng.decode_buckets[0], None)
    with jax.set_mesh(eng.mesh):
        packed = jax.device_put(eng.scheduler.pack([], rows, width),
                                shardings.mesh.batch_split_shardings(0, eng.mesh))
        if program == "prefill":
            low = substep_packed.lower(eng.params, eng.state, packed)
        else:
            low = decode_steps_packed.lower(eng.params, eng.state, packed,
                                            steps=eng.scheduler.decode_steps)
        hlo = low.compile().as_text()
    whole = {_hlo_type(x) for x in jax.tree.leaves((eng.state.pools, eng.state.slots))}
    assert "all-to-all" in hlo          # the experts' EP exchange is there
    assert not whole & _all_gathered(hlo), sorted(whole & _all_gathered(hlo))
    # control: replicating a pool is an all-gather of its whole shape, which the check sees
    pool = jax.tree.leaves(eng.state.pools)[0]
    replicate = jax.jit(lambda x: x * 1, out_shardings=NamedSharding(eng.mesh, P()))
    assert _hlo_type(pool) in _all_gathered(replicate.lower(pool).compile().as_text())


def _hlo_type(x) -> tuple:
    """(HLO element type, shape) of an array: f32 / s32 / bf16 / pred ..."""
    dt = np.dtype(x.dtype)
    name = ("pred" if dt == np.bool_ else "bf16" if dt.name == "bfloat16"
            else {"f": "f", "i": "s", "u": "u"}[dt.kind] + str(8 * dt.itemsize))
    return name, tuple(x.shape)


def _all_gathered(hlo: str) -> set:
    """(element type, shape) of the results of the all-gathers in compiled HLO text."""
    return {(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
            for m in re.finditer(r"= (\w+)\[([\d,]*)\]\{[^}]*\} all-gather\(", hlo)}


@pytest.mark.heavy      # the transfer gather / scatter programs, on the mesh and off it
def test_request_states_move_between_mesh_and_single_device(runs):
    """Prefill on the mesh, decode on one device, and the other way round (`Engine.prefill`
    exports a request's slot and pages from its shard; an import lands in a shard's slot and
    pool): the tokens of one single-device engine doing both."""
    mesh_eng, *_, single = runs
    reqs = lambda: requests(prompts()[:5], offset=200)
    want = [o.tokens for o in single.generate(reqs())]
    assert [o.tokens for o in single.generate(mesh_eng.prefill(reqs()))] == want
    assert [o.tokens for o in mesh_eng.generate(single.prefill(reqs()))] == want
    assert not mesh_eng.scheduler.has_work()
    for pages, cache in zip(mesh_eng.shard_pages, mesh_eng.shard_caches):
        assert pages.free_count + cache.num_nodes == pages.capacity


def test_mesh_engine_errors():
    params = _mesh_params(dp=2, ep=4)
    with pytest.raises(ArgumentError, match="multiple of the mesh's 8 batch shards"):
        Engine(params, **{**SHAPES, "max_batch": 12, "decode_buckets": (16,)})
    with pytest.raises(ArgumentError, match="multiple of the 8 batch shards"):
        Engine(params, **{**SHAPES, "prefill_shapes": ((4, 32),)})
    with pytest.raises(ArgumentError, match="multiples of the mesh's 8 batch shards"):
        Engine(params, **{**SHAPES, "decode_buckets": (12, 16)})


@pytest.mark.heavy
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_speculative_mesh_engine_equals_single_device(method):
    """A speculative engine on dp=2,ep=4 (spec state split by slot): the tokens and
    acceptance counts of the single-device speculative engine, greedy and sampled."""
    from deepinfer_fn.speculative import dspark
    base = golden_params("cfg_a_mtp" if method == "mtp" else "cfg_a")
    kw = dict(speculative="mtp", num_draft_tokens=2)
    if method == "dspark":
        dcfg = dspark.DSparkConfig.for_target(base.config, markov_rank=8, window=16)
        kw = dict(speculative="dspark",
                  drafter=dspark.init_dspark(base.config, dcfg, jax.random.key(4)))
    ps = prompts()
    mesh = Engine(shardings.shard_params(base, shardings.make_mesh(dp=2, ep=4)),
                  num_pages=MESH_PAGES, **SHAPES, **kw)
    single = Engine(base, **SHAPES, **kw)
    m, s = mesh.generate(requests(ps)), single.generate(requests(ps))
    for a, b in zip(m, s):
        assert a.tokens == b.tokens, a.request_id
        assert a.metrics.accepted == b.metrics.accepted
    assert min(mesh.scheduler.shard_admissions) >= 1
    assert mesh.last_run.preemptions > 0 and single.last_run.preemptions == 0


@pytest.mark.heavy
@pytest.mark.parametrize("kw", [dict(dp=8), dict(ep=8), dict(dp=2, ep=2, tp=2)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_other_meshes_equal_single_device(kw, runs):
    """dp only, ep only, and a mesh with a tp axis (4 batch shards, replicated over tp)."""
    _, _, (s1, s2, _), _ = runs
    eng = Engine(_mesh_params(**kw), num_pages=MESH_PAGES * 2, **SHAPES)
    assert eng.shards == kw.get("dp", 1) * kw.get("ep", 1)
    m1 = eng.generate(requests(prompts()))
    m2 = eng.generate(requests(second_call(prompts()), offset=100))
    assert [o.tokens for o in m1 + m2] == [o.tokens for o in s1 + s2]
    assert min(eng.scheduler.shard_admissions) >= 1


def _seq(i, prompt):
    return Seq(Request(prompt, max_new_tokens=4), i, list(prompt), frozenset(), 0.0)


def test_scheduler_places_requests_by_prefix_hit_then_load():
    """Host only, 4 shards of 2 slots: a request with a cached prefix goes to the shard
    holding it, the others to the shards with the most free slots; each shard's rows sit in
    its row block with its own slots and shard-local pages; prefill rows per shard are capped
    at rows / 4."""
    n, ps = 4, 16
    pages = [PageAllocator(12) for _ in range(n)]
    caches = [RadixCache(ps, p) for p in pages]
    prefix = list(range(2, 34))
    held = pages[2].allocate(2)
    caches[2].insert(prefix, held)
    for p in held:
        pages[2].release(p)                       # only the tree holds them now
    sched = Scheduler(max_batch=8, max_tokens_per_step=256, prefill_shapes=((4, 32), (8, 16)),
                      page_size=ps, max_pages=8, pages=pages, cache=caches, replay_tokens=None,
                      shards=n)
    rng = np.random.default_rng(0)
    seqs = [_seq(0, rng.integers(40, 99, 20).tolist())]
    seqs.append(_seq(1, prefix + [7, 8, 9]))
    seqs += [_seq(i, rng.integers(100, 200, 20 + i).tolist()) for i in range(2, 7)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    shard_of = {s.index: s.shard for s in sched.running}
    assert shard_of[1] == 2 and seqs[1].cached_tokens == 32
    assert len(sched.running) == 7               # admitted while fewer than 8 prefill
    assert sorted(shard_of[i] for i in range(4)) == [0, 1, 2, 3]    # most free slots first
    assert np.bincount(list(shard_of.values())).tolist() == [2, 2, 2, 1]
    assert all(s.slot // 2 == s.shard for s in sched.running)
    R = plan.prefill_shape[0]
    assert np.bincount([row.shard for row in plan.prefill]).max() <= R // n
    assert all(0 < p < 12 for s in sched.running for p in s.pages)   # shard-local page ids
    rows = plan.prefill
    packed = sched.pack(rows, *plan.prefill_shape)
    pos = sched.row_positions(rows, R)
    for row, at in zip(rows, pos):
        assert at // (R // n) == row.shard and packed[at, 0] == row.seq.slot
    pad = np.setdiff1d(np.arange(R), pos)
    assert (packed[pad, 0] == 8).all() and (packed[pad, 2] == 0).all()
    # a sub-batch fitting 2 rows of one shard needs the bucket with 2 rows per shard
    one_each = list({row.shard: row for row in rows}.values())
    assert len(one_each) == 4 and sched.sub_batch_rows(one_each, (4, 8)) == 4
    assert sched.sub_batch_rows(one_each + one_each[:1], (4, 8)) == 8
