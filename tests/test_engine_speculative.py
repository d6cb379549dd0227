"""Speculative decoding in the offline engine (Engine(speculative="dspark" | "mtp")).

Oracles: `generate(..., speculative=...)` (the while-loop implementation: same drafts, same
per-request counter-based keys) and plain greedy `generate` (test_engine.reference). Model: the
embedded default model in f32 with its shipped DSpark drafter and its MTP block. Every engine
here has test_engine's device shapes (max_batch 4, 16-token pages, 24-page pool, prefill rows
[2, 32], decode rows [4]); the generate references are padded to one shape per method, so each
method compiles one engine prefill, one engine decode step (DSpark: fixed and dynamic share it)
and one generate loop; the plain greedy reference is test_engine's (same compiled program).
"""

import functools

import jax
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn import speculative as spec
from deepinfer_fn.engine import Engine, Request
from deepinfer_fn.speculative.schedule import VerifyCost
from test_engine import N_NEW, SHAPES, params, prompts_long, prompts_shared, reference

TEMPS = (0.0, 0.8, 0.0, 0.8, 0.0, 0.8)
SEEDS = (0, 7, 3, 11, 5, 99)


@functools.cache
def drafter():
    return spec.load_dspark(spec.default_dspark_path(), params())


def gamma(method):
    return drafter().config.block_size if method == "dspark" else 3


def spec_kwargs(method):
    return dict(drafter=drafter()) if method == "dspark" else dict(num_draft_tokens=3)


def engine(method, **kw):
    """DSpark engines compile the verify forward at widths 3 and 1 + γ, so the fixed and the
    dynamic engines share one decode program (fixed / dynamic is a traced flag)."""
    if method == "dspark":
        kw.setdefault("verify_widths", (3, gamma("dspark") + 1))
    return Engine(params(), speculative=method, **{**SHAPES, **spec_kwargs(method), **kw})


@functools.cache
def spec_reference(method, prompts, temps, seeds):
    """generate(..., speculative=method) on the prompts padded to [6, 256] (extra rows repeat
    the first prompt): (tokens, logprobs) lists per prompt."""
    B = len(prompts)
    rows = list(prompts) + [prompts[0]] * (6 - B)
    toks = np.zeros((6, 256), np.int32)
    for i, p in enumerate(rows):
        toks[i, :len(p)] = p
    pad = lambda v: np.array(list(v) + [v[0]] * (6 - B))
    out = di.generate(params(), toks, lengths=np.array([len(p) for p in rows]),
                      max_new_tokens=N_NEW, temperature=pad(temps), seed=pad(seeds),
                      speculative=method, return_logprobs=True, **spec_kwargs(method))
    return ([r.tolist() for r in np.asarray(out.tokens)[:B]],
            [r.tolist() for r in np.asarray(out.logprobs)[:B]])


def requests(prompts, temps, seeds):
    return [Request(list(p), max_new_tokens=N_NEW, temperature=t, seed=s, request_id=i)
            for i, (p, t, s) in enumerate(zip(prompts, temps, seeds))]


@functools.cache
def mixed_run(method):
    """The 6 long prompts (greedy and T = 0.8 rows), random arrival order, budget 40 (prefill
    chunks and speculative decode rows interleave), pool small enough to preempt."""
    prompts = prompts_long()
    order = np.random.default_rng(4).permutation(len(prompts))
    reqs = requests(prompts, TEMPS, SEEDS)
    eng = engine(method, max_tokens_per_step=40)
    outs = eng.generate([reqs[i] for i in order])
    by_id = {o.request_id: o for o in outs}
    return [by_id[i] for i in range(len(prompts))], eng.last_run


def check_against_generate(method):
    outs, _ = mixed_run(method)
    want, want_lp = spec_reference(method, prompts_long(), TEMPS, SEEDS)
    for i, o in enumerate(outs):
        assert o.tokens == want[i], f"request {i} (T={TEMPS[i]})"
        np.testing.assert_allclose(o.logprobs, want_lp[i], atol=2e-4)


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_greedy_equals_plain_generate(method):
    """Greedy requests (mixed with sampled ones, random arrival, prefill interleaved with
    speculative decode, preemption) give plain greedy decoding's tokens; the sampled ones
    really sample."""
    outs, m = mixed_run(method)
    plain = reference(prompts_long())
    print(f"\n{method}: steps {m.steps}, preemptions {m.preemptions}, row-steps "
          f"{m.spec_row_steps}, mean ell {m.mean_verify_len:.2f}, acceptance "
          f"{m.acceptance_rate:.3f}, tau {m.tau:.2f}")
    for i, o in enumerate(outs):
        assert o.finish_reason == "length", (i, o.error)
        if TEMPS[i] == 0:
            assert o.tokens == plain[i], f"request {i}"
    assert any(outs[i].tokens != plain[i] for i in range(6) if TEMPS[i] > 0)


def test_dspark_equals_generate_speculative():
    """Greedy and sampled (T = 0.8, seeds) requests == generate(speculative="dspark") token for
    token (the engine keeps each slot's step counter on the device, so the draft / accept /
    final keys are generate's), logprobs equal."""
    check_against_generate("dspark")


@pytest.mark.heavy   # its own generate(speculative="mtp") compile
def test_mtp_equals_generate_speculative():
    """As the DSpark test, for the MTP drafter (k = 3)."""
    check_against_generate("mtp")


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_metrics(method):
    """acceptance in [0, 1]; every step verifies <= γ drafts and accepts <= verified; tau =
    tokens committed by verify steps / row-steps, and every generated token is either a
    prefill-sampled first token or committed by a verify step (no stop tokens here)."""
    outs, m = mixed_run(method)
    g = gamma(method)
    assert 0.0 <= m.acceptance_rate <= 1.0 and 0.0 <= m.mean_verify_len <= g
    ver = [v for o in outs for v in o.metrics.verified]
    acc = [a for o in outs for a in o.metrics.accepted]
    assert len(ver) == m.spec_row_steps and sum(ver) == m.spec_verified
    assert sum(acc) == m.spec_accepted
    assert all(0 <= a <= v <= g for a, v in zip(acc, ver))
    assert m.spec_committed == m.spec_accepted + m.spec_row_steps
    assert m.generated_tokens == len(outs) + m.spec_committed
    assert m.tau == pytest.approx(m.spec_committed / m.spec_row_steps)
    assert m.all_accepted_tokens_per_s == pytest.approx(
        m.spec_row_steps * (1 + g) / m.wall_s)
    for o in outs:            # per request: the steps' g + 1 add up to its tokens after the first
        if o.metrics.preemptions == 0:
            assert sum(a + 1 for a in o.metrics.accepted) == len(o.tokens) - 1


def test_dynamic_verify_length():
    """DSpark with verify_len="dynamic", a cost profile that rises with the columns and two
    compiled verify widths (3 and 1 + γ columns): some steps verify fewer drafts than the
    budget allows (the scheduler's ell < cap), the verified lengths vary, and the output still
    equals plain greedy decoding."""
    prompts = prompts_long()
    g = gamma("dspark")
    cost = VerifyCost.from_grid((4,), [[1.0 + 0.35 * s for s in range(g + 1)]])
    eng = engine("dspark", max_tokens_per_step=40, verify_len="dynamic", verify_cost=cost)
    outs = eng.generate(requests(prompts, (0.0,) * 6, SEEDS))
    m = eng.last_run
    plain = reference(prompts)
    below = 0
    for i, o in enumerate(outs):
        assert o.tokens == plain[i], f"request {i}"
        count = 1
        if o.metrics.preemptions == 0:
            for v, a in zip(o.metrics.verified, o.metrics.accepted):
                below += v < min(g, N_NEW - count - 1)
                count += a + 1
    ver = [v for o in outs for v in o.metrics.verified]
    print(f"\ndynamic: verified lengths {ver}, mean {m.mean_verify_len:.2f}, "
          f"acceptance {m.acceptance_rate:.3f}, steps below the cap {below}")
    assert len(set(ver)) > 1 and below > 0


def test_prefix_cache_and_preemption_exact():
    """Exact prefix-cache mode (replay_tokens=None): the shared-prompt requests hit the cache,
    and with two long prompts the pool is too small (preemption; the resumed request
    re-prefills up to its anchor and keeps its step counter). Every request's tokens ==
    generate(speculative="dspark"), greedy and sampled."""
    prompts = prompts_shared() + prompts_long()[:2]
    want, _ = spec_reference("dspark", prompts, TEMPS, SEEDS)
    reqs = requests(prompts, TEMPS, SEEDS)
    eng = engine("dspark", max_tokens_per_step=40, replay_tokens=None)
    outs = eng.generate(reqs[:1]) + eng.generate(reqs[1:])
    m = eng.last_run
    print(f"\nprefix+preempt: hits {m.cache_hit_tokens}, preemptions {m.preemptions}")
    assert m.cache_hit_tokens > 0 and m.preemptions > 0
    assert [o.tokens for o in outs] == want
    assert eng.pages.free_count + eng.cache.num_nodes == eng.pages.capacity


@functools.cache
def prompts_preempt():
    """A long prompt prefilling while a shorter one decodes: the pool runs out and the most
    recently admitted request is preempted in the middle of its decoding."""
    rng = np.random.default_rng(5)
    return tuple(tuple(rng.integers(2, 4096, n).tolist()) for n in (240, 110, 10, 20))


@pytest.mark.parametrize("method", ["dspark", pytest.param("mtp", marks=pytest.mark.heavy)])
def test_preemption_while_decoding_resumes_exactly(method):
    """A request preempted after it generated tokens (greedy or sampled) re-prefills prompt +
    generated[:-1], takes generated[-1] as its anchor and keeps its step counter: every
    request's tokens == generate(speculative=method)."""
    prompts = prompts_preempt()
    want, _ = spec_reference(method, prompts, TEMPS[:4], SEEDS[:4])
    eng = engine(method, max_tokens_per_step=70, replay_tokens=None)
    victims = []
    preempt = eng.scheduler._preempt

    def record(seq, plan):
        victims.append((seq.req.request_id, len(seq.generated)))
        preempt(seq, plan)

    eng.scheduler._preempt = record
    outs = eng.generate(requests(prompts, TEMPS[:4], SEEDS[:4]))
    print(f"\n{method} preemptions (request, tokens generated): {victims}")
    assert any(n > 0 for _, n in victims)
    assert [o.tokens for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)


def test_stop_token_ends_a_speculative_request():
    """The device does not know stop tokens: the host truncates right after the stop token
    even when it falls inside a verify step's accepted tokens."""
    prompts = prompts_long()
    plain = reference(prompts)
    reqs = [Request(list(p), max_new_tokens=N_NEW, stop_tokens=[w[5]], request_id=i)
            for i, (p, w) in enumerate(zip(prompts, plain))]
    outs = engine("dspark", max_tokens_per_step=40).generate(reqs)
    for o, w in zip(outs, plain):
        k = w.index(w[5])
        assert o.finish_reason == "stop" and o.tokens == w[:k + 1]


def test_bad_config():
    """Clear errors for a bad speculative configuration."""
    p = params()
    with pytest.raises(ValueError, match="drafter"):
        Engine(p, speculative="dspark", **SHAPES)
    tiny = di.ModelConfig.preset("tiny", num_mtp_layers=0)
    foreign = spec.init_dspark(tiny, spec.DSparkConfig.for_target(tiny), jax.random.key(0))
    with pytest.raises(ValueError, match="another target"):
        Engine(p, speculative="dspark", drafter=foreign, **SHAPES)
    no_mtp = di.Params({**p.weights, "mtp": ()}, p.config)
    with pytest.raises(ValueError, match="MTP block"):
        Engine(no_mtp, speculative="mtp", **SHAPES)
    with pytest.raises(ValueError, match="dynamic"):
        Engine(p, speculative="mtp", verify_len="dynamic", **SHAPES)
    with pytest.raises(ValueError, match="verify_cost"):
        Engine(p, speculative="dspark", drafter=drafter(), verify_len="dynamic", **SHAPES)
    with pytest.raises(ValueError, match="block size"):
        Engine(p, speculative="dspark", drafter=drafter(), num_draft_tokens=3, **SHAPES)
    with pytest.raises(ValueError, match="speculative"):
        Engine(p, speculative="eagle", **SHAPES)
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        Engine(p, speculative="mtp", **{**SHAPES, "max_tokens_per_step": 3})


def test_stream_early_close_and_cancel():
    """A speculative engine's stream delivers several tokens per event whose pieces add up to
    the final outputs (== plain greedy); closing the stream early drains the engine (no slot or
    page leaks, in-flight verify steps finish) and it then runs a new batch correctly; a
    request cancelled while decoding finishes "cancelled" with a prefix of its tokens."""
    prompts = prompts_long()
    plain = reference(prompts)
    eng = engine("dspark", max_tokens_per_step=40)
    pieces, finals, sizes = {}, {}, []
    for ev in eng.stream([Request(list(p), max_new_tokens=N_NEW, request_id=i)
                          for i, p in enumerate(prompts[:3])]):
        pieces.setdefault(ev.request_id, []).extend(ev.tokens)
        sizes.append(len(ev.tokens))
        if ev.output is not None:
            finals[ev.request_id] = ev.output
    for i in range(3):
        assert finals[i].tokens == plain[i] and pieces[i] == plain[i], i
    assert max(sizes) > 1                       # verify steps commit several tokens at once
    it = eng.stream([list(p) for p in prompts], max_new_tokens=N_NEW)
    next(it)
    it.close()
    assert not eng.scheduler.has_work()
    assert eng.pages.free_count + eng.cache.num_nodes == eng.pages.capacity
    assert sorted(eng.scheduler.free_slots) == list(range(eng.max_batch))
    outs = []
    for ev in eng.stream([Request(list(p), max_new_tokens=N_NEW, request_id=rid)
                          for p, rid in zip(prompts[3:5], ("keep", "late"))]):
        if ev.request_id == "late" and ev.tokens and ev.output is None:
            eng.cancel("late")
        if ev.output is not None:
            outs.append(ev.output)
    by_id = {o.request_id: o for o in outs}
    assert by_id["keep"].tokens == plain[3]
    late = by_id["late"]
    assert late.finish_reason == "cancelled" and late.tokens == plain[4][:len(late.tokens)]
    assert 0 < len(late.tokens) < N_NEW


def test_constrained_requests_run_plain_in_a_speculative_engine():
    """Constrained requests in a speculative engine run after the speculative ones as plain
    masked decoding (the engine's constrained path): every request equals generate() with one
    constraint per row (free rows: plain greedy; the statuses are generate's, whose validity
    test_engine_structured checks), a bad grammar fails alone, a waiting constrained request
    can be cancelled, and the speculative requests still verify drafts."""
    import test_engine_structured as tes
    ref_tokens, ref_status = tes.reference()
    eng = Engine(params(), speculative="dspark", tokenizer=tes.tokenizer(),
                 verify_widths=(3, gamma("dspark") + 1), **{**SHAPES, **spec_kwargs("dspark")})
    reqs = tes._requests() + [Request(tes.prompts()[0], max_new_tokens=tes.N,
                                      constraint=di.Regex("(ab"), request_id="bad"),
                              Request(tes.prompts()[1], max_new_tokens=tes.N,
                                      constraint=di.Regex("[0-9]+"), request_id="gone")]
    events = eng.stream(reqs)         # the call registers its requests
    eng.cancel("gone")                # cancelled while waiting for the constrained phase
    done = {e.index: e.output for e in events if e.output is not None}
    outs = [done[i] for i in range(len(reqs))]
    assert outs[5].finish_reason == "cancelled" and outs[5].tokens == []
    for out, ref, st in zip(outs, ref_tokens, ref_status):
        assert out.tokens == ref, (out.request_id, out.tokens, ref)
        assert out.constraint_status == st
    assert [o.constraint_status for o in outs[:4]] == ["complete", "complete", None, "complete"]
    assert outs[4].finish_reason == "error" and outs[4].error.startswith("constraint:")
    assert eng.last_run.spec_row_steps > 0 and outs[2].metrics.verified


@pytest.mark.parametrize("method", ["dspark", pytest.param("mtp", marks=pytest.mark.heavy)])
def test_multi_step_speculative_decode_equals_generate(method):
    """Every request admitted at once: the engine runs several verify steps per device call
    (the default decode_steps = 8, the program the other engines here share) and reproduces generate(..., speculative=...)'s tokens, greedy and
    sampled, in both scheduling modes."""
    prompts = prompts_long()[:4]
    want, _ = spec_reference(method, prompts, TEMPS[:4], SEEDS[:4])
    for async_scheduling in (True, False):
        eng = engine(method, max_tokens_per_step=512, async_scheduling=async_scheduling)
        outs = eng.generate(requests(prompts, TEMPS[:4], SEEDS[:4]))
        assert [o.tokens for o in outs] == want
        m = eng.last_run
        assert m.mean_decode_steps > 1.5, m
        assert m.spec_row_steps == sum(len(o.metrics.verified) for o in outs)


@pytest.mark.heavy
def test_fixed_decode_loop_speculative_equals_generate():
    """decode_loop="fixed" in a DSpark engine (verify loops of 1, 2, 4 or 8 steps, rows past
    their step count masked), two slots for six requests so calls of every length run: each
    request's tokens equal generate(..., speculative="dspark")'s."""
    prompts = prompts_long()
    want, _ = spec_reference("dspark", prompts, TEMPS, SEEDS)
    eng = engine("dspark", max_tokens_per_step=512, decode_loop="fixed", max_batch=2,
                 decode_buckets=(2,), prefill_shapes=((1, 32),))
    lengths, decode = [], eng._spec_decode
    eng._spec_decode = lambda packed, steps: (lengths.append(steps), decode(packed, steps))[1]
    outs = eng.generate(requests(prompts, TEMPS, SEEDS))
    assert [o.tokens for o in outs] == want
    assert eng.last_run.mean_decode_steps > 1, eng.last_run
    assert len({min(t for t in (1, 2, 4, 8) if t >= k) for k in lengths}) >= 2, lengths


def test_multi_step_speculative_loop_carries_no_pool():
    """The multi-step verify call gathers the rows' state once: its device loop carries the
    contiguous per-row state, never the paged state's pools (which a per-step gather and
    scatter would read and write every iteration)."""
    import re
    eng = engine("mtp")
    job = eng._substep_jobs(eng.decode_buckets[0], None)[-1]
    assert job.kwargs["steps"] == eng.scheduler.decode_steps > 1
    hlo = job.fn.lower(*job.args, **job.kwargs).compile().as_text()
    loops = re.findall(r"= (\(.*?\)) while\(", hlo)
    assert loops, "no device loop in the multi-step program"
    pools = {f"[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(eng.state.pools)}
    carried = [p for p in pools for loop in loops if p in loop]
    assert not carried, carried


def test_speculative_engine_admits_in_batches_by_default():
    """A speculative engine gathers half its slots (at most 8) before admitting while rows
    decode; an explicit admit_batch wins."""
    from deepinfer_fn.engine.scheduler import default_admit_batch
    eng = engine("mtp", progress=False)
    assert eng.scheduler.admit_batch == default_admit_batch(SHAPES["max_batch"]) > 1
    assert engine("mtp", progress=False, admit_batch=1).scheduler.admit_batch == 1
