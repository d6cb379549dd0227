"""Expert-parallel load balancer: planner invariants, balance on skewed traces, a brute-force
optimum on a tiny case, replica routing, weight expansion (shardings/balancer.py)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardings.balancer import (Placement, balance_table, expand_expert_weights, expert_load,
                                format_table, plan_replicas, route_to_replicas,
                                stack_placements, static_placement, synthetic_routing)


def _check(p: Placement, N, D, R):
    p.validate()
    assert p.n_logical == N and p.n_physical == N + R and p.n_devices == D
    assert p.slots_per_device * D == N + R
    assert (p.replica_count >= 1).all() and p.replica_count.sum() == N + R
    assert np.array_equal(np.bincount(p.phys_to_logical, minlength=N), p.replica_count)
    for e in range(N):
        slots = p.logical_to_phys[e][p.logical_to_phys[e] >= 0]
        assert len(slots) == p.replica_count[e] and (p.phys_to_logical[slots] == e).all()
    if p.slots_per_device <= N:                      # anti-affinity is achievable: kept
        assert p.duplicates() == 0


@pytest.mark.parametrize("N,D,R", [(8, 2, 0), (8, 4, 4), (6, 3, 3), (64, 8, 8), (256, 64, 64),
                                   (256, 32, 32), (16, 16, 16), (4, 2, 6)])
def test_planner_invariants(N, D, R):
    rng = np.random.default_rng(N * 1000 + D * 10 + R)
    for load in (rng.zipf(1.3, N).astype(float), np.zeros(N), np.ones(N),
                 np.eye(N)[0] * 1000.0):
        _check(plan_replicas(load, D, R), N, D, R)


def test_planner_rejects_bad_input():
    with pytest.raises(ValueError, match="divisible"):
        plan_replicas(np.ones(256), 64, 32)          # 288 slots over 64 devices
    with pytest.raises(ValueError, match="non-negative"):
        plan_replicas(-np.ones(8), 2, 0)


def test_per_layer_placements_and_stacking():
    L, N, D, R = 3, 16, 4, 4
    loads = np.stack([expert_load(synthetic_routing("zipf", 512, N, 2, seed=l), N)
                      for l in range(L)])
    placements = plan_replicas(loads, D, R)
    assert len(placements) == L
    for p in placements:
        _check(p, N, D, R)
    stacked = stack_placements(placements)
    width = max(p.max_replicas for p in placements)
    assert stacked["phys_to_logical"].shape == (L, N + R)
    assert stacked["logical_to_phys"].shape == (L, N, width)
    assert stacked["replica_count"].shape == (L, N)
    # each layer is planned for its own hot experts
    for l, p in enumerate(placements):
        assert p.replica_count[np.argmax(loads[l])] == p.replica_count.max()


@pytest.mark.parametrize("kind,kw", [("zipf", {"exponent": 1.0}), ("zipf", {"exponent": 0.6}),
                                     ("hot", {"n_hot": 4, "boost": 20.0}),
                                     ("hot", {"n_hot": 16, "boost": 8.0})])
@pytest.mark.parametrize("N,D,R", [(256, 64, 64), (64, 8, 8)])
def test_planner_beats_static_on_skewed_traces(kind, kw, N, D, R):
    load = expert_load(synthetic_routing(kind, 4096, N, 6, seed=1, **kw), N)
    before = min(static_placement(N, D, order).max_over_mean(load)
                 for order in ("contiguous", "round_robin"))
    after = plan_replicas(load, D, R).max_over_mean(load)
    assert after <= before
    assert after < 1.15 and after < 0.8 * before, (before, after)
    # no redundancy: still never worse than the static layout it replaces
    after0 = plan_replicas(load, D, 0).max_over_mean(load)
    assert after0 <= static_placement(N, D).max_over_mean(load) + 1e-12


def test_planner_never_worse_than_static_without_redundancy():
    rng = np.random.default_rng(0)
    for trial in range(20):
        N, D = [(8, 4), (16, 4), (64, 8), (32, 32)][trial % 4]
        load = rng.lognormal(0, 1 + trial % 3, N)
        assert (plan_replicas(load, D, 0).device_loads(load).max()
                <= static_placement(N, D).device_loads(load).max() + 1e-9)


def _brute_force(load, D, R, affine=True):
    """Min over all replica counts and all packings of the max device load."""
    N = len(load)
    P = N + R
    S = P // D
    best = np.inf
    for extra in itertools.combinations_with_replacement(range(N), R):
        c = np.ones(N, int)
        np.add.at(c, list(extra), 1)
        if affine and c.max() > D:
            continue
        items = np.repeat(np.arange(N), c)
        w = load[items] / c[items]

        def rec(remaining, acc):
            nonlocal best
            if acc >= best:
                return
            if not remaining:
                best = acc
                return
            first, rest = remaining[0], remaining[1:]
            for comb in itertools.combinations(rest, S - 1):
                group = [first, *comb]
                if affine and len(set(items[group])) < S:
                    continue
                rec([x for x in rest if x not in comb], max(acc, w[group].sum()))
        rec(list(range(P)), 0.0)
    return best


def test_planner_near_brute_force_optimum():
    """6 experts, 3 devices, 3 redundant (9 slots, 3 per device): the heuristic is within
    1.15x of the exact optimum (over all replica counts and anti-affine packings), 1.05x on
    average. (Measured over 40 such loads: worst 1.11, mean 1.014.)"""
    rng = np.random.default_rng(0)
    ratios = []
    for i in range(12):
        load = rng.zipf(1.5, 6).astype(float) if i % 2 else rng.lognormal(0, 1, 6)
        got = plan_replicas(load, 3, 3).device_loads(load).max()
        opt = _brute_force(load, 3, 3)
        assert got >= opt - 1e-9
        ratios.append(got / opt)
    print(f"\nheuristic / optimum (6 experts, 3 devices, 3 redundant, 12 loads): "
          f"worst {max(ratios):.3f}, mean {np.mean(ratios):.3f}")
    assert max(ratios) <= 1.15 and np.mean(ratios) <= 1.05


def test_route_to_replicas_splits_hot_expert_evenly():
    N, D, R, k, T = 16, 4, 8, 4, 1003
    load = np.ones(N)
    load[5] = 100.0
    p = plan_replicas(load, D, R)
    c = int(p.replica_count[5])
    assert c == D                                     # capped at one replica per device
    arrays = p.arrays()
    rng = np.random.default_rng(0)
    others = np.stack([rng.choice(np.delete(np.arange(N), 5), k - 1, replace=False)
                       for _ in range(T)])
    route = jax.jit(route_to_replicas, static_argnames="rule")
    for slot in range(k):                             # hot expert always in the same slot
        idx = np.insert(others, slot, 5, axis=1).astype(np.int32)
        phys = np.asarray(route(idx, np.arange(T, dtype=np.int32), arrays["logical_to_phys"],
                                arrays["replica_count"]))
        assert (p.phys_to_logical[phys] == idx).all()  # only replicas of the routed expert
        hits = np.bincount(phys[idx == 5], minlength=N + R)[p.logical_to_phys[5, :c]]
        assert hits.sum() == T and hits.max() - hits.min() <= 1, hits
    # hot expert in random slots: 'rank' is exactly even, 'token' even up to sampling noise
    idx = np.stack([rng.permutation(np.r_[5, others[t]]) for t in range(T)]).astype(np.int32)
    for rule, tol in (("rank", 1), ("token", 0.15 * T / c)):
        phys = np.asarray(route(idx, np.arange(T, dtype=np.int32), arrays["logical_to_phys"],
                                arrays["replica_count"], rule=rule))
        assert (p.phys_to_logical[phys] == idx).all()
        hits = np.bincount(phys[idx == 5], minlength=N + R)[p.logical_to_phys[5, :c]]
        assert hits.max() - hits.min() <= tol, (rule, hits)


def test_route_token_rule_is_batch_independent():
    N, D, R, k, T = 32, 8, 8, 6, 64
    load = expert_load(synthetic_routing("zipf", 1024, N, k, seed=3), N)
    a = plan_replicas(load, D, R).arrays()
    idx = synthetic_routing("zipf", T, N, k, seed=3, sample=5)
    tok = np.arange(100, 100 + T, dtype=np.int32)
    full = np.asarray(route_to_replicas(idx, tok, a["logical_to_phys"], a["replica_count"]))
    perm = np.random.default_rng(0).permutation(T)[:17]
    part = np.asarray(route_to_replicas(idx[perm], tok[perm], a["logical_to_phys"],
                                        a["replica_count"]))
    assert np.array_equal(full[perm], part)


def test_expand_expert_weights_and_moe_equivalence():
    from deepinfer_fn.model.moe import routed_experts
    N, D, R, k, T, d, f = 8, 4, 4, 2, 24, 16, 8
    rng = np.random.default_rng(0)
    w = {"w1": rng.standard_normal((N, d, f)).astype(np.float32),
         "w3": rng.standard_normal((N, d, f)).astype(np.float32),
         "w2": rng.standard_normal((N, f, d)).astype(np.float32)}
    load = np.arange(1, N + 1, dtype=float) ** 2
    p = plan_replicas(load, D, R)
    wp = expand_expert_weights({k_: jnp.asarray(v) for k_, v in w.items()}, p.phys_to_logical)
    for name in w:
        assert wp[name].shape == (N + R, *w[name].shape[1:])
        np.testing.assert_array_equal(np.asarray(wp[name]), w[name][p.phys_to_logical])
    np.testing.assert_array_equal(expand_expert_weights(w["w1"], p.phys_to_logical),
                                  w["w1"][p.phys_to_logical])
    x = jnp.asarray(rng.standard_normal((T, d)), jnp.float32)
    idx = jnp.asarray(synthetic_routing("zipf", T, N, k, seed=1))
    gate_w = jnp.asarray(rng.random((T, k)), jnp.float32)
    phys = route_to_replicas(idx, jnp.arange(T), p.logical_to_phys, p.replica_count)
    want = routed_experts({k_: jnp.asarray(v) for k_, v in w.items()}, x, idx, gate_w, 10.0)
    got = routed_experts(wp, x, phys, gate_w, 10.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_balance_table():
    rows = balance_table(n_tokens=4096, setups=((256, 64, 64, 6), (64, 8, 8, 6)))
    print("\nmax/mean device load (4096 tokens/trace, k=6; static = contiguous, no redundancy;"
          " held-out = planned on one trace, scored on a fresh one)")
    print(format_table(rows))
    for r in rows:
        if r["trace"] != "uniform":
            assert r["planned_held_out"] < r["static"]
        assert r["planned_in"] < 1.1
