"""benchmarks/variants.py on the tiny preset (XLA everywhere on a CPU): variants that choose
another formula of the same selection give the same logits and tokens, and every switch a
variant flips is back as it was afterwards."""

import pytest


def test_prefill_variants_smoke(tmp_path):
    from benchmarks import variants
    from custom_calls import chunk_attention
    from deepinfer_fn import kernels
    out = tmp_path / "pv.json"
    r = variants.main(["prefill", "--preset", "tiny", "--shapes", "1x48", "--rounds", "2",
                       "--reps", "1", "--variants", "default,topk_select,query_folded",
                       "--out", str(out)])
    assert out.exists() and chunk_attention.PREPARE_QUERY_IN_KERNEL
    assert kernels.choose("top_k_mask") == "xla"
    rows = {row["variant"]: row for row in r["results"]}
    assert set(rows) == {"default", "topk_select", "query_folded"}
    for row in rows.values():
        assert len(row["ms"]) == 2 and row["kernels"] > 0
        assert row["logits_rel_diff"] == 0.0 and row["top1_agreement"] == 1.0


def test_decode_variants_smoke(tmp_path):
    from benchmarks import variants
    r = variants.main(["decode", "--preset", "tiny", "--batches", "2", "--context", "128",
                       "--steps", "2", "--rounds", "2", "--reps", "1",
                       "--variants", "default,rows_select", "--out", str(tmp_path / "dv.json")])
    rows = {row["variant"]: row for row in r["results"]}
    assert rows["rows_select"]["same_tokens_as_first"] and len(rows["default"]["step_ms"]) == 2


def test_unknown_variant_is_rejected(tmp_path):
    from benchmarks import variants
    with pytest.raises(SystemExit):
        variants.main(["decode", "--variants", "default,nope", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        with variants.variant("nope"):
            pass


def test_combined_variants_put_every_part_in_force():
    from benchmarks import variants
    from custom_calls import chunk_attention
    from deepinfer_fn import kernel_registry
    before = chunk_attention.PREPARE_QUERY_IN_KERNEL
    overrides, switches = variants.choices("query_folded+topk_select")
    assert overrides == {"top_k_mask": "xla_select"}
    assert switches == [("custom_calls.chunk_attention", "PREPARE_QUERY_IN_KERNEL", False)]
    with variants.variant("query_folded+topk_select"):
        assert chunk_attention.PREPARE_QUERY_IN_KERNEL is False
        assert kernel_registry.choose("top_k_mask") == "xla_select"
    assert chunk_attention.PREPARE_QUERY_IN_KERNEL == before
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        variants.choices("topk_select+nope")


def test_each_variant_traces_afresh_through_inner_jits():
    """An inner jitted function traced under one variant is not reused under the next."""
    import jax
    import jax.numpy as jnp
    from benchmarks import variants
    from deepinfer_fn import kernels

    inner = jax.jit(lambda s, v: kernels.top_k_rows(s, v, 4))
    scores = jax.ShapeDtypeStruct((2, 64), jnp.float32)
    visible = jax.ShapeDtypeStruct((2, 64), jnp.bool_)
    lowered = variants.lower_each(lambda: jax.jit(lambda s, v: inner(s, v)),
                                  ["default", "rows_select"], scores, visible)
    sort_ops = ("stablehlo.sort", "chlo.top_k")
    assert any(op in lowered["default"].as_text() for op in sort_ops)
    assert not any(op in lowered["rows_select"].as_text() for op in sort_ops)


def test_dense_rows_variant_switches_both_model_modules():
    from benchmarks import variants
    from deepinfer_fn.model import cached, cached_v41
    before = (cached.DENSE_ROWS_MAX, cached_v41.DENSE_ROWS_MAX)
    with variants.variant("dense_rows_8k"):
        assert cached.DENSE_ROWS_MAX == cached_v41.DENSE_ROWS_MAX == 8192
    assert (cached.DENSE_ROWS_MAX, cached_v41.DENSE_ROWS_MAX) == before
