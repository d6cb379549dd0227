"""Ragged expert-parallel dispatch (`shardings.moe`) on 8 fake CPU devices.

XLA:CPU has no ragged-all-to-all, so: the CPU emulation is checked against a numpy oracle of
`lax.ragged_all_to_all`'s documented semantics; the ragged path's index arithmetic runs through
that emulation and equals single-device `routed_experts` and the fixed path for uniform and
skewed routings; the real `lax.ragged_all_to_all` program is lowered for CUDA and its operand
shapes read from the StableHLO; bytes per step are checked against brute-force counts and the
fixed program's own all-to-all shapes. Shapes are shared on purpose (one compile per mesh and
path).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardings
from deepinfer_fn.model.experts import routed_experts
from shardings import moe

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

E, D, I, K_TOP, N = 16, 16, 8, 2, 32          # 32 tokens: 4 per device on 8 devices
LIMIT = 7.0


# ------------------------------------------------------------------ numpy oracle of the op
def oracle_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets,
                             recv_sizes):
    """lax.ragged_all_to_all as its docstring states it, one list entry per device."""
    n_dev, n_slices = len(operands), len(input_offsets[0])
    per_dev = n_slices // n_dev
    results = [np.array(o, copy=True) for o in outputs]
    for src in range(n_dev):
        for i in range(n_slices):
            dst = i // per_dev
            lo, size = input_offsets[src][i], send_sizes[src][i]
            assert recv_sizes[dst][src * per_dev + i % per_dev] == size      # the contract
            start = output_offsets[src][i]
            results[dst][start:start + size] = operands[src][lo:lo + size]
    return results


def test_oracle_matches_the_documented_example():
    """The two-device example of `lax.ragged_all_to_all`'s docstring."""
    got = oracle_ragged_all_to_all(
        [np.array([1, 2, 2]), np.array([3, 4, 0])], [np.zeros(4, int), np.zeros(4, int)],
        [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])
    np.testing.assert_array_equal(got[0], [1, 3, 0, 0])
    np.testing.assert_array_equal(got[1], [2, 2, 4, 0])


def _random_ragged_args(rng, n_dev, per_dev, m_in=64, m_out=80, width=3):
    """Contract-consistent arguments: slices at shuffled, gapped offsets on both sides."""
    n_slices = n_dev * per_dev
    sizes = rng.integers(0, 4, (n_dev, n_slices))               # [src, slice]
    input_offsets = np.zeros((n_dev, n_slices), np.int32)
    output_offsets = np.zeros((n_dev, n_slices), np.int32)
    recv_sizes = np.zeros((n_dev, n_slices), np.int32)
    for src in range(n_dev):
        pos = 0
        for i in rng.permutation(n_slices):
            pos += rng.integers(0, 2)
            input_offsets[src, i] = pos
            pos += sizes[src, i]
        assert pos <= m_in
    for dst in range(n_dev):
        pos = 0
        for j in rng.permutation(n_slices):                     # j = src * per_dev + t
            src, t = divmod(j, per_dev)
            pos += rng.integers(0, 2)
            output_offsets[src, dst * per_dev + t] = pos
            recv_sizes[dst, j] = sizes[src, dst * per_dev + t]
            pos += sizes[src, dst * per_dev + t]
        assert pos <= m_out
    operand = rng.standard_normal((n_dev, m_in, width)).astype(np.float32)
    output = rng.standard_normal((n_dev, m_out, width)).astype(np.float32)
    return operand, output, input_offsets, sizes.astype(np.int32), output_offsets, recv_sizes


@pytest.mark.parametrize("per_dev", [1, 2])
def test_emulation_matches_numpy_oracle(per_dev):
    mesh = shardings.make_mesh(ep=8)
    spec = P("ep")
    emulate = jax.jit(jax.shard_map(
        lambda *a: moe.ragged_all_to_all_emulated(*[x[0] for x in a], axis_name="ep")[None],
        mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False))
    rng = np.random.default_rng(per_dev)
    for _ in range(3):
        args = _random_ragged_args(rng, 8, per_dev)
        got = np.asarray(emulate(*args))
        want = oracle_ragged_all_to_all(*[list(a) for a in args])
        for dev in range(8):
            np.testing.assert_array_equal(got[dev], want[dev])


# --------------------------------------------------------- MoE outputs through the emulation
@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    p = {name: jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.3)
         for name, shape in [("w1", (E, D, I)), ("w3", (E, D, I)), ("w2", (E, I, D))]}
    x = jnp.asarray(rng.standard_normal((N, D)).astype(np.float32))
    weights = jnp.asarray(rng.random((N, K_TOP)).astype(np.float32))
    return p, x, weights


def routings():
    rng = np.random.default_rng(1)
    uniform = np.stack([rng.choice(E, K_TOP, replace=False) for _ in range(N)])
    one_expert = np.full((N, K_TOP), 5)                              # every slot to expert 5
    one_device = np.stack([rng.choice([6, 7], K_TOP, replace=False) for _ in range(N)])
    hot = np.where(rng.random((N, K_TOP)) < 0.5, 0, uniform)
    hot[:, 1] = np.where(hot[:, 0] == hot[:, 1], (hot[:, 1] + 1) % E, hot[:, 1])
    return {"uniform": uniform, "one_expert": one_expert, "one_device": one_device,
            "half_to_expert_0": hot}


@pytest.mark.parametrize("kw", [dict(ep=8), dict(dp=2, ep=4)], ids=["ep=8", "dp=2,ep=4"])
def test_ragged_dispatch_equals_single_device_and_fixed(kw, experts):
    p, x, weights = experts
    mesh = shardings.make_mesh(**kw)
    n_k = N // mesh.size * K_TOP                       # assignments per device

    def program(dispatch, recv_capacity=None):
        return jax.jit(lambda p, x, i, w: moe.ep_routed_experts(
            p, x, i, w, LIMIT, mesh, dispatch=dispatch, recv_capacity=recv_capacity))

    single = jax.jit(lambda p, x, i, w: routed_experts(p, x, i, w, LIMIT))
    fixed, ragged = program("fixed"), program("ragged_emulated")
    bounded = program("ragged_emulated", recv_capacity=n_k)   # skewed routings overflow it
    for name, idx in routings().items():
        idx = jnp.asarray(idx, jnp.int32)
        want = np.asarray(single(p, x, idx, weights))
        got_fixed = np.asarray(fixed(p, x, idx, weights))
        got_ragged = np.asarray(ragged(p, x, idx, weights))
        np.testing.assert_allclose(got_ragged, want, rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(got_ragged, got_fixed, rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(bounded(p, x, idx, weights)), want,
                                   rtol=1e-5, atol=1e-5, err_msg=f"{name}, bounded buffer")


def test_model_forward_through_ragged_dispatch(golden, monkeypatch):
    """The model's MoE layers pick the dispatch up from `use_dispatch` (no new arguments)."""
    import deepinfer_fn as di
    from conftest import golden_params, rel_err
    calls = []
    real = moe.ragged_all_to_all_emulated
    monkeypatch.setattr(moe, "ragged_all_to_all_emulated",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ref = golden("cfg_a")
    params = shardings.shard_params(golden_params("cfg_a"), shardings.make_mesh(dp=2, ep=4))
    with moe.use_dispatch("ragged_emulated"):
        logits = np.asarray(di.forward(params, ref["input_ids"]))
    assert calls, "the ragged dispatch did not run"
    assert rel_err(logits, ref["logits"]) <= 1e-5


def test_received_rows_know_their_expert():
    """The receive layout: sender-major, then by local expert, -1 past the last row."""
    counts = jnp.asarray([[2, 0], [0, 1], [1, 1]], jnp.int32)
    got = np.asarray(moe.received_local_experts(counts, 7))
    np.testing.assert_array_equal(got, [0, 0, 1, 0, 1, -1, -1])


# ------------------------------------------------------------------- the real op, for GPU
def _abstract_args():
    sd = jax.ShapeDtypeStruct
    p = {"w1": sd((E, D, I), jnp.float32), "w3": sd((E, D, I), jnp.float32),
         "w2": sd((E, I, D), jnp.float32)}
    return p, sd((N, D), jnp.float32), sd((N, K_TOP), jnp.int32), sd((N, K_TOP), jnp.float32)


def _lowered_text(mesh, dispatch, platform, **kw):
    f = lambda p, x, i, w: moe.ep_routed_experts(p, x, i, w, LIMIT, mesh, dispatch=dispatch,
                                                 platform=platform, **kw)
    return jax.jit(f).trace(*_abstract_args()).lower(lowering_platforms=(platform,)).as_text()


def _ragged_calls(text):
    """(operand types, result type) of every ragged_all_to_all custom call."""
    pat = re.compile(r"custom_call @ragged_all_to_all\(.*?replica_groups = dense<(.*?)>.*?"
                     r": \((.*?)\) -> (tensor<[^>]*>)")
    return [(groups, types.split(", "), result) for groups, types, result in pat.findall(text)]


def _all_to_all_types(text):
    return re.findall(r'"stablehlo.all_to_all".*?: \((tensor<[^>]*>)\)', text)


def test_ragged_program_lowers_for_gpu():
    mesh = shardings.make_mesh(dp=2, ep=4)
    ep, n_k = 4, N // 8 * K_TOP
    text = _lowered_text(mesh, "ragged", "cuda")
    calls = _ragged_calls(text)
    assert len(calls) == 2, text                          # dispatch, then combine
    offsets = [f"tensor<{ep}xi32>"] * 4
    (groups, dispatch_types, dispatch_out), (_, combine_types, combine_out) = calls
    assert groups == "[[0, 1, 2, 3], [4, 5, 6, 7]]"      # one exchange per dp slice
    assert dispatch_types == [f"tensor<{n_k}x{D}xf32>", f"tensor<{ep * n_k}x{D}xf32>"] + offsets
    assert dispatch_out == f"tensor<{ep * n_k}x{D}xf32>"
    assert combine_types == [f"tensor<{ep * n_k}x{D}xf32>", f"tensor<{n_k}x{D}xf32>"] + offsets
    assert combine_out == f"tensor<{n_k}x{D}xf32>"
    # only the int32 counts / offsets go through a dense all-to-all
    assert sorted(_all_to_all_types(text)) == [f"tensor<{ep}x{E // ep + 1}xi32>",
                                               f"tensor<{ep}xi32>"]
    # a bounded receive buffer: the ragged buffer shrinks, the fixed fallback is in the program
    text = _lowered_text(mesh, "ragged", "cuda", recv_capacity=n_k)
    calls = _ragged_calls(text)
    assert [c[2] for c in calls] == [f"tensor<{n_k}x{D}xf32>", f"tensor<{n_k}x{D}xf32>"]
    assert f"tensor<{ep}x{n_k}x{D}xf32>" in _all_to_all_types(text)


# ---------------------------------------------------------------------- choosing a dispatch
def test_dispatch_choice_and_errors(experts, monkeypatch):
    assert moe.resolve_dispatch("auto", "cpu") == "fixed"
    assert moe.resolve_dispatch("auto", "gpu") == "ragged"
    assert moe.resolve_dispatch("auto", "cuda") == "ragged"
    assert moe.resolve_dispatch("auto", "tpu") == "ragged"
    assert moe.resolve_dispatch("ragged_emulated", "cpu") == "ragged_emulated"
    with pytest.raises(ValueError, match="'cpu' platform"):
        moe.resolve_dispatch("ragged", "cpu")
    with pytest.raises(ValueError, match="not one of"):
        moe.resolve_dispatch("sparse", "gpu")
    monkeypatch.delenv("DEEPINFER_MOE_DISPATCH", raising=False)
    assert moe.resolve_dispatch(None, "cuda") == "ragged"
    monkeypatch.setenv("DEEPINFER_MOE_DISPATCH", "fixed")
    assert moe.resolve_dispatch(None, "cuda") == "fixed"
    with moe.use_dispatch("ragged_emulated"):
        assert moe.resolve_dispatch(None, "cpu") == "ragged_emulated"
    assert moe.resolve_dispatch(None, "cuda") == "fixed"
    p, x, weights = experts
    idx = jnp.zeros((N, K_TOP), jnp.int32)
    with pytest.raises(ValueError, match="'cpu' platform"):
        moe.ep_routed_experts(p, x, idx, weights, LIMIT, shardings.make_mesh(ep=8),
                              dispatch="ragged")
    with pytest.raises(ValueError, match="recv_capacity"):
        moe.ep_routed_experts(p, x, idx, weights, LIMIT, shardings.make_mesh(ep=8),
                              dispatch="fixed", recv_capacity=0)


# ------------------------------------------------------------------------- bytes per step
def _brute_force_rows(idx, dp, ep):
    """Rows device d sends / receives / sends remotely, one assignment at a time."""
    n = idx.shape[0] // (dp * ep)
    sent, received, remote = [0] * (dp * ep), [0] * (dp * ep), [0] * (dp * ep)
    for token in range(idx.shape[0]):
        dev = token // n
        for e in idx[token]:
            owner = (dev // ep) * ep + int(e) // (E // ep)    # same dp slice, expert's ep index
            sent[dev] += 1
            received[owner] += 1
            remote[dev] += owner != dev
    return np.array(sent), np.array(received), np.array(remote)


def _tensor_bytes(t):
    *dims, dtype = re.match(r"tensor<(.*)>", t).group(1).split("x")
    return int(np.prod([int(d) for d in dims])) * {"f32": 4, "i32": 4}[dtype]


@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
def test_bytes_per_step_fixed_vs_ragged(routing):
    dp, ep = 2, 4
    idx = routings()[routing]
    rows = moe.dispatch_rows(idx, E, dp, ep)
    sent, received, remote = _brute_force_rows(idx, dp, ep)
    np.testing.assert_array_equal(rows["ragged"], sent)
    np.testing.assert_array_equal(rows["ragged_received"], received)
    np.testing.assert_array_equal(rows["ragged_remote"], remote)
    n_k = N // 8 * K_TOP
    np.testing.assert_array_equal(rows["fixed"], ep * n_k)
    # the fixed program's own collectives: the bytes its all-to-alls carry per device
    text = _lowered_text(shardings.make_mesh(dp=dp, ep=ep), "fixed", "cpu")
    fixed_bytes = sum(_tensor_bytes(t) for t in _all_to_all_types(text))
    by = moe.dispatch_bytes(idx, E, dp, ep, hidden=D, itemsize=4)
    np.testing.assert_array_equal(by["fixed"], fixed_bytes)
    text = _lowered_text(shardings.make_mesh(dp=dp, ep=ep), "ragged", "cuda")
    meta = sum(_tensor_bytes(t) for t in _all_to_all_types(text))
    np.testing.assert_array_equal(by["ragged"], sent * 2 * D * 4 + meta)
    assert (by["ragged"] < by["fixed"]).all()
    if routing == "one_expert":       # every row of a dp slice lands on one device
        assert sorted(received) == [0, 0, 0, 0, 0, 0, ep * n_k, ep * n_k]
    else:
        assert received.max() < ep * n_k
