"""The pure helpers of benchmarks/multi_gpu.py against brute force, and its balancer section
end to end on the embedded model's router (CPU)."""

import itertools
import json

import numpy as np
import pytest

from benchmarks import multi_gpu as mg


def test_equal_meshes_cover_all_devices_with_both_axes_from_four():
    for n in range(1, 17):
        meshes = mg.equal_meshes(n)
        assert all(dp * ep == n for dp, ep in meshes)
        assert meshes[0] == (1, n)
        both = [m for m in meshes if m[0] > 1 and m[1] > 1]
        assert bool(both) == (n >= 4 and n % 2 == 0)
    with pytest.raises(ValueError, match="n_devices"):
        mg.equal_meshes(0)


def test_scaling_counts_are_the_divisors_of_the_experts_up_to_n():
    for n, e in itertools.product(range(1, 10), (8, 64, 256, 6)):
        want = sorted({g for g in range(1, n + 1) for m in range(1, e + 1) if g * m == e})
        assert mg.scaling_counts(n, e) == want
    assert mg.scaling_counts(8, 64) == [1, 2, 4, 8]
    assert mg.scaling_counts(8, 6) == [1, 2, 3, 6]


def test_scaling_order_puts_the_ends_first_and_keeps_every_count():
    assert mg.scaling_order([1, 2, 4, 8]) == [1, 8, 2, 4]
    assert mg.scaling_order([4, 1, 2]) == [1, 4, 2]
    assert mg.scaling_order([1]) == [1]
    for counts in ([1, 2, 3, 6], [2, 4], list(range(1, 9))):
        got = mg.scaling_order(counts)
        assert sorted(got) == sorted(counts) and got[:2] == [min(counts), max(counts)]


def test_expert_work_matches_a_python_loop():
    rng = np.random.default_rng(0)
    E, ep, D, I, n, k = 16, 4, 8, 4, 12, 3
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(n * ep)])
    got = mg.expert_work(idx, E, ep, D, I, itemsize=2)
    rows = [0] * ep
    touched = [set() for _ in range(ep)]
    for t in range(n * ep):
        for j in range(k):
            dev = int(idx[t, j]) // (E // ep)
            rows[dev] += 1
            touched[dev].add(int(idx[t, j]))
    assert got["rows"].tolist() == rows
    assert got["experts_touched"].tolist() == [len(s) for s in touched]
    assert got["weight_bytes"].tolist() == [len(s) * (D * I * 2 + I * D) * 2 for s in touched]
    assert got["flops"].tolist() == [r * (2 * D * I * 2 + 2 * I * D) for r in rows]


def test_roofline_arithmetic():
    r = mg.roofline(weight_bytes=4e9, hbm_Bps=4e12, comm_bytes=1e8, link_Bps=1e11,
                    flops=1e12, peak_flops=1e15)
    assert r["hbm_s"] == pytest.approx(1e-3) and r["comm_s"] == pytest.approx(1e-3)
    assert r["compute_s"] == pytest.approx(1e-3) and r["roofline_s"] == pytest.approx(2e-3)
    r = mg.roofline(1.0, 1.0, 0.0, 1.0, 10.0, 2.0)              # compute-bound
    assert r["roofline_s"] == 5.0
    with pytest.raises(ValueError, match="link_Bps"):
        mg.roofline(1.0, 1.0, 1.0, 0.0, 1.0, 1.0)


def test_alltoall_remote_bytes_and_divergence_and_budgets():
    assert mg.alltoall_remote_bytes(800, 8) == 700
    assert mg.alltoall_remote_bytes(800, 1) == 0
    a = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    b = np.array([[1, 2, 3], [4, 0, 6], [0, 8, 0]])
    assert mg.first_divergence(a, b) == [-1, 1, 0]
    budgets = mg.section_budgets(100.0, ["equal", "balancer"])
    assert sum(budgets.values()) == pytest.approx(100.0)
    assert budgets["equal"] / budgets["balancer"] == pytest.approx(
        mg.BUDGET_SHARE["equal"] / mg.BUDGET_SHARE["balancer"])


def test_balance_rows_counts_the_dispatch_rows_by_hand():
    from shardings.balancer import plan_replicas, expert_load, route_to_replicas
    rng = np.random.default_rng(1)
    E, D, R, k, T = 8, 4, 4, 2, 64
    p = np.array([30, 1, 1, 1, 10, 1, 1, 5], float)
    idx = np.stack([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(2 * T)])
    got = mg.balance_rows(idx[:T], idx[T:], E, D, R)
    static = np.zeros(D, int)
    for e in idx[T:].reshape(-1):
        static[e // (E // D)] += 1
    assert got["static_rows"] == static.tolist()
    pl = plan_replicas(expert_load(idx[:T], E), D, R)
    phys = np.asarray(route_to_replicas(idx[T:], np.arange(T), pl.logical_to_phys,
                                        pl.replica_count))
    bal = np.zeros(D, int)
    for s in phys.reshape(-1):
        bal[s // pl.slots_per_device] += 1
    assert got["balanced_rows"] == bal.tolist() and sum(bal) == T * k
    assert got["balanced_max_over_mean"] < got["static_max_over_mean"]


def test_budget_stops_when_the_next_point_would_not_fit():
    saved = []
    b = mg.Budget(1000.0, save=lambda: saved.append(1))
    assert not b.over()
    b.last_start -= 600.0                   # a point that took 600 s ...
    b.done_point()
    assert saved == [1] and b.last_cost >= 600.0
    b.t0 -= 600.0                           # ... leaves < 600 s of 1000: no room for another
    assert b.over()
    assert mg.Budget(0.0).over()


def test_unknown_section_is_rejected(capsys):
    with pytest.raises(SystemExit):
        mg.parse_args(["--sections", "equal,bogus"])
    assert "bogus" in capsys.readouterr().err


def test_quick_balancer_section_runs(tmp_path):
    out = tmp_path / "r.json"
    assert mg.main(["--quick", "--sections", "balancer", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["balancer"]["traces"] and "error" not in res["balancer"]
