"""Sharding-experiment model: bytes add up, collectives scale, presets give sane numbers
(shardings/experiment.py)."""

import json
import math

import jax
import pytest

import deepinfer_fn as di
from deepinfer_fn.params import count_params, is_spec, param_specs
from deepinfer_fn.state import state_bytes
from shardings.experiment import (Layout, checkpoint_bytes, layout_report, main, param_report,
                                  parse_layout, skew_imbalance)

V4 = di.ModelConfig.preset("v4-flash")
MINI = di.ModelConfig.preset("mini")
TINY = di.ModelConfig.preset("tiny")
ROUTED_V4 = 43 * 256 * 25_165_824                    # spec §1.4: 277,025,390,592
TP_AXES = {"mlp", "q_heads", "o_groups", "index_heads"}
H200 = dict(flops=8e14, hbm=4.2e12, link=4.5e11)


def test_checkpoint_bytes_match_the_official_release():
    assert ROUTED_V4 == 277_025_390_592
    assert checkpoint_bytes(V4) == 159_609_485_896    # spec §1.4 / §5.1, scales included


def _by_hand(cfg, dp, ep, tp, R):
    """Per-device and summed-over-devices element counts, leaf by leaf, from first principles."""
    E = cfg.n_routed_experts
    per_dev = 0
    all_devices = 0
    devices = dp * ep * tp
    for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec):
        size = math.prod(s.shape)
        tp_split = tp > 1 and any(a in TP_AXES and d % tp == 0 for a, d in zip(s.axes, s.shape))
        if s.layout == "experts":
            slots = (E + R) // ep                     # physical experts per ep shard
            n = size // E * slots // (tp if tp_split else 1)
            copies = dp * (E + R) / E * (1 if tp_split else tp)
        else:
            n = size // (tp if tp_split else 1)
            copies = devices / (tp if tp_split else 1)
        per_dev += n
        all_devices += size * copies
    return per_dev, all_devices


@pytest.mark.parametrize("dp,ep,tp,R", [(1, 1, 1, 0), (2, 4, 1, 0), (1, 2, 2, 4), (2, 2, 2, 0),
                                        (1, 4, 1, 8), (4, 1, 2, 0)])
def test_tiny_param_counts_add_up_exactly(dp, ep, tp, R):
    rep = param_report(TINY, Layout(dp, ep, tp), "bf16", R)
    per_dev = sum(rep["per_device_params"].values())
    want_dev, want_all = _by_hand(TINY, dp, ep, tp, R)
    assert per_dev == want_dev
    assert per_dev * dp * ep * tp == want_all        # device copies = total x replication
    total = sum(rep["total_params"].values())
    assert sum(rep["total_params"][c] * rep["copies"][c] for c in rep["copies"]) == \
        pytest.approx(per_dev * dp * ep * tp, rel=1e-12)
    cp = count_params(TINY)
    assert rep["model_params"] == cp["total"] + cp["mtp_total"]
    assert total - rep["total_params"]["hash_tables"] == rep["model_params"]
    if R == 0:                                       # the real sharding rules, same answer
        from shardings.mesh import param_shardings
        shardings = param_shardings(TINY, Layout(dp, ep, tp).mesh())
        specs = param_specs(TINY)
        got = sum(math.prod(sh.shard_shape(sp.shape)) for sh, sp in
                  zip(jax.tree.leaves(shardings), jax.tree.leaves(specs, is_leaf=is_spec)))
        assert got == per_dev


def test_v4_flash_ep64_routed_expert_bytes():
    cp = count_params(V4)
    for dtype, bpe in (("bf16", 2.0), ("fp8", 1 + 1 / 16384), ("fp4", 0.5 + 1 / 32)):
        rep = param_report(V4, Layout(1, 64, 1), dtype, 0)
        assert rep["model_params"] == cp["total"] + cp["mtp_total"] == 290_942_289_362
        assert rep["total_params"]["routed_experts"] == ROUTED_V4
        assert rep["per_device_params"]["routed_experts"] == ROUTED_V4 // 64
        assert rep["per_device_bytes"]["routed_experts"] == pytest.approx(ROUTED_V4 / 64 * bpe)
    # 64 redundant replicas: 320 physical experts, 5 per device instead of 4
    rep = param_report(V4, Layout(1, 64, 1), "bf16", 64)
    assert rep["experts_per_device"] == 5 and rep["copies"]["routed_experts"] == 1.25
    assert rep["per_device_bytes"]["routed_experts"] == pytest.approx(ROUTED_V4 / 64 * 2 * 1.25)
    # dense weights are replicated: the same on every layout without tp
    dense = [param_report(V4, Layout(dp, ep, 1), "bf16", 0)["per_device_params"]["attention"]
             for dp, ep in ((1, 64), (8, 8), (1, 1))]
    assert dense == [5_086_317_888] * 3


def test_state_bytes_split_over_dp_ep():
    r = layout_report(V4, 2, 8, 1, batch=256, context=8192, **H200)
    assert r["workload"]["seqs_per_device"] == 16
    assert r["memory"]["state_bytes"] == state_bytes(V4, 16, 8192)
    r2 = layout_report(V4, 2, 8, 2, batch=256, context=8192, **H200)   # tp replicates state
    assert r2["memory"]["state_bytes"] == r["memory"]["state_bytes"]


def _a2a(r, name="moe_dispatch"):
    return next(c for c in r["collectives"] if c["name"] == name)


def test_all_to_all_bytes_scale_with_ep_and_batch():
    D, k, L = V4.hidden_size, V4.num_experts_per_tok, V4.num_hidden_layers
    for ep in (2, 4, 8, 64):
        for batch in (256, 1024, 4096):
            r = layout_report(V4, 1, ep, 1, batch=batch, context=4096, **H200)
            tok = batch / ep
            disp, comb = _a2a(r), _a2a(r, "moe_combine")
            assert disp["calls"] == comb["calls"] == L
            assert disp["bytes_per_call"] == pytest.approx(tok * k * D * 2 * (1 - 1 / ep))
            assert comb["bytes_per_call"] == pytest.approx(disp["bytes_per_call"])
            assert disp["local_fraction"] == 1 / ep
    # doubling the batch doubles the traffic; fp8 dispatch halves it (plus scales)
    a = layout_report(V4, 1, 8, 1, batch=512, context=4096, **H200)
    b = layout_report(V4, 1, 8, 1, batch=1024, context=4096, **H200)
    assert _a2a(b)["bytes_per_step"] == pytest.approx(2 * _a2a(a)["bytes_per_step"])
    f = layout_report(V4, 1, 8, 1, batch=1024, context=4096, dtype="fp8", **H200)
    assert _a2a(f)["bytes_per_call"] == pytest.approx(_a2a(b)["bytes_per_call"] * (1 + 4 / 128) / 2)
    # ep = 1: no all-to-all at all; dedup sends fewer bytes, almost none saved at EP64
    assert not [c for c in layout_report(V4, 4, 1, 1, batch=64, **H200)["collectives"]
                if c["kind"].startswith("all_to_all")]
    for ep, lo, hi in ((4, 0.4, 0.8), (64, 0.95, 1.0)):
        plain = layout_report(V4, 1, ep, 1, batch=4096, **H200)
        dd = layout_report(V4, 1, ep, 1, batch=4096, dedup=True, **H200)
        ratio = _a2a(dd)["bytes_per_call"] / _a2a(plain)["bytes_per_call"]
        assert lo < ratio < hi, (ep, ratio)


def test_tp_collectives_and_split():
    r1 = layout_report(V4, 1, 4, 1, batch=64, context=4096, **H200)
    r4 = layout_report(V4, 1, 4, 4, batch=64, context=4096, **H200)
    tp_names = {"attn_o_allgather", "indexer_scores_allreduce", "moe_out_allreduce"}
    assert tp_names <= {c["name"] for c in r4["collectives"]}
    assert not {c["name"] for c in r1["collectives"]} & tp_names
    assert r4["params"]["per_device_params"]["routed_experts"] * 4 == \
        r1["params"]["per_device_params"]["routed_experts"]
    attention = [r["params"]["per_device_params"]["attention"] for r in (r1, r4)]
    assert attention[1] < attention[0]


def test_decode_flops_match_active_params():
    """Weight FLOPs per decoded token = 2 x active params (excluding the embedding gather and
    vector weights), from the same specs the model uses."""
    r = layout_report(V4, 1, 1, 1, batch=1, context=1, include_mtp=False, **H200)
    c = r["components"]
    weight_flops = sum(c[n]["flops"] for n in ("attn_proj", "moe_routed", "moe_dense",
                                               "mhc_norms", "embed_head"))
    active_no_embed = count_params(V4)["active"] - V4.vocab_size * V4.hidden_size
    assert weight_flops / 2 == pytest.approx(active_no_embed, rel=2e-3)


@pytest.mark.parametrize("cfg", [MINI, V4], ids=["mini", "v4-flash"])
def test_presets_give_sane_numbers(cfg):
    ep = 8 if cfg is MINI else 64
    dec = layout_report(cfg, 1, ep, 1, batch=64 * ep, context=32768, mode="decode",
                        redundant=ep, dtype="fp4", **H200)
    pre = layout_report(cfg, 1, min(ep, 4), 1, batch=16, context=32768, mode="prefill",
                        prefill_tokens=8192, dtype="fp4", **H200)
    for r in (dec, pre):
        t = r["time"]
        assert 0 < t["compute_s"] and 0 < t["hbm_s"] and 0 < t["comm_s"]
        assert max(t["local_s"], t["comm_s"]) == t["step_overlap_s"] <= t["step_serial_s"]
        assert t["local_s"] >= max(t["compute_s"], t["hbm_s"]) - 1e-15
        assert 0 < r["memory"]["total_bytes"] < 141e9            # fits an H200
        assert r["throughput"]["tokens_per_s_total_overlap"] == pytest.approx(
            r["throughput"]["tokens_per_s_device_overlap"] * r["layout"]["devices"])
    assert dec["components"]["attn_proj"]["bound"] == "memory"   # 64 tokens/device: HBM-bound
    assert pre["components"]["moe_routed"]["bound"] == "compute"  # 8192 tokens: compute-bound
    if cfg is V4:
        # production EP64 decode, fp4 weights: ~9 GB dense + ~2.9 GB experts + 15 GB state
        assert 8e9 < dec["memory"]["params_bytes"] < 14e9
        assert dec["memory"]["state_bytes"] == state_bytes(V4, 64, 32768)
        assert 1e3 < dec["throughput"]["tokens_per_s_device_overlap"] < 1e5
        # EP4 in bf16 does not fit; EP4 in fp4 does
        big = layout_report(V4, 1, 4, 1, batch=16, context=32768, capacity=141e9, **H200)
        assert big["memory"]["params_bytes"] > 141e9 and big["memory"]["fits"] is False
        assert any("capacity" in n for n in big["notes"])


def test_skew_imbalance_redundancy_helps():
    no_r = skew_imbalance(V4, 64, 0, "zipf:1.0", 4096)
    with_r = skew_imbalance(V4, 64, 64, "zipf:1.0", 4096)
    assert with_r < 1.2 < 2.0 < no_r
    r = layout_report(V4, 1, 64, 1, batch=4096, redundant=64, skew="zipf:1.0", **H200)
    assert r["workload"]["imbalance"] == pytest.approx(with_r)


def test_parse_layout_and_shared_mesh():
    assert parse_layout("dp=64,ep=64") == (Layout(64, 64, 1), {})
    assert parse_layout("dp=64,ep=64", "shared") == (Layout(1, 64, 1), {})
    assert parse_layout("dp=16,ep=4,tp=4,redundant=4", "shared") == (Layout(4, 4, 4),
                                                                      {"redundant": 4})
    with pytest.raises(ValueError):
        parse_layout("dp=6,ep=4", "shared")


def test_cli_compare_json_and_text(capsys):
    assert main(["--preset", "tiny", "--batch", "16", "--context", "256", "--compare",
                 "dp=1,ep=2;dp=2,ep=2,redundant=4;dp=1,ep=2,tp=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["dp=1,ep=2", "dp=2,ep=2,redundant=4", "dp=1,ep=2,tp=2"]
    assert out["dp=2,ep=2,redundant=4"]["layout"]["devices"] == 4
    assert out["dp=2,ep=2,redundant=4"]["params"]["physical_experts"] == 12
    assert main(["--preset", "mini", "--dp", "1", "--ep", "8", "--batch", "512",
                 "--context", "8192", "--redundant", "8"]) == 0
    text = capsys.readouterr().out
    assert "moe_dispatch" in text and "routed_experts" in text and "tokens/s" in text
