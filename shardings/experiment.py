"""Sharding experiments on paper: memory, collectives and step time of a (dp, ep, tp) layout.

    python -m shardings.experiment --preset v4-flash --dp 1 --ep 64 --batch 4096 \
        --context 32768 --mode decode --flops 8e14 --hbm 4.2e12 --link 4.5e11 --redundant 64
    python -m shardings.experiment --preset v4-flash --compare "dp=1,ep=64;dp=1,ep=8;dp=4,ep=4"

Layout convention = `shardings.mesh.make_mesh`: a (dp, ep, tp) grid of dp*ep*tp devices.
Attention is data parallel over dp x ep (the batch is split dp*ep ways, replicated over tp);
routed experts are split over ep (and over tp along "mlp") and replicated over dp; every other
weight is replicated, or split over tp along the axes `shardings.mesh.RULES` names. The
embedding and the head have a "vocab" axis, which RULES leaves replicated: each device holds
both whole tables, and the logits of its own tokens need no collective. DeepInfer's "EP64/DP64"
decode (64 GPUs, attention DP 64, MoE EP 64 on the same GPUs) is `--dp 1 --ep 64` here;
`--mesh shared` reads --dp as that attention-DP degree instead (grid dp = dp / ep).

Model of one step (per device; everything is an estimate):

* memory: weights per --dtype (see `bytes_per_element`), the MTP block included (its routed
  experts split like the backbone's, --no-mtp to drop it) and the hash tables (int32); decode
  state = `deepinfer_fn.state.state_bytes` for the device's sequences at capacity `context`
  (backbone layers; an MTP layer's window ring is not in it); a rough activation workspace.
* tokens: decode: batch * tokens_per_seq / (dp*ep) per device, every sequence at position
  context-1 with a full state; prefill: prefill_tokens per device per step, costs averaged over
  the positions 0..context-1 of a context-long prompt.
* FLOPs (2 per multiply-add), from the param specs: every linear / grouped weight costs
  2*size per token (divided over tp where the weight is tp-split), routed experts k of E
  (times --imbalance on the busiest device), head once per decoded token; attention core
  4*H*d per visible key (window + CSA top-k rows / all HCA rows) and CSA indexer scoring
  2*H_I*d_I per compressed row. Elementwise work (norms, RoPE, Sinkhorn, softmax) is ignored.
* HBM bytes: every resident dense weight once per step; the routed experts that receive at
  least one token (expected fraction 1-(1-k/P)^tokens of the dp slice, P physical experts);
  decode state reads (window ring, CSA selected rows + all indexer rows, all HCA rows,
  compressor buffers); residual-stream and dispatch-buffer traffic. No cache reuse assumed.
* collectives (bytes a device sends; the link rate is per device): per MoE layer one dispatch
  and one combine all-to-all over ep, tokens*k*D*bytes*(1-1/ep) (1/ep of the assignments stay
  on the device in expectation; dispatch in fp8 + per-128 scales for fp8/fp4, else bf16;
  combine bf16); with --dedup a token goes once to each distinct destination device (DeepEP
  style). tp > 1: an all-gather of the o_lora activations before wo_b and an all-reduce of
  the indexer scores (CSA) per attention layer, one all-reduce of the MoE output per MoE
  layer (ring: 2(tp-1)/tp of the message). Plus the sampled tokens to the host.
* time: per component a roofline max(flops/F, bytes/B), summed over components = local time;
  comm = bytes/link (+ --latency per collective call). Overlap model "overlap": step =
  max(local, comm) (two micro-batches, communication fully hidden behind compute, as DeepSeek
  overlaps dispatch/combine); "serial": step = local + comm. Also reported: the pure sums
  compute = sum flops / F and hbm = sum bytes / B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

import jax
import numpy as np

from deepinfer_fn.config import CSA, HCA, ModelConfig
from deepinfer_fn.params import BF16, F32, FP4, FP8, I64, is_spec, param_specs, unstacked_specs
from deepinfer_fn.state import state_bytes

GB = 1e9
DTYPES = ("bf16", "fp8", "fp4")
CATEGORIES = ("embed", "head", "attention", "mhc_norms", "router", "shared_expert",
              "routed_experts", "hash_tables", "mtp")


# ------------------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.ep * self.tp

    @property
    def batch_shards(self) -> int:           # attention data-parallel degree
        return self.dp * self.ep

    def mesh(self):
        from jax.sharding import AbstractMesh
        return AbstractMesh((self.dp, self.ep, self.tp), ("dp", "ep", "tp"))


def parse_layout(text: str, mesh: str = "grid") -> tuple[Layout, dict[str, Any]]:
    """'dp=64,ep=64[,tp=2][,redundant=64][,batch=..]' -> (Layout, other overrides)."""
    kv = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        key, _, value = part.partition("=")
        if key == "skew":
            kv[key] = value
        else:
            kv[key] = float(value) if key in ("imbalance", "latency") else int(value)
    dp, ep, tp = kv.pop("dp", 1), kv.pop("ep", 1), kv.pop("tp", 1)
    if mesh == "shared":
        if dp % ep:
            raise ValueError(f"--mesh shared: attention dp={dp} must be a multiple of ep={ep}")
        dp //= ep
    elif mesh != "grid":
        raise ValueError(f"mesh={mesh!r}; expected 'grid' or 'shared'")
    return Layout(dp, ep, tp), kv


# ------------------------------------------------------------------------------ params
def _category(path) -> str:
    keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
    top = keys[0]
    if top in ("embed", "head", "mtp"):
        return top
    if top in ("hc_head", "norm"):
        return "mhc_norms"
    names = [k for k in keys[1:] if isinstance(k, str)]   # ("layers", [blocks, g, j | i], sub, ...)
    sub = names[0]
    if sub == "attn":
        return "attention"
    if sub == "ffn":
        leaf = names[1]
        if leaf in ("w1", "w2", "w3"):
            return "routed_experts"
        if leaf == "shared":
            return "shared_expert"
        if leaf == "tid2eid":
            return "hash_tables"
        return "router"
    return "mhc_norms"


def bytes_per_element(spec, dtype: str) -> float:
    """Bytes one element of a weight occupies in device memory.

    bf16: every matrix in bf16; fp8: FP8 (and FP4) checkpoint weights as e4m3 + one UE8M0
    scale per 128x128 block; fp4: the official formats (FP8 dense, FP4 experts + one scale per
    32). Weights kept fp32 (§2.12) are 4 bytes, hash tables int32, in every mode.
    """
    if spec.layout == "index":
        return 4.0
    if spec.keep_fp32 or spec.fmt == F32:
        return 4.0
    if dtype == "bf16" or spec.fmt == BF16:
        return 2.0
    if spec.fmt == FP4 and dtype == "fp4":
        return 0.5 + 1 / 32
    if spec.fmt in (FP8, FP4):
        return 1.0 + 1 / (128 * 128)
    raise ValueError(f"unknown format {spec.fmt!r} / dtype {dtype!r}")


def checkpoint_bytes(cfg: ModelConfig, include_mtp: bool = True) -> int:
    """Tensor bytes of the official checkpoint layout (§5.2-5.3), exact (scales included)."""
    total = 0
    for s in jax.tree.leaves(unstacked_specs(cfg, include_mtp), is_leaf=is_spec):
        n = math.prod(s.shape)
        if s.fmt == FP8 and s.layout == "linear":
            d_in, d_out = s.shape
            total += n + math.ceil(d_out / 128) * math.ceil(d_in / 128)
        elif s.fmt == FP8 and s.layout == "grouped":
            g, d_in, r = s.shape
            total += n + math.ceil(g * r / 128) * math.ceil(d_in / 128)
        elif s.fmt == FP4:
            e, d_in, d_out = s.shape
            total += n // 2 + e * d_out * (d_in // cfg.fp4_group)
        else:
            total += n * {BF16: 2, F32: 4, I64: 8}[s.fmt]
    return total


def param_report(cfg: ModelConfig, layout: Layout, dtype: str = "bf16", redundant: int = 0,
                 include_mtp: bool = True) -> dict[str, Any]:
    """Per-category parameter counts: total (logical), per device, copies across the mesh, bytes.

    Routed experts become E + redundant physical experts, ceil((E+R)/ep) per device.
    Per-leaf shard shapes come from `shardings.mesh.logical_spec` (the rules the real
    sharding uses) on an abstract mesh.
    """
    from jax.sharding import NamedSharding
    from shardings.mesh import logical_spec

    mesh = layout.mesh()
    E = cfg.n_routed_experts
    phys = E + redundant
    per_dev_experts = math.ceil(phys / layout.ep)
    total = dict.fromkeys(CATEGORIES, 0)
    per_dev = dict.fromkeys(CATEGORIES, 0)
    per_dev_bytes = dict.fromkeys(CATEGORIES, 0.0)
    device_elems = dict.fromkeys(CATEGORIES, 0)       # summed over all devices
    flat = jax.tree_util.tree_flatten_with_path(param_specs(cfg, include_mtp), is_leaf=is_spec)[0]
    for path, s in flat:
        cat = _category(path)
        shape = s.shape
        if s.layout == "experts":                   # [(layers,) E, ...]
            e_axis = int(s.stacked)
            shape = (*shape[:e_axis], per_dev_experts * layout.ep, *shape[e_axis + 1:])
        shard = NamedSharding(mesh, logical_spec(s.axes, shape, mesh)).shard_shape(shape)
        n_dev = math.prod(shard)
        total[cat] += math.prod(s.shape)
        per_dev[cat] += n_dev
        per_dev_bytes[cat] += n_dev * bytes_per_element(s, dtype)
        device_elems[cat] += n_dev * layout.devices
    copies = {c: (device_elems[c] / total[c] if total[c] else 0.0) for c in CATEGORIES}
    params_total = sum(v for c, v in total.items() if c != "hash_tables")
    return {"total_params": total, "per_device_params": per_dev, "copies": copies,
            "per_device_bytes": per_dev_bytes, "per_device_bytes_sum": sum(per_dev_bytes.values()),
            "model_params": params_total, "physical_experts": phys,
            "experts_per_device": per_dev_experts, "experts_divisible": phys % layout.ep == 0}


# ------------------------------------------------------------------------------ flops
def _tp_factor(spec, layout: Layout) -> int:
    """How many ways the tp axis splits this weight (1 when it is not tp-sharded)."""
    from shardings.mesh import RULES
    if layout.tp == 1:
        return 1
    for ax, dim in zip(spec.axes, spec.shape):
        if ax is not None and RULES.get(ax) == "tp" and dim % layout.tp == 0:
            return layout.tp
    return 1


def _keys(cfg: ModelConfig, layer_type: str, t):
    """Visible window keys, attended compressed rows and indexer rows at position(s) t."""
    t = np.asarray(t, np.float64)
    window = np.minimum(t + 1, cfg.sliding_window)
    if layer_type == CSA:
        n4 = np.floor((t + 1) / cfg.csa_ratio)
        return window, np.minimum(cfg.index_topk, n4), n4
    if layer_type == HCA:
        return window, np.floor((t + 1) / cfg.hca_ratio), np.zeros_like(t)
    return window, np.zeros_like(t), np.zeros_like(t)


def _positions(mode: str, context: int):
    if mode == "decode":
        return np.array([context - 1], np.float64)
    return np.arange(context, dtype=np.float64)      # averaged over a whole prompt


def step_components(cfg: ModelConfig, layout: Layout, tokens: float, context: int, mode: str,
                    dtype: str, redundant: int, imbalance: float, prefill_tokens: int,
                    seqs_per_device: float) -> dict[str, dict[str, float]]:
    """FLOPs and HBM bytes per device per step, by component (see the module docstring)."""
    specs = param_specs(cfg, include_mtp=False)
    D, n, k, E = cfg.hidden_size, cfg.hc_mult, cfg.num_experts_per_tok, cfg.n_routed_experts
    H, d = cfg.num_attention_heads, cfg.head_dim
    P = E + redundant
    act = 2.0                                          # bf16 activations
    comp = {c: {"flops": 0.0, "bytes": 0.0} for c in
            ("attn_proj", "attn_core", "moe_routed", "moe_dense", "mhc_norms", "embed_head")}

    def weights(tree, c, per_token=True):
        for s in jax.tree.leaves(tree, is_leaf=is_spec):
            tpf = _tp_factor(s, layout)
            size = math.prod(s.shape)
            comp[c]["bytes"] += size / tpf * bytes_per_element(s, dtype)
            if per_token and s.layout in ("linear", "grouped"):
                comp[c]["flops"] += 2.0 * size / tpf * tokens

    pos = _positions(mode, context)
    h_tp = layout.tp if layout.tp > 1 and H % layout.tp == 0 else 1
    hi_tp = layout.tp if layout.tp > 1 and cfg.index_n_heads % layout.tp == 0 else 1
    experts_dev = math.ceil(P / layout.ep)
    slice_tokens = tokens * layout.ep                  # tokens of one dp slice, all over ep
    active = 1.0 - (1.0 - min(k / P, 1.0)) ** slice_tokens
    for lt, layer in zip(cfg.layer_types, specs["layers"]):
        weights(layer["attn"], "attn_proj")
        weights({kk: v for kk, v in layer["ffn"].items() if kk in ("gate", "gate_bias", "shared")},
                "moe_dense")
        weights({kk: v for kk, v in layer.items() if kk in ("hc_attn", "hc_ffn", "attn_norm",
                                                           "ffn_norm")}, "mhc_norms")
        # attention core: QK and PV over every visible key; indexer scoring over all rows
        window, rows, irows = _keys(cfg, lt, pos)
        comp["attn_core"]["flops"] += tokens * (4.0 * H * d * float(np.mean(window + rows)) / h_tp
                                                + 2.0 * cfg.index_n_heads * cfg.index_head_dim
                                                * float(np.mean(irows)) / hi_tp)
        comp["attn_core"]["bytes"] += _state_read_bytes(cfg, lt, context, mode, tokens,
                                                        prefill_tokens, seqs_per_device)
        # routed experts: k assignments per token; the busiest device gets `imbalance` x mean
        e = layer["ffn"]["w1"]
        tpf = _tp_factor(e, layout)
        per_expert = sum(math.prod(layer["ffn"][w].shape[1:]) for w in ("w1", "w2", "w3"))
        comp["moe_routed"]["flops"] += 2.0 * tokens * k * per_expert / tpf * imbalance
        comp["moe_routed"]["bytes"] += (experts_dev * active * per_expert / tpf
                                        * bytes_per_element(e, dtype))
        comp["moe_routed"]["bytes"] += tokens * k * D * act * 2 * imbalance   # rows in and out
        comp["mhc_norms"]["bytes"] += tokens * 8 * n * D * act   # residual streams r+w, 2 sublayers
    weights({"hc_head": specs["hc_head"], "norm": specs["norm"]}, "mhc_norms")
    head = specs["head"]
    logits_tokens = tokens if mode == "decode" else 0.0    # prefill: last position only (~0)
    comp["embed_head"]["flops"] += (2.0 * math.prod(head.shape) / _tp_factor(head, layout)
                                    * logits_tokens)
    comp["embed_head"]["bytes"] += (math.prod(head.shape) * bytes_per_element(head, dtype)
                                    if logits_tokens else 0.0)
    comp["embed_head"]["bytes"] += tokens * D * bytes_per_element(specs["embed"], dtype)
    comp["embed_head"]["bytes"] += logits_tokens * cfg.vocab_size * 4
    return comp


def _state_read_bytes(cfg, lt, context, mode, tokens, prefill_tokens, seqs_per_device):
    """Decode-state bytes one layer reads (and writes) per step on one device (bf16 rows)."""
    d, dI, b = cfg.head_dim, cfg.index_head_dim, 2.0
    c = 2 if lt == CSA else 1
    m = cfg.compress_ratio_of(lt)
    per_token_write = d * b + (c * d * (b + 4) * 2 if m else 0)     # ring slot; partial r+w
    if lt == CSA:
        per_token_write += 2 * dI * (b + 4) * 2
    if mode == "decode":
        window, rows, irows = (float(x[0]) for x in _keys(cfg, lt, [context - 1]))
        per_token = window * (d * b + 4) + rows * d * b + irows * dI * b
        return tokens * (per_token + per_token_write)
    # prefill: per-query gathers of the CSA top-k rows; ring, HCA rows and indexer rows read
    # once per chunk per sequence (shared by the chunk's queries), at the average position
    window, rows, irows = _keys(cfg, lt, _positions("prefill", context))
    gathered = float(np.mean(rows)) * d * b if lt == CSA else 0.0
    shared = (cfg.sliding_window * d * b + (float(np.mean(rows)) * d * b if lt == HCA else 0.0)
              + float(np.mean(irows)) * dI * b)
    seqs_in_chunk = max(1.0, prefill_tokens / context)
    return tokens * (gathered + per_token_write) + seqs_in_chunk * shared


# ------------------------------------------------------------------------------ comms
def collectives(cfg: ModelConfig, layout: Layout, tokens: float, dtype: str, imbalance: float,
                dedup: bool, mode: str, context: int) -> list[dict[str, Any]]:
    """Every collective of one step: name, calls per step, bytes per device per call."""
    D, k, E, ep, tp = (cfg.hidden_size, cfg.num_experts_per_tok, cfg.n_routed_experts,
                       layout.ep, layout.tp)
    n_moe = cfg.num_hidden_layers
    disp_b = 2.0 if dtype == "bf16" else 1.0 + 4.0 / 128     # fp8 + one fp32 scale per 128
    remote = 1.0 - 1.0 / ep
    # DeepEP-style: one copy per distinct remote device (experts spread E/ep per device)
    per_dev_e = E // ep if E % ep == 0 else E / ep
    p_hit = 1.0 - math.comb(E - int(per_dev_e), k) / math.comb(E, k) if ep > 1 else 0.0
    dedup_factor = ((ep - 1) * p_hit) / (k * remote) if ep > 1 else 1.0
    factor = dedup_factor if dedup else 1.0
    out = []
    if ep > 1:
        a2a = tokens * k * D * remote * factor
        out.append({"name": "moe_dispatch", "kind": "all_to_all(ep)", "calls": n_moe,
                    "bytes_per_call": a2a * disp_b, "local_fraction": 1.0 / ep,
                    "dedup_factor": dedup_factor, "imbalance": imbalance})
        out.append({"name": "moe_combine", "kind": "all_to_all(ep)", "calls": n_moe,
                    "bytes_per_call": a2a * 2.0, "local_fraction": 1.0 / ep,
                    "dedup_factor": dedup_factor, "imbalance": imbalance})
    if tp > 1:
        ring_ag, ring_ar = (tp - 1) / tp, 2 * (tp - 1) / tp
        if cfg.o_groups % tp == 0:
            out.append({"name": "attn_o_allgather", "kind": "all_gather(tp)",
                        "calls": cfg.num_hidden_layers,
                        "bytes_per_call": tokens * cfg.o_groups * cfg.o_lora_rank * 2.0 * ring_ag})
        n_csa = sum(lt == CSA for lt in cfg.layer_types)
        if n_csa and cfg.index_n_heads % tp == 0:
            irows = float(np.mean(_keys(cfg, CSA, _positions(mode, context))[2]))
            out.append({"name": "indexer_scores_allreduce", "kind": "all_reduce(tp)",
                        "calls": n_csa, "bytes_per_call": tokens * irows * 4.0 * ring_ar})
        if cfg.moe_intermediate_size % tp == 0:
            out.append({"name": "moe_out_allreduce", "kind": "all_reduce(tp)", "calls": n_moe,
                        "bytes_per_call": tokens * D * 2.0 * ring_ar})
    if mode == "decode":
        out.append({"name": "sampled_tokens_to_host", "kind": "device_to_host", "calls": 1,
                    "bytes_per_call": tokens * 4.0})
    for c in out:
        c["bytes_per_step"] = c["calls"] * c["bytes_per_call"]
    return out


# ------------------------------------------------------------------------------ skew
def skew_imbalance(cfg: ModelConfig, ep: int, redundant: int, skew: str, step_tokens: float,
                   seed: int = 0, plan_tokens: int = 32768) -> float:
    """max/mean expert load over the ep devices of one dp slice for a synthetic workload.

    The placement is planned (`shardings.balancer.plan_replicas`) on a long trace of the
    workload; without redundant experts it is the plain contiguous `P("ep")` layout. It is
    scored on a fresh trace of one step's tokens (`step_tokens`, the dp slice's), so the
    figure includes per-step sampling noise, which no placement removes.
    """
    from shardings.balancer import (expert_load, plan_replicas, static_placement,
                                    synthetic_routing)
    if ep == 1:
        return 1.0
    kind, *args = skew.split(":")
    kw = {}
    if kind == "zipf" and args:
        kw["exponent"] = float(args[0])
    elif kind == "hot" and args:
        kw["n_hot"] = int(args[0])
        if len(args) > 1:
            kw["boost"] = float(args[1])
    N, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    step = synthetic_routing(kind, max(int(round(step_tokens)), 1), N, k, seed, sample=1, **kw)
    if redundant == 0:
        placement = static_placement(N, ep)
    else:
        load = expert_load(synthetic_routing(kind, plan_tokens, N, k, seed, sample=0, **kw), N)
        placement = plan_replicas(load, ep, redundant)
    return placement.max_over_mean(expert_load(step, N))


# ------------------------------------------------------------------------------ report
def layout_report(cfg: ModelConfig, dp: int = 1, ep: int = 1, tp: int = 1, batch: int = 1,
                  context: int = 4096, mode: str = "decode", flops: float = 8e14,
                  hbm: float = 4.2e12, link: float = 4.5e11, *, redundant: int = 0,
                  dtype: str = "bf16", prefill_tokens: int = 8192, tokens_per_seq: int = 1,
                  imbalance: float = 1.0, skew: str | None = None, dedup: bool = False,
                  latency: float = 0.0, include_mtp: bool = True,
                  capacity: float | None = None) -> dict[str, Any]:
    """Memory, collectives and estimated step time of one layout (a JSON-able dict).

    imbalance: max/mean routed-expert load over devices (scales the busiest device's expert
    compute and all-to-all traffic). skew ('zipf[:s]', 'hot[:n:boost]', 'uniform') computes it
    instead with `skew_imbalance` (the balancer's placement scored on one step's tokens).
    """
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode={mode!r}; expected 'decode' or 'prefill'")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; expected one of {DTYPES}")
    layout = Layout(dp, ep, tp)
    notes = []
    shards = layout.batch_shards
    seqs = batch / shards
    if batch % shards:
        notes.append(f"batch {batch} is not divisible by dp*ep={shards}: per-device figures use "
                     f"ceil = {math.ceil(seqs)} sequences (memory) and {seqs:.2f} (throughput)")
    if (cfg.n_routed_experts + redundant) % ep:
        notes.append(f"{cfg.n_routed_experts}+{redundant} physical experts do not split evenly "
                     f"over ep={ep}: memory counts the fullest device "
                     f"({math.ceil((cfg.n_routed_experts + redundant) / ep)} experts)")
    if dp > 1 and ep > 1:
        notes.append(f"grid mesh dp={dp} x ep={ep} x tp={tp} = {layout.devices} devices: each "
                     f"expert group is replicated over dp ({dp}x)")
    if mode == "decode":
        tokens = seqs * tokens_per_seq
    else:
        tokens = float(prefill_tokens)
    global_tokens = tokens * shards
    if skew:
        imbalance = skew_imbalance(cfg, ep, redundant, skew, tokens * ep)

    params = param_report(cfg, layout, dtype, redundant, include_mtp)
    seqs_mem = math.ceil(seqs)
    state = state_bytes(cfg, seqs_mem, context) if seqs_mem else 0
    D, k, n = cfg.hidden_size, cfg.num_experts_per_tok, cfg.hc_mult
    disp_b = 2.0 if dtype == "bf16" else 1.0 + 4.0 / 128
    workspace = tokens * (k * D * (disp_b + 2.0) * 2 * imbalance + 4 * n * D * 4)
    if mode == "decode":
        workspace += tokens * cfg.vocab_size * 4
    memory = params["per_device_bytes_sum"] + state + workspace
    fits = None if capacity is None else bool(memory <= capacity)
    if fits is False:
        notes.append(f"needs {memory / GB:.1f} GB per device, over the {capacity / GB:.0f} GB "
                     f"capacity")

    comp = step_components(cfg, layout, tokens, context, mode, dtype, redundant, imbalance,
                           prefill_tokens, seqs)
    comms = collectives(cfg, layout, tokens, dtype, imbalance, dedup, mode, context)
    total_flops = sum(c["flops"] for c in comp.values())
    total_bytes = sum(c["bytes"] for c in comp.values())
    t_compute = total_flops / flops
    t_hbm = total_bytes / hbm
    for c in comp.values():
        c["time_s"] = max(c["flops"] / flops, c["bytes"] / hbm)
        c["bound"] = "compute" if c["flops"] / flops >= c["bytes"] / hbm else "memory"
    t_local = sum(c["time_s"] for c in comp.values())
    t_comm = 0.0
    for c in comms:
        skew = c.get("imbalance", 1.0)          # the busiest device receives skew x the mean
        c["time_s"] = c["bytes_per_step"] * skew / link + c["calls"] * latency
        t_comm += c["time_s"]
    step_overlap = max(t_local, t_comm)
    step_serial = t_local + t_comm
    return {
        "config": {"layers": cfg.num_hidden_layers, "hidden": D, "experts": cfg.n_routed_experts,
                   "k": k, "params": params["model_params"]},
        "layout": {"dp": dp, "ep": ep, "tp": tp, "devices": layout.devices,
                   "attn_dp": shards, "redundant": redundant, "dtype": dtype},
        "workload": {"mode": mode, "batch": batch, "context": context,
                     "seqs_per_device": seqs, "tokens_per_device": tokens,
                     "tokens_per_step": global_tokens, "prefill_tokens": prefill_tokens,
                     "tokens_per_seq": tokens_per_seq, "imbalance": imbalance, "skew": skew},
        "rates": {"flops": flops, "hbm": hbm, "link": link, "latency": latency},
        "params": params,
        "memory": {"params_bytes": params["per_device_bytes_sum"], "state_bytes": float(state),
                   "workspace_bytes": workspace, "total_bytes": memory,
                   "capacity_bytes": capacity, "fits": fits,
                   "state_bytes_per_seq": float(state_bytes(cfg, 1, context))},
        "collectives": comms,
        "components": comp,
        "time": {"compute_s": t_compute, "hbm_s": t_hbm, "comm_s": t_comm, "local_s": t_local,
                 "step_overlap_s": step_overlap, "step_serial_s": step_serial,
                 "bound": max([("compute", t_compute), ("hbm", t_hbm), ("comm", t_comm)],
                              key=lambda x: x[1])[0]},
        "throughput": {
            "tokens_per_s_total_overlap": global_tokens / step_overlap,
            "tokens_per_s_total_serial": global_tokens / step_serial,
            "tokens_per_s_device_overlap": global_tokens / step_overlap / layout.devices,
            "tokens_per_s_device_serial": global_tokens / step_serial / layout.devices},
        "notes": notes,
    }


# ------------------------------------------------------------------------------ printing
def _gb(x):
    return f"{x / GB:.2f} GB"


def format_report(r: dict[str, Any]) -> str:
    L, W, M, T = r["layout"], r["workload"], r["memory"], r["time"]
    p = r["params"]
    lines = [f"layout dp={L['dp']} ep={L['ep']} tp={L['tp']}: {L['devices']} devices, attention "
             f"DP {L['attn_dp']}, {p['physical_experts']} physical experts "
             f"({p['experts_per_device']}/device), weights {L['dtype']}",
             f"workload {W['mode']}: batch {W['batch']}, context {W['context']}, "
             f"{W['tokens_per_device']:.1f} tokens/device/step, {W['tokens_per_step']:.0f} total",
             "", "memory per device"]
    for c in CATEGORIES:
        if p["total_params"][c]:
            lines.append(f"  {c:<16} {p['per_device_params'][c] / 1e9:>9.3f} B elems  "
                         f"{_gb(p['per_device_bytes'][c]):>11}  (x{p['copies'][c]:.2f} copies)")
    lines += [f"  {'params':<16} {'':>16}  {_gb(M['params_bytes']):>11}",
              f"  {'decode state':<16} {W['seqs_per_device']:>9.2f} seqs    "
              f"{_gb(M['state_bytes']):>11}  ({M['state_bytes_per_seq'] / 1e6:.1f} MB/seq)",
              f"  {'workspace (est)':<16} {'':>16}  {_gb(M['workspace_bytes']):>11}",
              f"  {'total':<16} {'':>16}  {_gb(M['total_bytes']):>11}", "",
              "collectives per step (bytes sent per device)"]
    for c in r["collectives"]:
        lines.append(f"  {c['name']:<26} {c['kind']:<15} {c['calls']:>3} x "
                     f"{c['bytes_per_call'] / 1e6:>9.3f} MB = {c['bytes_per_step'] / 1e6:>9.2f} MB"
                     f"  {c['time_s'] * 1e3:>8.3f} ms")
    lines += ["", "step time per component (roofline max(flops/F, bytes/B))"]
    for name, c in r["components"].items():
        lines.append(f"  {name:<12} {c['flops'] / 1e12:>9.3f} TFLOP {c['bytes'] / GB:>9.3f} GB "
                     f"{c['time_s'] * 1e3:>9.3f} ms  {c['bound']}")
    th = r["throughput"]
    lines += ["", f"compute {T['compute_s'] * 1e3:.3f} ms, hbm {T['hbm_s'] * 1e3:.3f} ms, "
                  f"comm {T['comm_s'] * 1e3:.3f} ms, local roofline {T['local_s'] * 1e3:.3f} ms",
              f"step: overlap max(local, comm) = {T['step_overlap_s'] * 1e3:.3f} ms, "
              f"serial local + comm = {T['step_serial_s'] * 1e3:.3f} ms",
              f"tokens/s: {th['tokens_per_s_device_overlap']:,.0f} per device, "
              f"{th['tokens_per_s_total_overlap']:,.0f} total (overlap); "
              f"{th['tokens_per_s_device_serial']:,.0f} / "
              f"{th['tokens_per_s_total_serial']:,.0f} (serial)"]
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def _dense_bytes(r):
    return r["memory"]["params_bytes"] - r["params"]["per_device_bytes"]["routed_experts"]


def _coll_bytes(r, kind: str):
    return sum(c["bytes_per_step"] for c in r["collectives"] if kind in c["kind"])


COMPARE_ROWS = (
    ("devices", lambda r: f"{r['layout']['devices']}"),
    ("attention DP", lambda r: f"{r['layout']['attn_dp']}"),
    ("experts/device", lambda r: f"{r['params']['experts_per_device']}"),
    ("seqs/device", lambda r: f"{r['workload']['seqs_per_device']:.1f}"),
    ("tokens/device/step", lambda r: f"{r['workload']['tokens_per_device']:.1f}"),
    ("expert imbalance", lambda r: f"{r['workload']['imbalance']:.3f}"),
    ("other params GB", lambda r: f"{_dense_bytes(r) / GB:.2f}"),
    ("routed experts GB",
     lambda r: f"{r['params']['per_device_bytes']['routed_experts'] / GB:.2f}"),
    ("decode state GB", lambda r: f"{r['memory']['state_bytes'] / GB:.2f}"),
    ("total memory GB", lambda r: f"{r['memory']['total_bytes'] / GB:.2f}"),
    ("fits capacity", lambda r: {None: "-", True: "yes", False: "NO"}[r["memory"]["fits"]]),
    ("a2a MB/step", lambda r: f"{_coll_bytes(r, 'all_to_all') / 1e6:.1f}"),
    ("tp coll MB/step", lambda r: f"{_coll_bytes(r, '(tp)') / 1e6:.1f}"),
    ("compute ms", lambda r: f"{r['time']['compute_s'] * 1e3:.2f}"),
    ("hbm ms", lambda r: f"{r['time']['hbm_s'] * 1e3:.2f}"),
    ("comm ms", lambda r: f"{r['time']['comm_s'] * 1e3:.2f}"),
    ("local roofline ms", lambda r: f"{r['time']['local_s'] * 1e3:.2f}"),
    ("step ms overlap", lambda r: f"{r['time']['step_overlap_s'] * 1e3:.2f}"),
    ("step ms serial", lambda r: f"{r['time']['step_serial_s'] * 1e3:.2f}"),
    ("tok/s/device ovl", lambda r: f"{r['throughput']['tokens_per_s_device_overlap']:,.0f}"),
    ("tok/s total ovl", lambda r: f"{r['throughput']['tokens_per_s_total_overlap']:,.0f}"),
    ("tok/s/device serial", lambda r: f"{r['throughput']['tokens_per_s_device_serial']:,.0f}"),
)


def format_compare(names: list[str], reports: list[dict[str, Any]]) -> str:
    width = max(14, *(len(n) + 2 for n in names))
    lines = [f"{'':<20}" + "".join(f"{n:>{width}}" for n in names)]
    for label, fn in COMPARE_ROWS:
        lines.append(f"{label:<20}" + "".join(f"{fn(r):>{width}}" for r in reports))
    for name, r in zip(names, reports):
        lines += [f"note [{name}]: {n}" for n in r["notes"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def _hint(layout: Layout, mesh: str) -> None:
    if mesh == "grid" and layout.dp == layout.ep > 1:
        print(f"hint: dp={layout.dp},ep={layout.ep} is a grid of {layout.devices} devices with "
              f"experts replicated {layout.dp}x; DeepInfer's EP{layout.ep}/DP{layout.ep} "
              f"({layout.ep} GPUs) is dp=1,ep={layout.ep}, or dp={layout.ep},ep={layout.ep} "
              f"with --mesh shared", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardings.experiment", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v4-flash", choices=ModelConfig.presets())
    ap.add_argument("--mesh", default="grid", choices=("grid", "shared"),
                    help="grid: dp*ep*tp devices (shardings.mesh); shared: --dp is the attention "
                         "DP degree over the same devices as ep (grid dp = dp/ep)")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4096, help="sequences in flight, all devices")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--mode", default="decode", choices=("decode", "prefill"))
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="per device per step")
    ap.add_argument("--tokens-per-seq", type=int, default=1,
                    help="decode tokens per sequence per step (1 + draft length when verifying)")
    ap.add_argument("--flops", type=float, default=8e14, help="FLOP/s per device")
    ap.add_argument("--hbm", type=float, default=4.2e12, help="HBM bytes/s per device")
    ap.add_argument("--link", type=float, default=4.5e11, help="collective bytes/s per device")
    ap.add_argument("--capacity", type=float, default=141e9,
                    help="device memory in bytes (default: H200, 141 GB; 0 = no check)")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds per collective call")
    ap.add_argument("--redundant", type=int, default=0, help="redundant expert replicas")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES,
                    help="weights: bf16; fp8 (FP8 dense and experts); fp4 (official: FP8 dense, "
                         "FP4 experts). fp8/fp4 also dispatch activations in fp8")
    ap.add_argument("--imbalance", type=float, default=1.0,
                    help="max/mean expert load per device (see shardings.balancer)")
    ap.add_argument("--skew", help="derive --imbalance from a synthetic routing workload with "
                                   "the balancer: zipf[:s], hot[:n[:boost]], uniform")
    ap.add_argument("--dedup", action="store_true",
                    help="dispatch each token once per destination device (DeepEP)")
    ap.add_argument("--no-mtp", action="store_true", help="leave the MTP block out of memory")
    ap.add_argument("--compare", help='layouts side by side, e.g. "dp=1,ep=64;dp=1,ep=8;tp=2,ep=4"'
                                      " (per layout also redundant=, batch=, prefill_tokens=)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a = ap.parse_args(argv)
    cfg = ModelConfig.preset(a.preset)
    base = dict(batch=a.batch, context=a.context, mode=a.mode, flops=a.flops, hbm=a.hbm,
                link=a.link, redundant=a.redundant, dtype=a.dtype,
                prefill_tokens=a.prefill_tokens, tokens_per_seq=a.tokens_per_seq,
                imbalance=a.imbalance, skew=a.skew, dedup=a.dedup, latency=a.latency,
                include_mtp=not a.no_mtp, capacity=a.capacity or None)
    if a.compare:
        names, reports = [], []
        for text in a.compare.split(";"):
            if not text.strip():
                continue
            layout, extra = parse_layout(text, a.mesh)
            _hint(layout, a.mesh)
            reports.append(layout_report(cfg, layout.dp, layout.ep, layout.tp, **{**base, **extra}))
            names.append(text.strip())
        if a.json:
            print(json.dumps(dict(zip(names, reports)), indent=1))
        else:
            print(f"{a.preset} {a.mode}, batch {a.batch}, context {a.context}, weights {a.dtype}, "
                  f"F={a.flops:.3g} FLOP/s, HBM={a.hbm:.3g} B/s, link={a.link:.3g} B/s")
            print(format_compare(names, reports))
        return 0
    layout, _ = parse_layout(f"dp={a.dp},ep={a.ep},tp={a.tp}", a.mesh)
    _hint(layout, a.mesh)
    r = layout_report(cfg, layout.dp, layout.ep, layout.tp, **base)
    print(json.dumps(r, indent=1) if a.json else format_report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
