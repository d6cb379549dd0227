"""benchmarks/hlo_count.py: kernel counts of programs with a known structure (XLA:CPU), and of
a hand-written XLA:GPU-style HLO text (cuBLAS / Mosaic custom calls, Triton gemm fusion,
async copy, a while loop with a known trip count)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import hlo_count


def _compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def test_scan_of_two_sorts_counts_trip_times():
    def f(x):
        def body(c, _):
            c = jnp.sort(c, axis=0)                # two sorts on different axes: not fusable
            c = jnp.sort(c * 1.5 + 1.0, axis=1)
            return c, None
        return jax.lax.scan(body, x, None, length=5)[0]

    r = hlo_count.count_compiled(_compiled(f, jnp.ones((8, 16))), layers=5, layers_per_iteration=1)
    assert r["by_category"]["sort"] == 10
    assert len(r["loops"]) == 1
    loop = r["loops"][0]
    assert loop["trip_count"] == 5 and loop["body_categories"]["sort"] == 2
    assert not r["per_iteration_only"]
    # body (+ condition) per iteration times 5 plus what runs outside the loop is the total
    assert r["outside_loop"] + 5 * loop["body_per_iter"] <= r["kernels"]
    assert r["per_layer_in_loop"] == loop["body_per_iter"]
    assert r["cost"]["flops"] >= 0 and r["cost"]["bytes accessed"] > 0


def test_three_dependent_dots():
    def f(x, w):
        h = jnp.tanh(x @ w)
        h = jnp.tanh(h @ w)
        return h @ w

    a = jnp.ones((32, 32), jnp.float32)
    r = hlo_count.count_compiled(_compiled(f, a, a))
    assert r["by_category"]["gemm"] == 3
    assert r["loops"] == []
    assert r["cost"]["flops"] >= 3 * 2 * 32 ** 3


def test_unknown_trip_count_is_per_iteration():
    def f(x):
        def cond(c):
            return c[1].sum() < 100.0
        def body(c):
            return c[0] + 1, jnp.sort(c[1] + 1.0, axis=0)
        return jax.lax.while_loop(cond, body, (0, x))[1]

    r = hlo_count.count_compiled(_compiled(f, jnp.ones((4, 4))))
    assert r["per_iteration_only"]
    assert r["loops"][0]["trip_count"] is None
    assert r["by_category"]["sort"] == 1


def test_conditional_counts_its_largest_branch():
    def f(p, x):
        return jax.lax.cond(p, lambda v: jnp.sort(jnp.sort(v, axis=0) + 1.0, axis=1),
                            lambda v: jnp.sort(v, axis=0), x)

    r = hlo_count.count_compiled(_compiled(f, True, jnp.ones((4, 4))))
    assert r["by_category"]["sort"] == 2


def test_per_layer_of_a_scanned_stack():
    def f(x, ws):   # 4 layers scanned as 2 groups of 2
        def group(c, w):
            for j in range(2):
                c = jnp.sort(jnp.tanh(c @ w[j]), axis=0)
            return c, None
        return jax.lax.scan(group, x, ws)[0]

    r = hlo_count.count_compiled(_compiled(f, jnp.ones((8, 8)), jnp.ones((2, 2, 8, 8))),
                                 layers=4, layers_per_iteration=2)
    loop = r["loops"][0]
    assert loop["trip_count"] == 2
    assert loop["body_categories"]["gemm"] == 2 and loop["body_categories"]["sort"] == 2
    assert r["per_layer_in_loop"] == loop["body_per_iter"] / 2
    assert r["by_category"]["gemm"] == 4


def test_source_breakdown_names_the_calling_file():
    r = hlo_count.count_compiled(_compiled(lambda x: jnp.sort(x, axis=0), jnp.ones((4, 4))))
    assert sum(r["by_source"].values()) == r["kernels"]
    assert any(k.endswith("test_hlo_count.py") for k in r["by_source"])


GPU_TEXT = r"""HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%fused_add (param_0: s32[]) -> s32[] {
  %param_0 = s32[] parameter(0)
  %constant_1 = s32[] constant(1)
  ROOT %add.1 = s32[] add(%param_0, %constant_1)
}

%fused_cmp (param_0.1: s32[]) -> pred[] {
  %param_0.1 = s32[] parameter(0)
  %constant_3 = s32[] constant(3)
  ROOT %lt.1 = pred[] compare(%param_0.1, %constant_3), direction=LT
}

%triton_gemm_comp (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_reduce (param_0.2: f32[8,8]) -> f32[8] {
  %param_0.2 = f32[8,8]{1,0} parameter(0)
  %c0 = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%param_0.2, %c0), dimensions={1}, to_apply=%add_f32
}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%p), index=0
  %gte.1 = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %custom-call.1 = (f32[8,8]{1,0}, s8[4]{0}) custom-call(%gte.1, %gte.1), custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1}}
  %gte.2 = f32[8,8]{1,0} get-tuple-element(%custom-call.1), index=0
  %mosaic.1 = f32[8,8]{1,0} custom-call(%gte.2), custom_call_target="mosaic_gpu_v2", backend_config="opaque"
  %loop_add_fusion = s32[] fusion(%gte.0), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%loop_add_fusion, %mosaic.1)
}

%cond (p.1: (s32[], f32[8,8])) -> pred[] {
  %p.1 = (s32[], f32[8,8]{1,0}) parameter(0)
  %gte.3 = s32[] get-tuple-element(%p.1), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%gte.3), kind=kLoop, calls=%fused_cmp
}

ENTRY %main.9 (x.1: f32[8,8]) -> f32[8,8] {
  %x.1 = f32[8,8]{1,0} parameter(0)
  %copy-start.1 = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[]) copy-start(%x.1)
  %copy-done.1 = f32[8,8]{1,0} copy-done(%copy-start.1)
  %gemm_fusion = f32[8,8]{1,0} fusion(%copy-done.1, %x.1), kind=kCustom, calls=%triton_gemm_comp, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16"}}}
  %input_reduce_fusion = f32[8]{0} fusion(%gemm_fusion), kind=kInput, calls=%fused_reduce
  %c = s32[] constant(0)
  %tuple.1 = (s32[], f32[8,8]{1,0}) tuple(%c, %gemm_fusion)
  %while.1 = (s32[], f32[8,8]{1,0}) while(%tuple.1), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %gte.4 = f32[8,8]{1,0} get-tuple-element(%while.1), index=1
}
"""


def test_gpu_text():
    r = hlo_count.count_text(GPU_TEXT, layers=3, layers_per_iteration=1)
    # entry: async copy, Triton gemm, reduce fusion; body x3: cuBLAS, Mosaic, counter; cond x4
    assert r["by_category"] == {"fusion:loop": 7, "gemm": 4, "mosaic": 3, "copy": 1,
                                "fusion:input": 1}
    assert r["kernels"] == 16
    assert r["loops"][0]["trip_count"] == 3 and r["loops"][0]["body_per_iter"] == 4
    assert r["per_layer_in_loop"] == 4 and r["outside_loop"] == 4
    assert r["kernels_per_layer"] == pytest.approx(16 / 3)
    # bytes written: entry 256 (the async copy's result, not its operand) + 256 (gemm) + 32
    # (reduce); body x3: 256 + 4 (cuBLAS result + workspace) + 256 (Mosaic) + 4 (counter);
    # cond x4: 1 (pred)
    assert r["bytes_written"] == 256 + 256 + 32 + 3 * (260 + 256 + 4) + 4 * 1
    assert sum(r["bytes_written_by_source"].values()) == r["bytes_written"]


def test_output_bytes_of_async_starts():
    ins = lambda text, op: hlo_count.Instr("x", op, text)
    fusion_start = ins("((f32[3,2048]{1,0}, s32[]), bf16[1,2048]{1,0}, u32[]) fusion-start(%a, "
                       "%b), kind=kLoop, calls=%f", "fusion-start")
    assert hlo_count.output_bytes(fusion_start) == 2 * 2048
    copy_start = ins("(f32[8,8]{1,0}, f32[8,8]{1,0}, u32[]) copy-start(%x)", "copy-start")
    assert hlo_count.output_bytes(copy_start) == 256
    fusion = ins("(s32[1,4096]{1,0}, bf16[2,3]{1,0}) fusion(%p), kind=kLoop", "fusion")
    assert hlo_count.output_bytes(fusion) == 4 * 4096 + 2 * 6


IN_PLACE_TEXT = """HloModule m, entry_computation_layout={(bf16[8,512]{1,0})->bf16[8,512]{1,0}}

%fused_dus (param_0: bf16[8,512]) -> bf16[8,512] {
  %param_0 = bf16[8,512]{1,0} parameter(0)
  %slice.1 = bf16[8,64]{1,0} slice(%param_0), slice={[0:8], [448:512]}
  %negate.1 = bf16[8,64]{1,0} negate(%slice.1)
  %c0 = s32[] constant(0)
  %c448 = s32[] constant(448)
  ROOT %dynamic-update-slice.1 = bf16[8,512]{1,0} dynamic-update-slice(%param_0, %negate.1, %c0, %c448)
}

%fused_neg (param_0.1: bf16[8,512]) -> bf16[8,512] {
  %param_0.1 = bf16[8,512]{1,0} parameter(0)
  ROOT %negate.2 = bf16[8,512]{1,0} negate(%param_0.1)
}

ENTRY %main (p: bf16[8,512]) -> bf16[8,512] {
  %p = bf16[8,512]{1,0} parameter(0)
  %loop_negate_fusion = bf16[8,512]{1,0} fusion(%p), kind=kLoop, calls=%fused_neg
  ROOT %loop_dynamic_update_slice_fusion = bf16[8,512]{1,0} fusion(%loop_negate_fusion), kind=kLoop, calls=%fused_dus
}
"""


def test_in_place_updates_count_their_update():
    """A fusion whose root is a dynamic-update-slice writes its update (8 x 64 bf16) into its
    operand's buffer; a plain fusion writes its whole result (8 x 512 bf16)."""
    r = hlo_count.count_text(IN_PLACE_TEXT)
    assert r["kernels"] == 2
    assert r["bytes_written"] == 2 * 8 * 512 + 2 * 8 * 64


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_count.count_text("HloModule m\n")


# ------------------------------------------------------------------ benchmarks/lean.py models
def test_lean_matmul_flops_match_the_weight_shapes():
    """2 FLOPs per weight element of every layer matmul (routed experts: k of E per token)."""
    import math
    import deepinfer_fn as di
    from benchmarks import lean
    from deepinfer_fn.params import is_spec, param_specs

    for name in ("tiny", "mini"):
        cfg = di.ModelConfig.preset(name)
        specs = param_specs(cfg, include_mtp=False)
        want = 0
        for s in jax.tree.leaves(specs["layers"], is_leaf=is_spec):
            n = math.prod(s.shape)
            if s.layout in ("linear", "grouped"):
                want += 2 * n
            elif s.layout == "experts":
                want += 2 * n * cfg.num_experts_per_tok // cfg.n_routed_experts
        assert sum(lean.token_matmul_flops(cfg).values()) == want, name


def test_lean_attention_flops_and_expert_model():
    import numpy as np
    import deepinfer_fn as di
    from benchmarks import lean

    cfg = di.ModelConfig.preset("tiny")       # [SWA, CSA, HCA, CSA], W 8, CSA 4, HCA 16, topk 3
    H, d = cfg.num_attention_heads, cfg.head_dim
    t = 63                                    # 8 window keys; CSA 16 rows -> top 3; HCA 4 rows
    got = lean.attention_flops(cfg, np.array([t]))
    assert got["core"] == 4 * H * d * (8 + (8 + 3) + (8 + 4) + (8 + 3))
    assert got["indexer"] == 2 * 2 * cfg.index_n_heads * cfg.index_head_dim * 16
    assert lean.expected_experts(64, 6, 1) == pytest.approx(6)
    assert lean.expected_experts(64, 6, 1000) == pytest.approx(64)


def test_lean_decode_bytes_counts_every_dense_weight():
    import jax.numpy as jnp
    import numpy as np
    import deepinfer_fn as di
    from benchmarks import lean

    cfg = di.ModelConfig.preset("tiny")
    w = lean.abstract_weights(cfg, jnp.bfloat16)
    size = lambda x: int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    total = sum(size(x) for x in jax.tree.leaves(w.weights["layers"])) + \
        sum(size(x) for k in ("hc_head", "norm", "head") for x in jax.tree.leaves(w.weights[k]))
    tables = sum(size(x) for path, x in jax.tree_util.tree_flatten_with_path(w.weights)[0]
                 if "tid2eid" in jax.tree_util.keystr(path))
    b = lean.decode_bytes(cfg, w, batch=10**4, context=256)     # every expert touched
    assert b["weights_dense"] + b["weights_experts_touched"] == pytest.approx(total - tables, rel=1e-6)
    assert b["state"] > 0 and b["total"] > b["weights_dense"]
