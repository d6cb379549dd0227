"""Seeded engine fuzz: random request mixes (good greedy requests sharing prefixes, bad
requests, bad constraints, cancelled requests) on a page pool small enough to force
preemption.

Oracle: `di.generate` on each good prompt with the request's temperature and seed (tests/test_engine.py's `reference`, one padded
[6, 256] batch, so the programs are shared with that file), and the engine's documented
contract: exactly one final output per submitted request, bad ones "error" with a message
naming the problem, cancelled ones "cancelled" with a prefix of their generate tokens, nothing
leaked from the page pool, and a cancelled id reused by a later call runs normally.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn import text
from deepinfer_fn.engine import Request
from test_engine import N_NEW, engine, params, reference

VOCAB = 4096            # the embedded default model


@functools.cache
def tokenizer():
    return text.load_tokenizer(di.default_model_path())


def bad_request(rng, rid):
    """(request or None, the word its error must contain). None: the Request constructor
    itself rejected it (an ArgumentError at the call is also within the contract)."""
    kind = int(rng.integers(9))
    prompt = rng.integers(2, VOCAB, int(rng.integers(3, 20))).tolist()
    make = [
        lambda: (dict(tokens=prompt[:-1] + [VOCAB + int(rng.integers(100))]), "vocabulary"),
        lambda: (dict(tokens=prompt, constraint=di.Regex("(ab")), "constraint"),
        lambda: (dict(tokens=[]), "empty"),
        lambda: (dict(tokens=prompt, temperature=-1.0), "temperature"),
        lambda: (dict(tokens=prompt, stop_tokens=[VOCAB + 7]), "stop_tokens"),
        lambda: (dict(tokens=prompt, max_new_tokens=400), "context"),
        lambda: (dict(tokens=[1.5, 2.5]), "token"),
        lambda: (dict(tokens=prompt, max_new_tokens=True), "max_new_tokens"),
        lambda: (dict(tokens=prompt, top_k=True), "top_k"),
    ][kind]
    kw, word = make()
    try:
        return Request(**{"max_new_tokens": N_NEW, **kw}, request_id=rid), word
    except (ValueError, TypeError) as e:
        assert word in str(e), str(e)
        return None, word


def request_mix(seed: int):
    """((good prompts, temperatures, seeds), requests in submission order, ({bad id: word},
    bad ones rejected by Request() itself), cancel-at-submit ids, cancel-mid-run ids): up to 6
    good/cancelled prompts (generate's reference batch holds 6),
    most of them sharing a random system prefix, 80-185 tokens each so 4 running requests
    need more pages than the pool has."""
    rng = np.random.default_rng(seed)
    system = rng.integers(2, VOCAB, int(rng.integers(40, 70))).tolist()
    n_good = int(rng.integers(4, 7))
    prompts = []
    for i in range(n_good):
        n = int(rng.integers(80, 150))
        head = system if rng.random() < 0.6 else []
        prompts.append(tuple((head + rng.integers(2, VOCAB, n).tolist())[:n + len(head) // 2]))
    roles = ["good"] * n_good
    victims = rng.choice(np.arange(1, n_good), size=2, replace=False)
    roles[victims[0]], roles[victims[1]] = "cancel_submit", "cancel_run"
    sampled = rng.random(n_good) < 0.3
    temps = np.where(sampled, 1.0, 0.0).tolist()
    seeds = rng.integers(0, 2**32, n_good).tolist()
    reqs = [Request(list(p), max_new_tokens=N_NEW, temperature=t, seed=s, request_id=f"g{i}")
            for i, (p, t, s) in enumerate(zip(prompts, temps, seeds))]
    bad, rejected = {}, 0
    for j in range(int(rng.integers(2, 5))):
        req, word = bad_request(rng, f"b{j}")
        rejected += req is None
        if req is not None:
            bad[req.request_id] = word
            reqs.insert(int(rng.integers(len(reqs) + 1)), req)
    ids = lambda role: {f"g{i}" for i, r in enumerate(roles) if r == role}
    return (prompts, temps, seeds), reqs, (bad, rejected), ids("cancel_submit"), ids("cancel_run")


def run_mix(seed: int, **engine_kw):
    (prompts, temps, seeds), reqs, (bad, rejected), cancel_now, cancel_later = request_mix(seed)
    want = reference(prompts, temps, seeds)
    eng = engine(tokenizer=tokenizer(), **engine_kw)
    finals, pieces = {}, {}
    with pytest.raises(ValueError, match="request_id"):
        eng.cancel("never-submitted")       # a cancel applies only to requests that exist
    it = eng.stream(reqs)
    for rid in cancel_now:
        eng.cancel(rid)
    for ev in it:
        pieces.setdefault(ev.request_id, []).extend(ev.tokens)
        if ev.tokens and ev.request_id not in cancel_later:
            for rid in cancel_later:
                eng.cancel(rid)
        if ev.output is not None:
            assert ev.request_id not in finals, f"two final outputs for {ev.request_id}"
            finals[ev.request_id] = ev.output
    assert set(finals) == {r.request_id for r in reqs}, "a request got no final output"
    for rid, word in bad.items():
        o = finals[rid]
        assert o.finish_reason == "error" and word in o.error and o.tokens == [], (rid, o)
    for i, p in enumerate(prompts):
        rid, o = f"g{i}", finals[f"g{i}"]
        assert pieces.get(rid, []) == o.tokens, rid
        if rid in cancel_now:
            assert o.finish_reason == "cancelled" and o.tokens == [], (rid, o)
        elif rid in cancel_later:
            assert o.finish_reason == "cancelled", (rid, o.finish_reason)
            assert o.tokens == want[i][:len(o.tokens)], rid
        else:
            assert o.finish_reason == "length" and o.tokens == want[i], f"{rid} != generate"
    m = eng.last_run                    # of the mix, before the re-run below
    again = [r for r in reqs if r.request_id in cancel_now]    # same ids, a new call
    out = eng.generate(again)[0]
    i = int(again[0].request_id[1:])
    assert out.finish_reason == "length" and out.tokens == want[i], "a cancel outlived its request"
    assert eng.pages.free_count + (eng.cache.num_nodes if eng.cache else 0) == eng.pages.capacity
    assert not eng.scheduler.has_work()
    print(f"\nENGINE FUZZ seed={seed} {engine_kw}: {len(reqs)} requests ({len(bad)} bad; "
          f"{rejected} more rejected by Request()), "
          f"preemptions {m.preemptions}, cache hits {m.cache_hit_tokens}")
    return m


@pytest.mark.parametrize("seed,async_scheduling", [(0, True), (2, False)])
def test_engine_fuzz_request_mix(seed, async_scheduling):
    """Exact prefix-cache mode (replay from 0), so greedy tokens equal generate's exactly."""
    m = run_mix(seed, max_tokens_per_step=70, async_scheduling=async_scheduling,
                replay_tokens=None)
    if not async_scheduling:            # sync scheduling is deterministic: this mix preempts
        assert m.preemptions > 0


@pytest.mark.heavy
@pytest.mark.parametrize("seed", range(2, 8))
def test_engine_fuzz_request_mix_heavy(seed):
    rng = np.random.default_rng(seed)
    run_mix(seed, max_tokens_per_step=int(rng.choice([40, 70])),
            async_scheduling=bool(rng.integers(2)), prefix_cache=bool(rng.integers(2)),
            replay_tokens=None)
