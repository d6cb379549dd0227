"""Prefill / decode separation (engine/transfer.py): `Engine.prefill` in engine A, the
`RequestState`s pickled, `generate` / `stream` of engine B continuing them.

Oracles: `di.generate` per request (test_engine.reference, one ragged batch, contiguous state),
a single engine doing prefill and decode, `generate(..., speculative=...)`
(test_engine_speculative) and the constrained `generate` (test_engine_structured); bytes
against the state layout's own sizes (`state.state_shapes`, `paged_state.pool_bytes_per_page`).
Every engine has test_engine's device shapes, so the sub-steps compile as there (the transfer
programs compile once per page-count bucket).
"""

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.engine import Engine, Request, RequestOutput, RequestState
from deepinfer_fn.engine.paged_state import POOL_KEYS, pool_bytes_per_page
from deepinfer_fn.state import state_shapes
from test_engine import N_NEW, SHAPES, params, prompts_long, prompts_shared, reference

TEMPS = (0.0, 1.0, 0.8, 0.0, 1.3, 0.7)
SEEDS = (0, 7, 11, 3, 99, 5)


def engine(**kw):
    return Engine(params(), **{**SHAPES, **kw})


def requests(prompts, temps=TEMPS, seeds=SEEDS, n=N_NEW):
    return [Request(list(p), max_new_tokens=n, temperature=t, seed=s, request_id=f"r{i}")
            for i, (p, t, s) in enumerate(zip(prompts, temps, seeds))]


def shipped(states):
    """The states as another process receives them."""
    return pickle.loads(pickle.dumps(states))


def expected_nbytes(eng: Engine, rs: RequestState) -> int:
    """Ring bytes of one slot + pool bytes of its pages + the token arrays (from the layout)."""
    cfg, st = eng.cfg, eng.state
    shapes = state_shapes(cfg, 1, st.max_len, st.window_slots, eng.params.dtype)
    rings = sum(s.size * s.dtype.itemsize for layer in shapes for k, s in layer.items()
                if k not in POOL_KEYS)
    pages = -(-rs.position // eng.page_size) * pool_bytes_per_page(cfg, eng.page_size,
                                                                   eng.params.dtype)
    drafter = sum(x.size * x.dtype.itemsize
                  for x in jax.tree.leaves(st.spec.get("drafter", {}))) // eng.max_batch
    return rings + pages + drafter + 4 * (len(rs.prompt) + 2 * len(rs.generated))


def expected():
    """generate()'s tokens for requests(prompts_long()[:5])."""
    return reference(prompts_long()[:5], TEMPS[:5], SEEDS[:5])


def test_prefill_in_a_decode_in_b_equals_generate():
    """4 requests (greedy and sampled) prefilled in A, pickled, decoded in B next to a plain
    request, with a pool small enough that B preempts (imports resume by re-prefilling):
    every token equals generate()'s (test_engine: a single engine's too); stream pieces add
    up; the bytes reported are the layout's; every page of both engines is free or cached at
    the end."""
    want = expected()
    a, b = engine(max_tokens_per_step=70), engine(max_tokens_per_step=40)
    reqs = requests(prompts_long()[:5])
    states = a.prefill(reqs[:4])
    assert all(isinstance(s, RequestState) for s in states)
    for s, w in zip(states, want):
        assert s.generated.tolist() == w[:1] and s.budget == N_NEW - 1
        assert s.nbytes == sum(x.nbytes for x in s.arrays()) == expected_nbytes(a, s)
    print(f"\nTRANSFER bytes per request {[s.nbytes for s in states]}")
    pieces, finals = {}, {}
    for ev in b.stream(shipped(states) + reqs[4:]):
        pieces.setdefault(ev.request_id, []).extend(ev.tokens)
        if ev.output is not None:
            finals[ev.request_id] = ev.output
    assert b.last_run.preemptions > 0
    for i, w in enumerate(want[:4]):
        o = finals[f"r{i}"]
        assert o.finish_reason == "length" and o.tokens == w, (i, o.error)
        assert pieces[f"r{i}"] == w and len(o.logprobs) == N_NEW
        np.testing.assert_allclose(o.logprobs[0], states[i].logprobs[0])
    assert finals["r4"].tokens == want[4]
    for eng in (a, b):
        assert eng.pages.free_count + eng.cache.num_nodes == eng.pages.capacity


@pytest.mark.parametrize("replay", [128, pytest.param(None, marks=pytest.mark.heavy)])
def test_prefix_cache_hit_in_the_prefill_engine(replay):
    """A prefills a shared system prompt, then three requests hitting it (their shared pages
    are cache pages of A): bounded replay (R = 128) gives the tokens of a single engine with
    the same cache history, exact mode generate()'s."""
    prompts = [list(p) for p in prompts_shared()]
    a, b = engine(max_tokens_per_step=70, replay_tokens=replay), engine(max_tokens_per_step=70)
    states = a.prefill(prompts[:1], max_new_tokens=N_NEW)
    states += a.prefill(prompts[1:], max_new_tokens=N_NEW)
    assert a.last_run.cache_hit_tokens == 3 * 192
    got = [o.tokens for o in b.generate(shipped(states))]
    if replay is None:
        assert got == reference(prompts)
        return
    single = engine(max_tokens_per_step=70, replay_tokens=replay)
    ref = [o.tokens for o in single.generate(prompts[:1], max_new_tokens=N_NEW)
           + single.generate(prompts[1:], max_new_tokens=N_NEW)]
    assert single.last_run.cache_hit_tokens == 3 * 192
    assert got == ref


def test_requests_ending_in_prefill_and_bad_states_fail_alone():
    """prefill returns the final output of a request that ends there (max_new_tokens 1, a stop
    token first, a bad request); B rejects an inconsistent or incompatible state with an error
    naming the problem while a good state next to it decodes as generate()."""
    prompts, want = prompts_long(), expected()
    a = engine(max_tokens_per_step=70)
    outs = a.prefill([Request(list(prompts[0]), max_new_tokens=N_NEW, request_id="good"),
                      Request(list(prompts[0]), max_new_tokens=1, request_id="one"),
                      Request(list(prompts[1]), stop_tokens=[want[1][0]], temperature=TEMPS[1],
                              seed=SEEDS[1], request_id="stop"),
                      Request([1, 2, 99999], request_id="bad")])
    good, one, stop, bad = outs
    assert isinstance(good, RequestState)
    assert isinstance(one, RequestOutput) and one.finish_reason == "length"
    assert one.tokens == want[0][:1]
    assert stop.finish_reason == "stop" and stop.tokens == want[1][:1]
    assert bad.finish_reason == "error" and "vocabulary" in bad.error
    fp = dict(good.fingerprint, page_size=32)
    broken = {
        "page_size (state 32, engine 16)": dataclasses.replace(good, fingerprint=fp),
        "position": dataclasses.replace(good, position=good.position + 1),
        "ring array 0": dataclasses.replace(good, rings=(good.rings[0][:1],) + good.rings[1:]),
    }
    for i, s in enumerate(broken.values()):
        s.request = dataclasses.replace(s.request, request_id=f"broken{i}")
    b = engine(max_tokens_per_step=70)
    got = b.generate([*broken.values(), good])
    for (words, _), o in zip(broken.items(), got):
        assert o.finish_reason == "error" and words in o.error, (words, o.error)
        assert o.error.startswith("RequestState import:")
    assert got[-1].tokens == want[0]
    # engines that differ in page size, window, dtype, speculative method, model config:
    # nothing compiles (the error comes at submission)
    tiny = di.init_params(di.ModelConfig.preset("tiny"), jax.random.key(0), dtype=jnp.float32)
    bf16 = di.load_params(di.default_model_path(), dtype=jnp.bfloat16)
    w = a.state.window_slots
    for other, words in ((engine(page_size=32), "page_size (state 16, engine 32)"),
                         (engine(window_slots=2 * w), f"window_slots (state {w}, engine {2 * w})"),
                         (Engine(bf16, **SHAPES), "dtype (state 'float32', engine 'bfloat16')"),
                         (engine(speculative="mtp", num_draft_tokens=3),
                          "speculative method (state None, engine 'mtp')"),
                         (Engine(tiny, **{**SHAPES, "page_size": None}),
                          "model config differs in")):
        o = other.generate([good])[0]
        assert o.finish_reason == "error" and words in o.error, o.error
    with pytest.raises(TypeError, match="RequestState"):
        a.prefill([good])


@pytest.mark.heavy   # a speculative engine's prefill and decode programs
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_speculative_transfer_equals_generate_speculative(method):
    """Speculative A -> speculative B: the drafter state and counters move with the slot, so
    greedy and sampled requests give generate(speculative=...)'s tokens."""
    from test_engine_speculative import SEEDS as S, TEMPS as T, engine as spec_engine
    from test_engine_speculative import spec_reference
    prompts = prompts_long()
    want, _ = spec_reference(method, prompts, T, S)
    a, b = spec_engine(method, max_tokens_per_step=70), spec_engine(method, max_tokens_per_step=40)
    states = a.prefill(requests(prompts, T, S))
    for s in states:
        assert s.spec == dict(length=s.position, left=N_NEW - 1, step=0) and s.drafter
        assert s.nbytes == expected_nbytes(a, s)
    outs = b.generate(shipped(states))
    for i, o in enumerate(outs):
        assert o.tokens == want[i], (i, o.error)
    assert b.last_run.spec_row_steps > 0


@pytest.mark.heavy   # the constrained forward / masked sampling programs
def test_constrained_transfer_equals_generate():
    """Constrained requests: the first token is drawn under A's mask, B's matcher is replayed
    over it and continues: tokens and constraint status equal the constrained generate()."""
    pytest.importorskip("llguidance")
    from test_engine_structured import _requests, reference as cref, tokenizer
    ref_tokens, ref_status = cref()
    a = Engine(params(), tokenizer=tokenizer(), **SHAPES)
    b = Engine(params(), tokenizer=tokenizer(), **SHAPES)
    outs = b.generate(shipped(a.prefill(_requests())))
    for i, o in enumerate(outs):
        assert o.tokens == ref_tokens[i], (i, o.error)
        assert o.constraint_status == ref_status[i]


def test_scheduler_writes_an_import_before_it_can_be_preempted():
    """Host only: an imported request gets a slot and ceil(position / page_size) fresh pages,
    and `on_import` runs at its admission, before a prefill row of the same step preempts it
    (its blocks go to the prefix cache then, so they must hold the state); it resumes by
    re-prefilling prompt + generated."""
    from types import SimpleNamespace
    from deepinfer_fn.engine.pages import PageAllocator
    from deepinfer_fn.engine.radix import RadixCache
    from deepinfer_fn.engine.scheduler import Scheduler, Seq
    pages = PageAllocator(6)
    sched = Scheduler(max_batch=2, max_tokens_per_step=64, prefill_shapes=((2, 32),),
                      page_size=16, max_pages=8, pages=pages, cache=RadixCache(16, pages),
                      replay_tokens=None)
    events = []
    sched.on_import = lambda seq, rs: events.append(("import", list(seq.pages)))
    sched.on_finish = lambda seq, reason: events.append(("finish", reason))
    w = Seq(Request(list(range(2, 66)), max_new_tokens=4), 0, list(range(2, 66)), frozenset(), 0.0)
    x_prompt = list(range(100, 138))
    x = Seq(Request(x_prompt, max_new_tokens=4), 1, x_prompt, frozenset(), 0.0,
            generated=[7, 8, 9], imported=SimpleNamespace(position=40))
    sched.add(w)
    sched.add(x)
    plan = sched.schedule()                     # w: first chunk; x: imported (3 pages)
    assert events == [("import", x.pages)] and len(x.pages) == 3 and pages.free_count == 0
    assert x.pos == 40 and not x.prefilling and x.wants_decode() and x.imported is None
    assert [r.seq for r in plan.prefill] == [w] and not plan.decode
    sched.commit_plan(plan)
    plan = sched.schedule()                     # w's next chunk preempts x (the youngest)
    assert x.slot is None and x in sched.waiting and sched.preemptions == 1
    assert sched.cache.match(x_prompt + [7, 8]) != []       # x's full blocks were cached
    assert [r.seq for r in plan.prefill] == [w] and len(events) == 1
    sched.commit_plan(plan)
    sched.commit_results(plan.prefill, [5], [0.0], 0.0)
    while x.slot is None:
        sched.commit_plan(plan := sched.schedule())
        sched.commit_results([r for r in plan.prefill + plan.decode if r.samples],
                             [5] * 8, [0.0] * 8, 0.0)
    assert x.ext == x_prompt + [7, 8, 9] and len(events) == 1 + (w.finish is not None)
