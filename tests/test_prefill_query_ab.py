"""benchmarks/prefill_query_ab.py on the tiny preset (the XLA reference in both arms on a
CPU: equal logits), and the switch it flips is back as it was afterwards."""


def test_prefill_query_ab_smoke(tmp_path):
    from benchmarks import prefill_query_ab
    from custom_calls import chunk_attention
    out = tmp_path / "ab.json"
    r = prefill_query_ab.main(["--preset", "tiny", "--shapes", "1x32", "--rounds", "2",
                               "--out", str(out)])
    assert out.exists() and chunk_attention.PREPARE_QUERY_IN_KERNEL
    [row] = r["rows"]
    assert set(row["ms"]) == {"in_kernel", "folded"} and len(row["ms"]["folded"]) == 2
    assert row["logits_rel_diff"] == 0.0 and row["top1_agreement"] == 1.0
