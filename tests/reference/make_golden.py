#!/usr/bin/env python
"""Generate golden reference outputs for deepinfer_fn from HuggingFace transformers.

This script *calls* ``transformers`` (``DeepseekV4ForCausalLM``, eager attention, fp32, CPU);
it does not copy any of its code.  It is not part of the repo's default test path: it needs
torch + transformers (see tests/reference/README.md for the venv) and writes small files under
``tests/golden/`` that the JAX tests compare against.

Usage:
    /work/venv311/bin/python tests/reference/make_golden.py --out tests/golden

Per config ``<name>`` it writes ``<out>/<name>/``:
    config.json, generation_config.json, model.safetensors   (transformers ``save_pretrained``)
    reference.safetensors   input_ids (int32), logits (float32), captured intermediates
    reference.json          versions, shapes, sanity-check results

and ``<out>/cfg_a_mtp/`` with the cfg_a checkpoint plus ``mtp.0.*`` tensors (official names)
and MTP reference logits (spec §2.11), built from transformers' own decoder-layer module.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shutil
import tempfile
import time
import zlib

import numpy as np
import torch

import safetensors
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

SWA = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"

# --------------------------------------------------------------------------------------------
# Configurations (spec §6.1 + the brief)
# --------------------------------------------------------------------------------------------

BASE_FIELDS = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=[SWA, CSA, HCA, CSA],
    compress_rates={CSA: 4, HCA: 16},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=8,  # legacy keyword -> partial_rotary_factor = 8/32
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rope_theta=1.0e4,
    compress_rope_theta=1.6e5,
    rope_scaling={
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=1024,
    swiglu_limit=10.0,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    rms_norm_eps=1e-6,
)


def _fields(**overrides):
    f = copy.deepcopy(BASE_FIELDS)
    for k, v in overrides.items():
        f[k] = copy.deepcopy(v)
    return f


# What is captured (besides input_ids / logits / rope tables, always stored).  Always, for every
# layer: attn_in, attn_out, router_idx, router_w; for compressed layers compressor_out; for CSA
# layers indexer_rows, indexer_topk.  Optional (size): embed_out, mlp_in/mlp_out, streams_out
# ("all" layers / "last" layer / "none"), indexer_scores.
CAPTURE_FULL = dict(embed=True, mlp=True, streams="all", indexer_scores=True)
CAPTURE_ATTN = dict(embed=False, mlp=False, streams="none", indexer_scores=False)
CONFIGS = {
    "cfg_a": dict(
        fields=_fields(),
        batch=2,
        seq=67,
        capture=CAPTURE_FULL,
        decode_check=dict(prefill=21),  # prefill 21 tokens then 1 token at a time
        chunk_check=[21, 19, 27],
    ),
    "cfg_b": dict(
        fields=_fields(
            compress_rates={CSA: 4, HCA: 128},
            sliding_window=128,
            index_topk=16,
            rope_scaling={
                "type": "yarn",
                "factor": 16,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
        batch=1,
        seq=301,
        capture=CAPTURE_ATTN,
        decode_check=None,  # token-by-token over 301 tokens is slow in transformers
        chunk_check=[100, 57, 1, 143],
    ),
    "cfg_c": dict(
        fields=_fields(
            vocab_size=320,
            hidden_size=96,
            num_hidden_layers=5,
            layer_types=[CSA, HCA, SWA, HCA, CSA],
            compress_rates={CSA: 4, HCA: 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
            num_attention_heads=8,
            head_dim=48,
            qk_rope_head_dim=16,
            q_lora_rank=40,
            o_groups=4,
            o_lora_rank=12,
            n_routed_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            sliding_window=16,
            index_n_heads=16,
            index_head_dim=24,
            index_topk=5,
            max_position_embeddings=2048,
        ),
        batch=3,
        seq=45,
        capture=dict(CAPTURE_ATTN, indexer_scores=True),
        decode_check=dict(prefill=13),
        chunk_check=[13, 7, 25],
    ),
}

# Random init recipe (spec §6.2 step 3)
STD_MATRIX = 0.1  # every >=2-D weight (linears, experts, mHC fn, router weight)
STD_EMBED = 1.0  # embedding rows ~ unit RMS
HEAD_GAIN = 2.0  # lm head std = HEAD_GAIN / sqrt(D)  -> logits std ~2.5, max |logit| ~10
STD_POSITION_BIAS = 0.1  # compressor / indexer position_bias (ape)
STD_NORM = 0.5  # 1-D RMSNorm weights ~ 1 + N(0, STD_NORM^2)
STD_HC_SCALE = 0.5  # mHC scale / hc_head scale ~ 1 + N(0, 0.5^2)
STD_BIAS = 0.5  # sinks, mHC base, hc_head base, router bias ~ N(0, 0.5^2)
SEED = 20260501

# Tie guards: the k-th and (k+1)-th candidates of every top-k selection must differ by more
# than this (absolute), so that a correct fp32 port cannot pick a different set.
MIN_TOPK_GAP = 1e-4
MAX_INPUT_ATTEMPTS = 50


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def name_seed(tag: str, name: str) -> int:
    return (SEED * 1_000_003 + zlib.crc32(f"{tag}/{name}".encode())) % (2**63 - 1)


def to_bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """Round an fp32 tensor to the nearest bf16-representable value (kept in fp32)."""
    return t.to(torch.bfloat16).to(torch.float32)


def build_config(fields: dict) -> DeepseekV4Config:
    return DeepseekV4Config(**copy.deepcopy(fields), attn_implementation="eager", experts_implementation="eager")


def build_model(fields: dict) -> DeepseekV4ForCausalLM:
    cfg = build_config(fields)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, tag: str, num_experts: int, hidden: int) -> dict:
    """Re-randomize every parameter / persistent buffer except rotary inv_freq tables.

    Every tensor gets its own generator seeded from (SEED, tag, name), so the values do not
    depend on iteration order.  Float values are rounded to bf16-representable numbers (kept
    in fp32): fp32 parity is unaffected, a bf16 copy of the checkpoint is lossless.
    Returns {name: rule} for documentation.
    """
    rules = {}
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("inv_freq"):
            continue
        g = torch.Generator().manual_seed(name_seed(tag, name))
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            V, k = t.shape
            assert k <= num_experts
            rows = [torch.randperm(num_experts, generator=g)[:k] for _ in range(V)]
            t.copy_(torch.stack(rows).to(t.dtype))
            rules[name] = f"first {k} of randperm({num_experts}) per row"
            continue
        if not torch.is_floating_point(t):
            raise RuntimeError(f"unhandled non-float tensor {name} {t.dtype}")

        def normal(std, mean=0.0):
            return torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean

        if name.endswith("embed_tokens.weight"):
            val, rule = normal(STD_EMBED), f"N(0,{STD_EMBED}^2)"
        elif name == "lm_head.weight":
            std = HEAD_GAIN / math.sqrt(hidden)
            val, rule = normal(std), f"N(0,({HEAD_GAIN}/sqrt(D))^2)"
        elif leaf == "position_bias":
            val, rule = normal(STD_POSITION_BIAS), f"N(0,{STD_POSITION_BIAS}^2)"
        elif t.dim() >= 2:
            val, rule = normal(STD_MATRIX), f"N(0,{STD_MATRIX}^2)"
        elif leaf in ("sinks", "base", "hc_base", "e_score_correction_bias"):
            val, rule = normal(STD_BIAS), f"N(0,{STD_BIAS}^2)"
        elif leaf in ("scale", "hc_scale"):
            val, rule = normal(STD_HC_SCALE, 1.0), f"1+N(0,{STD_HC_SCALE}^2)"
        elif leaf == "weight" and t.dim() == 1:  # RMSNorm weights
            val, rule = normal(STD_NORM, 1.0), f"1+N(0,{STD_NORM}^2)"
        else:
            raise RuntimeError(f"no randomization rule for {name} {tuple(t.shape)}")
        t.copy_(to_bf16_exact(val).to(t.dtype))
        rules[name] = rule
    # nothing may be left at a constant default
    for name, t in tensors.items():
        if name.endswith("inv_freq"):
            continue
        flat = t.reshape(-1).double()
        assert flat.numel() < 2 or flat.std() > 0, f"{name} still constant"
        if t.numel() >= 1 and torch.is_floating_point(t):
            assert not torch.all(t == 0) and not torch.all(t == 1), f"{name} at default"
    return rules


class Capture:
    """Forward hooks that record per-layer tensors (clones, fp32 / int32)."""

    def __init__(self, model: DeepseekV4ForCausalLM, what: dict):
        self.what = what
        self.store: dict[str, torch.Tensor] = {}
        self.indexer_scores: dict[int, torch.Tensor] = {}  # raw scores, always kept for checks
        self.router: dict[int, tuple] = {}  # (scores_for_selection, k) for moe layers
        self.handles = []
        self.enabled = True
        m = model.model
        n_layers = len(m.layers)

        def put(key, t):
            if self.enabled:
                self.store[key] = t.detach().clone()

        if what["embed"]:
            self.handles.append(m.embed_tokens.register_forward_hook(lambda mod, a, o: put("embed_out", o)))
        for i, layer in enumerate(m.layers):

            def attn_hook(mod, args, kwargs, out, i=i):
                x = args[0] if args else kwargs["hidden_states"]
                put(f"layers.{i}.attn_in", x)
                put(f"layers.{i}.attn_out", out[0])

            self.handles.append(layer.self_attn.register_forward_hook(attn_hook, with_kwargs=True))

            if what["mlp"]:

                def mlp_hook(mod, args, kwargs, out, i=i):
                    x = args[0] if args else kwargs["hidden_states"]
                    put(f"layers.{i}.mlp_in", x)
                    put(f"layers.{i}.mlp_out", out)

                self.handles.append(layer.mlp.register_forward_hook(mlp_hook, with_kwargs=True))

            if what["streams"] == "all" or (what["streams"] == "last" and i == n_layers - 1):

                def layer_hook(mod, args, kwargs, out, i=i):
                    put(f"layers.{i}.streams_out", out)

                self.handles.append(layer.register_forward_hook(layer_hook, with_kwargs=True))

            # router: (logits [B*S,E], weights [B*S,k], indices [B*S,k])
            def gate_hook(mod, args, kwargs, out, i=i, is_hash=layer.mlp.is_hash):
                logits, weights, idx = out
                order = torch.argsort(idx, dim=-1)
                put(f"layers.{i}.router_idx", torch.gather(idx, -1, order).to(torch.int32))
                put(f"layers.{i}.router_w", torch.gather(weights, -1, order))
                if self.enabled and not is_hash:
                    sel = mod.score_fn(logits) + mod.e_score_correction_bias
                    self.router[i] = (sel.detach().clone(), mod.top_k)

            self.handles.append(layer.mlp.gate.register_forward_hook(gate_hook, with_kwargs=True))

            comp = layer.self_attn.compressor
            if comp is not None:

                def comp_hook(mod, args, kwargs, out, i=i):
                    put(f"layers.{i}.compressor_out", out[0][:, 0])  # [B,1,N,d] -> [B,N,d]

                self.handles.append(comp.register_forward_hook(comp_hook, with_kwargs=True))
                idxr = getattr(comp, "indexer", None)
                if idxr is not None:

                    def idx_hook(mod, args, kwargs, out, i=i):
                        put(f"layers.{i}.indexer_topk", out.to(torch.int32))

                    def scorer_hook(mod, args, kwargs, out, i=i):
                        q, rows, _x = args
                        put(f"layers.{i}.indexer_rows", rows)
                        if what["indexer_scores"]:
                            put(f"layers.{i}.indexer_scores", out)
                        if self.enabled:
                            self.indexer_scores[i] = out.detach().clone()

                    self.handles.append(idxr.register_forward_hook(idx_hook, with_kwargs=True))
                    self.handles.append(idxr.scorer.register_forward_hook(scorer_hook, with_kwargs=True))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def topk_gaps_indexer(scores: torch.Tensor, ratio: int, topk: int) -> dict:
    """Smallest (k-th best - (k+1)-th best) indexer score among the rows *visible* to a query,
    over all queries whose visible rows outnumber k (only those make a real selection).
    A gap near 0 would let fp32 rounding differences change the selected set."""
    B, S, N = scores.shape
    k = min(topk, N)
    best = dict(min_gap=math.inf, at_batch=None, at_pos=None)
    n_sel = 0
    for t in range(S):
        vis = (t + 1) // ratio
        if vis <= k:  # all visible rows are selected; no competition
            continue
        n_sel += 1
        top = torch.topk(scores[:, t, :vis], k + 1, dim=-1).values
        gap = top[:, k - 1] - top[:, k]
        b = int(torch.argmin(gap))
        if gap[b].item() < best["min_gap"]:
            best = dict(min_gap=gap[b].item(), at_batch=b, at_pos=t)
    return dict(best, queries_with_selection=n_sel, rows=N, k=k, score_std=scores.std().item())


def topk_gaps_router(sel: torch.Tensor, k: int) -> float:
    top = torch.topk(sel, k + 1, dim=-1).values
    return dict(min_gap=(top[:, k - 1] - top[:, k]).min().item())


def file_size(path: str) -> int:
    return os.path.getsize(path)


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def versions() -> dict:
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        safetensors=safetensors.__version__,
        numpy=np.__version__,
    )


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------------------------
# one config
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def make_config(name: str, spec: dict, out_root: str, ckpt_dtype: torch.dtype, skip_slow: bool) -> dict:
    t0 = time.time()
    fields = spec["fields"]
    out_dir = os.path.join(out_root, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)

    model = build_model(fields)
    cfg = model.config
    rules = randomize_(model, name, cfg.n_routed_experts, cfg.hidden_size)

    B, S = spec["batch"], spec["seq"]
    # Draw input ids; if a top-k selection (indexer or score router) is decided by a near-tie,
    # deterministically move on to the next input seed (weights stay fixed).
    for attempt in range(MAX_INPUT_ATTEMPTS):
        g = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()) + attempt)
        input_ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        cap = Capture(model, spec["capture"])
        logits = model(input_ids, use_cache=False).logits
        cap.enabled = False
        cap.remove()
        idx_gaps = {}
        for i, sc in cap.indexer_scores.items():
            idx_gaps[f"layer{i}"] = topk_gaps_indexer(sc, cfg.compress_rates[CSA], cfg.index_topk)
        rt_gaps = {f"layer{i}": topk_gaps_router(sel, k) for i, (sel, k) in cap.router.items()}
        gaps = [v["min_gap"] for v in list(idx_gaps.values()) + list(rt_gaps.values())]
        ok = all(gp > MIN_TOPK_GAP for gp in gaps)
        print(f"   {name} input attempt {attempt}: min top-k gap {min(gaps):.3g} -> {'ok' if ok else 'retry'}")
        if ok:
            break
    else:
        raise RuntimeError(f"{name}: no input seed without top-k near-ties")
    assert logits.dtype == torch.float32 and logits.shape == (B, S, cfg.vocab_size)

    checks: dict = {"input_seed_attempt": attempt, "min_topk_gap_threshold": MIN_TOPK_GAP}
    checks["indexer_topk_gap"] = idx_gaps
    checks["router_topk_gap"] = rt_gaps

    # ---- sanity: finite
    for k, v in list(cap.store.items()) + [("logits", logits)]:
        if torch.is_floating_point(v):
            assert torch.isfinite(v).all(), f"non-finite values in {k}"
    checks["all_finite"] = True

    # ---- sanity: use_cache=True full forward
    logits_cache = model(input_ids, use_cache=True).logits
    checks["use_cache_true_max_diff"] = max_abs_diff(logits_cache, logits)
    assert checks["use_cache_true_max_diff"] <= 1e-5, checks["use_cache_true_max_diff"]

    # ---- sanity: experts_implementation grouped_mm vs eager (informational + loose assert)
    model.set_experts_implementation("grouped_mm")
    logits_gmm = model(input_ids, use_cache=False).logits
    model.set_experts_implementation("eager")
    checks["grouped_mm_vs_eager_max_diff"] = max_abs_diff(logits_gmm, logits)
    assert checks["grouped_mm_vs_eager_max_diff"] <= 1e-4

    # ---- sanity: chunked prefill with the transformers cache
    if spec.get("chunk_check"):
        chunks = list(spec["chunk_check"])
        assert sum(chunks) == S, (chunks, S)
        out, pos = [], 0
        pkv = None
        for c in chunks:
            o = model(input_ids[:, pos : pos + c], past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            out.append(o.logits)
            pos += c
        checks["chunked_prefill"] = dict(chunks=chunks, max_diff=max_abs_diff(torch.cat(out, 1), logits))
        assert checks["chunked_prefill"]["max_diff"] <= 1e-4, checks["chunked_prefill"]

    # ---- sanity: prefill + token-by-token decode
    if spec.get("decode_check") and not skip_slow:
        p = spec["decode_check"]["prefill"]
        o = model(input_ids[:, :p], use_cache=True)
        pkv, out = o.past_key_values, [o.logits]
        for t in range(p, S):
            o = model(input_ids[:, t : t + 1], past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            out.append(o.logits)
        checks["decode"] = dict(prefill=p, steps=S - p, max_diff=max_abs_diff(torch.cat(out, 1), logits))
        assert checks["decode"]["max_diff"] <= 1e-4, checks["decode"]

    # ---- save checkpoint (transformers save_pretrained; safetensors is the only format in v5)
    if ckpt_dtype == torch.float32:
        model.save_pretrained(out_dir)
    else:
        copy.deepcopy(model).to(ckpt_dtype).save_pretrained(out_dir)

    # ---- sanity: reload
    re = DeepseekV4ForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    sd0, sd1 = model.state_dict(), re.state_dict()
    assert set(sd0) == set(sd1)
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), f"reloaded tensor differs: {k}"
    logits_re = re(input_ids, use_cache=False).logits
    checks["reload_max_diff"] = max_abs_diff(logits_re, logits)
    assert checks["reload_max_diff"] == 0.0, checks["reload_max_diff"]
    checks["reload_state_dict_identical"] = True

    # ---- write reference
    ref = {"input_ids": input_ids.to(torch.int32), "logits": logits.float()}
    rope = model.model.rotary_emb
    ref["rope.main_inv_freq"] = rope.main_inv_freq.float()
    ref["rope.compress_inv_freq"] = rope.compress_inv_freq.float()
    for k, v in cap.store.items():
        ref[k] = v.to(torch.int32) if not torch.is_floating_point(v) else v.float()
    ref = {k: v.contiguous() for k, v in ref.items()}
    save_file(ref, os.path.join(out_dir, "reference.safetensors"), metadata={"config": name})

    info = dict(
        config=name,
        versions=versions(),
        batch=B,
        seq=S,
        capture=spec["capture"],
        max_abs_logit=logits.abs().max().item(),
        logit_std=logits.std().item(),
        ckpt_dtype=str(ckpt_dtype).replace("torch.", ""),
        seed=SEED,
        randomization=sorted(set(rules.values())),
        tensors={k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in ref.items()},
        checks=checks,
        derived=dict(
            layer_types=cfg.layer_types,
            mlp_layer_types=cfg.mlp_layer_types,
            compress_rates=cfg.compress_rates,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            rope_parameters=cfg.rope_parameters,
        ),
    )
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(info, f, indent=1, default=float)
    info["seconds"] = round(time.time() - t0, 1)
    info["_model"] = model
    info["_logits"] = logits
    info["_input_ids"] = input_ids
    info["_streams_last"] = cap.store.get(f"layers.{cfg.num_hidden_layers - 1}.streams_out")
    return info


# --------------------------------------------------------------------------------------------
# MTP reference (spec §2.11), built from transformers' own decoder layer
# --------------------------------------------------------------------------------------------


def mtp_block_official_names(block_model: DeepseekV4ForCausalLM, tmp_dir: str) -> dict:
    """Return {official mtp.0.* name: tensor} for the MTP block held in `block_model`
    (a 1-layer DeepseekV4ForCausalLM: layers.0 = block, hc_head / norm = MTP's own).

    The leaf names come from transformers' own save_pretrained reverse mapping (spec §5.4),
    then the anchored names are fixed up; an explicit hand mapping (spec §5.2) is checked
    against it.
    """
    if os.path.isdir(tmp_dir):
        shutil.rmtree(tmp_dir)
    block_model.save_pretrained(tmp_dir)
    saved = load_file(os.path.join(tmp_dir, "model.safetensors"))
    shutil.rmtree(tmp_dir)
    out = {}
    for k, v in saved.items():
        if k.startswith("model.layers.0."):
            leaf = k[len("model.layers.0.") :]
            if leaf == "attn.norm.weight":  # saved name of the attention's own kv_norm
                leaf = "attn.kv_norm.weight"
            out["mtp.0." + leaf] = v
        elif k == "model.norm.weight":
            out["mtp.0.norm.weight"] = v
        elif k.startswith("model.hc_head.hc_"):
            out["mtp.0.hc_head_" + k[len("model.hc_head.hc_") :]] = v
        elif k in ("model.embed_tokens.weight", "head.weight"):
            pass  # shared with the backbone, not duplicated
        else:
            raise RuntimeError(f"unexpected saved key {k}")

    # explicit mapping from transformers parameter names (spec §5.2) as a cross-check
    sd = block_model.state_dict()
    p = "model.layers.0."
    I = block_model.config.moe_intermediate_size
    hand = {
        "mtp.0.norm.weight": sd["model.norm.weight"],
        "mtp.0.hc_head_fn": sd["model.hc_head.hc_fn"],
        "mtp.0.hc_head_base": sd["model.hc_head.hc_base"],
        "mtp.0.hc_head_scale": sd["model.hc_head.hc_scale"],
        "mtp.0.attn_norm.weight": sd[p + "input_layernorm.weight"],
        "mtp.0.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
        "mtp.0.attn.attn_sink": sd[p + "self_attn.sinks"],
        "mtp.0.attn.wq_a.weight": sd[p + "self_attn.q_a_proj.weight"],
        "mtp.0.attn.q_norm.weight": sd[p + "self_attn.q_a_norm.weight"],
        "mtp.0.attn.wq_b.weight": sd[p + "self_attn.q_b_proj.weight"],
        "mtp.0.attn.wkv.weight": sd[p + "self_attn.kv_proj.weight"],
        "mtp.0.attn.kv_norm.weight": sd[p + "self_attn.kv_norm.weight"],
        "mtp.0.attn.wo_a.weight": sd[p + "self_attn.o_a_proj.weight"],
        "mtp.0.attn.wo_b.weight": sd[p + "self_attn.o_b_proj.weight"],
        "mtp.0.ffn.gate.weight": sd[p + "mlp.gate.weight"],
        "mtp.0.ffn.gate.bias": sd[p + "mlp.gate.e_score_correction_bias"],
        "mtp.0.ffn.shared_experts.w1.weight": sd[p + "mlp.shared_experts.gate_proj.weight"],
        "mtp.0.ffn.shared_experts.w3.weight": sd[p + "mlp.shared_experts.up_proj.weight"],
        "mtp.0.ffn.shared_experts.w2.weight": sd[p + "mlp.shared_experts.down_proj.weight"],
    }
    for part in ("attn", "ffn"):
        for leaf in ("fn", "base", "scale"):
            hand[f"mtp.0.hc_{part}_{leaf}"] = sd[f"{p}{part}_hc.{leaf}"]
    gu, dn = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
    for e in range(gu.shape[0]):
        hand[f"mtp.0.ffn.experts.{e}.w1.weight"] = gu[e, :I]
        hand[f"mtp.0.ffn.experts.{e}.w3.weight"] = gu[e, I:]
        hand[f"mtp.0.ffn.experts.{e}.w2.weight"] = dn[e]
    assert set(hand) == set(out), (sorted(set(hand) ^ set(out)))
    for k in hand:
        assert torch.equal(hand[k].to(out[k].dtype), out[k]), k
    return out


@torch.no_grad()
def official_roundtrip(mtp_dir: str, block_cfg, nxt, x_in, mtp_logits) -> float:
    """Build an official-layout 1-layer checkpoint from the mtp.0.* tensors of `mtp_dir`
    (layers.0.* = block, norm / hc_head_* = MTP's, embed / head = backbone's), load it with
    from_pretrained, feed X' into layer 0 and compare the logits."""
    sd = load_file(os.path.join(mtp_dir, "model.safetensors"))
    off = {"embed.weight": sd["model.embed_tokens.weight"], "head.weight": sd["head.weight"]}
    for k, v in sd.items():
        if not k.startswith("mtp.0."):
            continue
        leaf = k[len("mtp.0.") :]
        if leaf in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight"):
            continue
        if leaf in ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"):
            off[leaf] = v
        else:
            off["layers.0." + leaf] = v
    with tempfile.TemporaryDirectory() as tmp:
        block_cfg.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in off.items()}, os.path.join(tmp, "model.safetensors"))
        m = DeepseekV4ForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        ).eval()

    def pre_hook(mod, args, kwargs):
        return (x_in,) + tuple(args[1:]), kwargs

    h = m.model.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    logits = m(nxt, use_cache=False).logits
    h.remove()
    return max_abs_diff(logits, mtp_logits)


@torch.no_grad()
def make_mtp(base: dict, out_root: str, ckpt_dtype: torch.dtype) -> dict:
    t0 = time.time()
    name = "cfg_a_mtp"
    out_dir = os.path.join(out_root, name)
    src_dir = os.path.join(out_root, base["config"])
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)

    backbone: DeepseekV4ForCausalLM = base["_model"]
    cfg = backbone.config
    ids = base["_input_ids"]
    X = base["_streams_last"]  # [B,T,n,D] final residual streams, before hc_head
    assert X is not None
    B, T = ids.shape
    D = cfg.hidden_size

    # the MTP block: a 1-layer DeepseekV4ForCausalLM whose layer 0 is one SWA + score-routed
    # MoE decoder layer, whose hc_head / norm are the MTP's own, and whose embedding and lm
    # head are the backbone's (shared).
    fields = _fields(**CONFIGS[base["config"]]["fields"])
    fields.update(num_hidden_layers=1, layer_types=[SWA], mlp_layer_types=["moe"])
    blk = build_model(fields)
    randomize_(blk, name, cfg.n_routed_experts, D)
    blk.model.embed_tokens.weight.copy_(backbone.model.embed_tokens.weight)
    blk.lm_head.weight.copy_(backbone.lm_head.weight)

    # e_proj / h_proj / enorm / hnorm (no transformers equivalent; transformers' own RMSNorm class)
    extra = torch.nn.ModuleDict(
        dict(
            e_proj=torch.nn.Linear(D, D, bias=False),
            h_proj=torch.nn.Linear(D, D, bias=False),
            enorm=mdv4.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps),
            hnorm=mdv4.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps),
        )
    )
    randomize_(extra, name + "/extra", cfg.n_routed_experts, D)

    nxt = ids[:, 1:]  # tokens fed to the MTP block: id_{i+1}, i = 0..T-2
    e = blk.model.embed_tokens(nxt)  # [B,T-1,D]
    x_in = extra["e_proj"](extra["enorm"](e)).unsqueeze(2) + extra["h_proj"](extra["hnorm"](X[:, :-1]))
    assert x_in.shape == (B, T - 1, cfg.hc_mult, D)

    # run transformers' decoder layer on X' by swapping its input streams with a pre-hook
    state = dict(calls=0)

    def pre_hook(mod, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        assert hs.shape == x_in.shape, (hs.shape, x_in.shape)
        # transformers' input would be the 4 identical copies of e; replace with X'
        assert torch.equal(hs, e.unsqueeze(2).expand_as(hs))
        state["calls"] += 1
        if args:
            return (x_in,) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = x_in
        return args, kwargs

    block_out = {}

    def post_hook(mod, args, kwargs, out):
        block_out["streams"] = out.detach().clone()

    h1 = blk.model.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    h2 = blk.model.layers[0].register_forward_hook(post_hook, with_kwargs=True)
    mtp_logits = blk(nxt, use_cache=False).logits  # positions 0..T-2
    mtp_logits_cache = blk(nxt, use_cache=True).logits
    h1.remove()
    h2.remove()
    assert state["calls"] == 2
    checks = {}
    checks["use_cache_true_max_diff"] = max_abs_diff(mtp_logits_cache, mtp_logits)
    assert checks["use_cache_true_max_diff"] <= 1e-5

    # independent recomputation of the head part from the captured block output
    hb = blk.model.norm(blk.model.hc_head(block_out["streams"]))
    checks["head_recompute_max_diff"] = max_abs_diff(blk.lm_head(hb), mtp_logits)
    assert checks["head_recompute_max_diff"] <= 1e-5
    assert torch.isfinite(mtp_logits).all() and torch.isfinite(block_out["streams"]).all()

    # MTP router tie guard
    sel_store = {}

    def gate_hook(mod, args, kwargs, out):
        sel_store["sel"] = mod.score_fn(out[0]) + mod.e_score_correction_bias

    h3 = blk.model.layers[0].mlp.gate.register_forward_hook(gate_hook, with_kwargs=True)
    h4 = blk.model.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    blk(nxt, use_cache=False)
    h3.remove()
    h4.remove()
    checks["router_topk_gap"] = topk_gaps_router(sel_store["sel"], cfg.num_experts_per_tok)
    assert checks["router_topk_gap"]["min_gap"] > MIN_TOPK_GAP

    # ---- checkpoint: cfg_a's saved tensors + mtp.0.* (official names)
    with tempfile.TemporaryDirectory() as tmp:
        mtp_tensors = mtp_block_official_names(blk, os.path.join(tmp, "mtp_block"))
    for k in ("e_proj", "h_proj", "enorm", "hnorm"):
        mtp_tensors[f"mtp.0.{k}.weight"] = extra[k].weight.detach().clone()
    base_sd = load_file(os.path.join(src_dir, "model.safetensors"))
    assert not any(k.startswith("mtp.") for k in base_sd)
    full = dict(base_sd)
    for k, v in mtp_tensors.items():
        full[k] = v.to(ckpt_dtype).contiguous()
    with safetensors.safe_open(os.path.join(src_dir, "model.safetensors"), "pt") as f:
        meta = f.metadata()
    save_file(full, os.path.join(out_dir, "model.safetensors"), metadata=meta)
    for fn in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(src_dir, fn), os.path.join(out_dir, fn))

    # ---- sanity: transformers loads it (ignoring mtp.*) and reproduces cfg_a's logits
    re = DeepseekV4ForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    checks["backbone_reload_max_diff"] = max_abs_diff(re(ids, use_cache=False).logits, base["_logits"])
    assert checks["backbone_reload_max_diff"] == 0.0
    # mtp tensors round-trip exactly
    re_sd = load_file(os.path.join(out_dir, "model.safetensors"))
    for k, v in mtp_tensors.items():
        assert torch.equal(re_sd[k].float(), v.float()), k
    checks["mtp_tensor_count"] = len(mtp_tensors)

    # ---- sanity: the official-name mtp.0.* tensors, loaded back through transformers' own
    # official-checkpoint renaming as a 1-layer model, reproduce the MTP logits
    checks["official_names_roundtrip_max_diff"] = official_roundtrip(
        out_dir, blk.config, nxt, x_in, mtp_logits
    )
    assert checks["official_names_roundtrip_max_diff"] == 0.0

    ref = {
        "input_ids": ids.to(torch.int32),
        "mtp_in_streams": x_in.float(),
        "mtp_block_streams_out": block_out["streams"].float(),
        "mtp_logits": mtp_logits.float(),
    }
    ref = {k: v.contiguous() for k, v in ref.items()}
    save_file(ref, os.path.join(out_dir, "reference.safetensors"), metadata={"config": name})
    info = dict(
        config=name,
        base_config=base["config"],
        versions=versions(),
        batch=B,
        seq=T,
        max_abs_mtp_logit=mtp_logits.abs().max().item(),
        mtp_logit_std=mtp_logits.std().item(),
        ckpt_dtype=str(ckpt_dtype).replace("torch.", ""),
        mtp_tensors={k: list(v.shape) for k, v in sorted(mtp_tensors.items())},
        tensors={k: dict(shape=list(v.shape), dtype=str(v.dtype).replace("torch.", "")) for k, v in ref.items()},
        checks=checks,
    )
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(info, f, indent=1, default=float)
    info["seconds"] = round(time.time() - t0, 1)
    return info


# --------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/golden")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS) + ["cfg_a_mtp"])
    ap.add_argument(
        "--ckpt-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of model.safetensors (weights are bf16-exact, so bfloat16 is lossless)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-slow", action="store_true", help="skip the token-by-token decode checks")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    ckpt_dtype = getattr(torch, args.ckpt_dtype)
    os.makedirs(args.out, exist_ok=True)
    print("versions:", versions())

    done = {}
    for name in args.configs:
        if name == "cfg_a_mtp":
            if "cfg_a" not in done:
                done["cfg_a"] = make_config("cfg_a", CONFIGS["cfg_a"], args.out, ckpt_dtype, args.skip_slow)
            info = make_mtp(done["cfg_a"], args.out, ckpt_dtype)
        else:
            info = make_config(name, CONFIGS[name], args.out, ckpt_dtype, args.skip_slow)
            done[name] = info
        d = os.path.join(args.out, name)
        for fn in os.listdir(d):
            os.chmod(os.path.join(d, fn), 0o644)
        print(f"== {name}: {info['seconds']} s")
        print("   checks:", json.dumps(info["checks"], default=float))
        for fn in sorted(os.listdir(d)):
            print(f"   {fn:28s} {file_size(os.path.join(d, fn)):>10,d} B")
        print(f"   {'total':28s} {dir_size(d):>10,d} B")
    total = sum(dir_size(os.path.join(args.out, n)) for n in os.listdir(args.out) if os.path.isdir(os.path.join(args.out, n)))
    print(f"total under {args.out}: {total:,d} B")


if __name__ == "__main__":
    main()
