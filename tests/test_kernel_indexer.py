"""Indexer top-k and the fused compressor decode step against their XLA references.

top_k_rows: every implementation returns the same set of valid indices as the reference
(lax.top_k, ties to the lower index) and as a brute-force argsort, on scores with many ties;
top_k_mask: the same sets as boolean masks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_fn import kernels, kernels_xla

TOPK_IMPLS = [i for i in kernels.implementations("top_k_rows") if i.startswith("xla")]
MASK_IMPLS = [i for i in kernels.implementations("top_k_mask") if i.startswith("xla")]


def _brute_top_k(scores, visible, k):
    """Sets of selected visible rows per leading index: stable argsort of the masked scores
    in the floats' total order with -0.0 taken as +0.0 (ties to the lower index)."""
    s = np.where(visible, scores.astype(np.float32), -np.inf)
    s = np.where(s == 0, np.float32(0), s)
    n = s.shape[-1]
    k = min(k, n)
    bits = s.view(np.int32).astype(np.int64)
    key = np.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)   # total order
    flat_key, flat_vis = key.reshape(-1, n), visible.reshape(-1, n)
    out = []
    for r in range(flat_key.shape[0]):
        order = np.argsort(-flat_key[r], kind="stable")[:k]
        out.append({int(i) for i in order if flat_vis[r, i]})
    return out


def _sets(idx):
    idx = np.asarray(idx)
    flat = idx.reshape(-1, idx.shape[-1])
    return [{int(i) for i in row if i >= 0} for row in flat]


def _case(seed, shape, levels, dtype, p_visible=0.8):
    """Scores drawn from `levels` distinct values (many exact ties, +-0.0 among them: one
    value to the top-k ops)."""
    rng = np.random.default_rng(seed)
    vals = np.concatenate([[0.0, -0.0], rng.standard_normal(max(levels - 2, 0))])[:levels]
    scores = vals[rng.integers(0, levels, shape)]
    visible = rng.random(shape) < p_visible
    return jnp.asarray(scores, dtype), jnp.asarray(visible)


@pytest.mark.parametrize("impl", TOPK_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,k,levels,p_vis", [
    ((2, 3, 40), 7, 5, 0.8),        # heavy ties
    ((3, 1, 64), 16, 64, 0.5),      # decode, distinct values
    ((2, 2, 24), 20, 3, 0.5),       # k > visible count: -1 entries
    ((2, 1, 16), 16, 4, 0.7),       # k = N
    ((1, 2, 10), 12, 6, 1.0),       # k > N: clipped to N
    ((2, 1, 33), 5, 2, 0.0),        # nothing visible
    ((1, 1, 300), 100, 300, 0.9),   # several radix passes with 8-bit digits
])
def test_top_k_rows_matches_reference_and_brute_force(impl, dtype, shape, k, levels, p_vis):
    scores, visible = _case(hash((shape, k, levels)) % 1000, shape, levels, dtype, p_vis)
    with kernels.use("top_k_rows", impl):
        got = kernels.top_k_rows(scores, visible, k)
    assert got.shape == shape[:-1] + (min(k, shape[-1]),) and got.dtype == jnp.int32
    with kernels.use("top_k_rows", "xla"):
        want = kernels.top_k_rows(scores, visible, k)
    brute = _brute_top_k(np.asarray(scores.astype(jnp.float32)), np.asarray(visible), k)
    assert _sets(got) == _sets(want) == brute
    g = np.asarray(got).reshape(-1, got.shape[-1])
    assert all(len(set(r[r >= 0])) == (r >= 0).sum() for r in g)   # no duplicates
    if impl == "xla_select":                                        # index order
        assert all(np.all(np.diff(r[r >= 0]) > 0) for r in g)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_top_k_select_any_digit_width(bits):
    scores, visible = _case(5, (4, 1, 50), 9, jnp.float32)
    got = kernels_xla.top_k_rows_select(scores, visible, 11, radix_bits=bits)
    assert _sets(got) == _brute_top_k(np.asarray(scores), np.asarray(visible), 11)


def test_top_k_select_extreme_values():
    vals = np.array([np.inf, -np.inf, 3.0e38, -3.0e38, 1e-45, -1e-45, 0.0, -0.0], np.float32)
    scores = jnp.asarray(np.tile(vals, 3)[None, None])
    visible = jnp.ones(scores.shape, bool)
    for k in range(1, 25):
        got = kernels_xla.top_k_rows_select(scores, visible, k)
        assert _sets(got) == _brute_top_k(np.asarray(scores), np.asarray(visible), k), k


def test_top_k_select_is_jittable_and_has_no_sort():
    scores, visible = _case(7, (2, 1, 128), 20, jnp.float32)
    f = jax.jit(lambda s, v: kernels_xla.top_k_rows_select(s, v, 32))
    assert _sets(f(scores, visible)) == _brute_top_k(np.asarray(scores), np.asarray(visible), 32)
    hlo = f.lower(scores, visible).as_text()
    assert "stablehlo.sort" not in hlo and "chlo.top_k" not in hlo


def test_top_k_defaults_to_reference():
    assert kernels.choose("top_k_rows", "cpu") == kernels.choose("top_k_rows", "gpu") == "xla"


def _mask_sets(mask):
    m = np.asarray(mask)
    return [set(np.flatnonzero(row).tolist()) for row in m.reshape(-1, m.shape[-1])]


@pytest.mark.parametrize("impl", MASK_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,k,levels,p_vis", [
    ((2, 3, 40), 7, 5, 0.8),        # heavy ties
    ((2, 2, 24), 20, 3, 0.5),       # k > visible count
    ((1, 2, 10), 12, 6, 1.0),       # k > N
    ((2, 1, 33), 5, 2, 0.0),        # nothing visible
    ((1, 3, 300), 100, 300, 0.9),   # several radix passes
    ((2, 4, 16), 0, 4, 0.7),        # k = 0
    ((1, 64, 1024), 512, 64, 0.9),  # a CSA prefill chunk's rows and k
])
def test_top_k_mask_matches_brute_force(impl, dtype, shape, k, levels, p_vis):
    scores, visible = _case(hash((shape, k, levels, 1)) % 1000, shape, levels, dtype, p_vis)
    with kernels.use("top_k_mask", impl):
        got = kernels.top_k_mask(scores, visible, k)
    assert got.shape == shape and got.dtype == jnp.bool_
    brute = _brute_top_k(np.asarray(scores.astype(jnp.float32)), np.asarray(visible), k)
    assert _mask_sets(got) == brute
    assert not np.any(np.asarray(got) & ~np.asarray(visible))


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_top_k_mask_select_any_digit_width_and_extremes(bits):
    vals = np.array([np.inf, -np.inf, 3.0e38, -3.0e38, 1e-45, -1e-45, 0.0, -0.0], np.float32)
    scores = jnp.asarray(np.tile(vals, 3)[None, None])
    visible = jnp.ones(scores.shape, bool)
    for k in (1, 5, 11, 24):
        got = kernels_xla.top_k_mask_select(scores, visible, k, radix_bits=bits)
        assert _mask_sets(got) == _brute_top_k(np.asarray(scores), np.asarray(visible), k), k


def test_top_k_mask_select_has_no_sort_or_scatter():
    scores, visible = _case(9, (2, 8, 128), 20, jnp.float32)
    f = jax.jit(lambda s, v: kernels_xla.top_k_mask_select(s, v, 32))
    assert _mask_sets(f(scores, visible)) == _brute_top_k(np.asarray(scores),
                                                          np.asarray(visible), 32)
    hlo = f.lower(scores, visible).as_text()
    assert not any(op in hlo for op in ("stablehlo.sort", "chlo.top_k", "stablehlo.scatter"))


def test_top_k_mask_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="top_k_mask: scores"):
        kernels.top_k_mask(jnp.zeros((2, 5)), jnp.ones((2, 4), bool), 2)
    for k in (-1, 2.0, True):
        with pytest.raises(ValueError, match="top_k_mask: k must be a non-negative int"):
            kernels.top_k_mask(jnp.zeros((2, 5)), jnp.ones((2, 5), bool), k)


# ------------------------------------------------------------------ compressor decode step
from deepinfer_fn.model.cached import compressor_chunk  # noqa: E402
from deepinfer_fn.model.compressor import compressor_decode_step  # noqa: E402

FREQS = 10000.0 ** (-2.0 * np.arange(8) / 16)   # 16 rotated channels


def _comp_params(rng, d_model, dim, c, m, dtype):
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dtype)
    return dict(wkv=w(d_model, c * dim), wgate=w(d_model, c * dim),
                ape=jnp.asarray(rng.standard_normal((m, c * dim)), jnp.float32),
                norm=jnp.asarray(1 + 0.1 * rng.standard_normal(dim), dtype))


def _comp_state(rng, b, slots, width, dim, cap, dtype):
    return dict(raw_kv=jnp.asarray(rng.standard_normal((b, slots, width)), dtype),
                raw_gate=jnp.asarray(rng.standard_normal((b, slots, width)), jnp.float32),
                rows=jnp.asarray(rng.standard_normal((b, cap, dim)), dtype))


def _decode_case(seed, dtype, m, dims, overlap, positions, slack=0, d_model=128):
    """A layer's compressors (dims: main first), states, x, positions [B]."""
    rng = np.random.default_rng(seed)
    c = 2 if overlap else 1
    slots = c * m + slack
    cap = max(positions) // m + 2
    params = tuple(_comp_params(rng, d_model, d, c, m, dtype) for d in dims)
    states = tuple(_comp_state(rng, len(positions), slots, c * d, d, cap, dtype) for d in dims)
    x = jnp.asarray(rng.standard_normal((len(positions), d_model)), dtype)
    return params, states, x, jnp.asarray(positions, jnp.int32)


def _write(st, e):
    """Applies a `compressor_decode_step` entry to an unstacked compressor state."""
    put = jax.vmap(lambda r, i, v: r.at[i].set(v.astype(r.dtype), mode="drop"))
    cap = st["rows"].shape[1]
    return dict(raw_kv=put(st["raw_kv"], e["slot"], e["raw_kv"]),
                raw_gate=put(st["raw_gate"], e["slot"], e["raw_gate"]),
                rows=put(st["rows"], jnp.where(e["complete"], e["row_index"], cap), e["row"]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,overlap,dims,positions,slack", [
    (4, True, (64, 32), [0, 3, 5, 7, 11, 14], 0),      # CSA: w = 0, closing and open windows
    (4, True, (64, 32), [2, 3, 8, 19], 3),             # CSA, ring with slack
    (8, False, (64,), [0, 7, 9, 15, 30, 31], 0),       # HCA
    (8, False, (64,), [6, 7, 16, 23], 2),
])
def test_compressor_decode_step_equals_compressor_chunk(dtype, m, overlap, dims, positions, slack):
    params, states, x, pos = _decode_case(len(positions) + m, dtype, m, dims, overlap, positions,
                                          slack)
    active = jnp.asarray(np.arange(len(positions)) != 1)       # one padding row
    n_new = active.astype(jnp.int32)
    steps = compressor_decode_step(params, x, pos, tuple((s["raw_kv"], s["raw_gate"]) for s in states),
                                   m, FREQS, 1e-6, active=active)
    for p, st, e in zip(params, states, steps):
        want = compressor_chunk(p, x[:, None], pos, n_new, m, overlap, FREQS, 1e-6, st)
        got = _write(st, e)
        for name in ("raw_kv", "raw_gate", "rows"):
            np.testing.assert_array_equal(np.asarray(got[name], np.float32),
                                          np.asarray(want[name], np.float32), err_msg=name)
    assert np.asarray(steps[0]["complete"]).tolist() == [
        bool(a) and (q + 1) % m == 0 for a, q in zip(np.asarray(active), positions)]


def test_compressor_decode_step_row_floor():
    params, states, x, pos = _decode_case(9, jnp.float32, 4, (64,), True, [3, 7, 11])
    steps = compressor_decode_step(params, x, pos, ((states[0]["raw_kv"], states[0]["raw_gate"]),),
                                   4, FREQS, 1e-6, row_floor=jnp.asarray([0, 8, 8]))
    assert np.asarray(steps[0]["complete"]).tolist() == [True, False, True]


# ------------------------------------------------------------------ compressor decode: Mosaic GPU
try:
    from custom_calls import _common
    from custom_calls.compressor import compressor_decode_mgpu, slot_roles
    _MGPU = _common.interpret_available()
except ImportError:  # pragma: no cover - depends on the installed JAX
    _MGPU = False
mgpu = pytest.mark.skipif(not _MGPU, reason="Pallas Mosaic GPU interpret mode unavailable")
_KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")   # plgpu.kernel binds mpmd_map in this JAX


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@mgpu
def test_compressor_decode_registered_not_chosen_on_cpu():
    assert "mosaic_gpu" in kernels.implementations("compressor_decode")
    assert kernels.implementation("compressor_decode", "mosaic_gpu").available() is False
    assert kernels.choose("compressor_decode", "gpu") == "xla"


@mgpu
def test_slot_roles_cover_the_windows():
    m, slots = 4, 11
    for p in range(0, 30):
        ra, rb, mult = (np.asarray(a)[:, 0] for a in slot_roles(jnp.asarray([p]), slots, m))
        held = [p - 1 - (p - 1 - s) % slots for s in range(slots)]
        w = p // m
        assert sorted(h for h, r in zip(held, rb) if r) == list(range(w * m, p))
        assert sorted(h for h, r in zip(held, ra) if r) == list(range(max(w - 1, 0) * m, w * m)
                                                                 if w else [])
        assert mult[0] == (w + 1) * m - p


@mgpu
@pytest.mark.parametrize("m,overlap,dims,positions,tn,slack,splits", [
    (4, True, (64, 32), [0, 3, 6, 11], 32, 1, 1),   # CSA: main + indexer, w = 0, closing
    (8, False, (64,), [7, 9, 30, 2], 64, 0, 4),      # HCA, the ring window split over 4 CTAs
])
def test_compressor_decode_kernel_interpret_bf16(m, overlap, dims, positions, tn, slack, splits):
    params, states, x, pos = _decode_case(m, jnp.bfloat16, m, dims, overlap, positions, slack)
    rings = tuple((s["raw_kv"], s["raw_gate"]) for s in states)
    f = lambda x, pos: compressor_decode_mgpu(x, pos, params, rings, m, FREQS, 1e-6,
                                              interpret=True, tn=tn, splits=splits)
    assert any(p in str(jax.make_jaxpr(f)(x, pos)) for p in _KERNEL_PRIMITIVES)
    got = f(x, pos)
    want = kernels_xla.compressor_decode(x, pos, params, rings, m, FREQS, 1e-6)
    for (kappa, gate, row), (kappa_w, gate_w, row_w) in zip(got, want):
        assert kappa.dtype == kappa_w.dtype and row.dtype == row_w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(kappa, np.float32), np.asarray(kappa_w, np.float32))
        np.testing.assert_allclose(np.asarray(gate), np.asarray(gate_w), rtol=1e-6, atol=1e-6)
        assert _rel(row, row_w) < 1e-2      # softmax weights: fp32 here, bf16 in the reference


@mgpu
def test_compressor_decode_kernel_lowers_for_cuda():
    S = jax.ShapeDtypeStruct
    b, d_model, m = 64, 256, 4
    ps = tuple(dict(wkv=S((d_model, 2 * d), jnp.bfloat16), wgate=S((d_model, 2 * d), jnp.bfloat16),
                    ape=S((m, 2 * d), jnp.float32), norm=S((d,), jnp.bfloat16)) for d in (512, 128))
    rs = tuple((S((b, 2 * m, 2 * d), jnp.bfloat16), S((b, 2 * m, 2 * d), jnp.float32))
               for d in (512, 128))
    f = lambda x, pos, ps, rs: compressor_decode_mgpu(x, pos, ps, rs, m, FREQS, 1e-6)
    exp = jax.export.export(jax.jit(f), platforms=["cuda"])(
        S((b, d_model), jnp.bfloat16), S((b,), jnp.int32), ps, rs)
    assert "mosaic_gpu" in exp.mlir_module()
