"""The DSpark drafter for V4-shaped targets (docs/MODEL.md §D1; docs/MODEL.md §V5).

One drafting cycle, for a row whose target state holds positions 0..P-1 and whose anchor y_P
(the last committed token) has not been processed yet:

* Context (§1.2, §1.3). For every committed position t the target exposes the hc-averaged
  residual of `target_layer_ids` (`transformer.forward_chunk(..., taps=...)`, "pre" = layer
  input as docs/MODEL.md §V5.2, "post" = layer output); `main_x_t = main_norm(main_proj(f_t))` and
  each stage writes `kv_projection(main_x_t)` (its own wkv / kv_norm, window RoPE at t) into
  its own ring of the last W positions ("KV injection"). The draft state is therefore one
  `DecodeState` with one SWA-shaped layer per stage, advanced by `push` with committed
  positions only (spec §2.7: no rollback needed).
* Block (§1.3). Ids `[y_P, NOISE x (γ-1)]` at positions P..P+γ-1, target embedding broadcast
  to the hc streams, `num_stages` V4 blocks (mHC + window-only attention without compressor
  or indexer + score-routed MoE, `transformer.sublayer` / `moe_layer` / the attention
  projection helpers of the target, single-sourced). Every block query sees the context
  entries at positions P-W..P-1 and all γ block entries (bidirectional); block keys are
  temporary. Then `hc_head` collapse (V4-0731 style; V4.1's lagged collapse is not modelled)
  -> h_k (pre-norm), final norm, the target's frozen head -> base logits U_k (fp32).
* Markov head (§1.4): z_k = U_k + markov_head · markov_embed[x_{k-1}], x_0 = y_P; x_k is the
  argmax (greedy rows) or a Gumbel-max draw from the request's processed logits with the
  DRAFT key (seed, request-local step, slot k-1) (`mtp.draw`, shared with the MTP drafter).
* Confidence head (§1.5, docs/MODEL.md §V5.4): c_k = proj · [h_k ; markov_embed[x_{k-1}]] + bias
  on the pre-norm hidden; returned as logits (STS temperatures are applied by the scheduler).

`DRAFTER` puts the drafter behind the `speculative.drafter.Drafter` interface (its state: the
context rings; prefill and commit push committed positions' taps, drafting reads them).

`stage_stack` is the one implementation of the backbone; the training script
(scripts/train_dspark.py) runs it over many anchors at once with a different mask.
Weights are saved as safetensors (internal [in, out] layout, names = pytree paths) plus a JSON
config that records the target it was trained for (`save_dspark` / `load_dspark`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn import kernels
from deepinfer_fn.config import SCORE_MOE, SWA, ModelConfig
from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.model.attention import NEG_INF, kv_projection, output_projection, query_and_kv
from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.mhc import head_collapse
from deepinfer_fn.model.moe import moe_layer
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies
from deepinfer_fn.model.transformer import sublayer
from deepinfer_fn.params import (BF16, F32, Spec, linear_spec, mhc_specs, norm_spec, init_tree, is_spec,
                                 layer_specs, leaf_dtype, normal)
from deepinfer_fn.sampling import SamplingParams
from deepinfer_fn.speculative.drafter import Draft, Drafter
from deepinfer_fn.speculative.mtp import draw
from deepinfer_fn.state import DecodeState, layer_state_shapes

CONFIG_FILE = "dspark_config.json"
WEIGHTS_FILE = "dspark.safetensors"
TAPS = ("pre", "post")


class DSparkError(ValueError):
    """A drafter is inconsistent, missing, or does not fit the target model."""


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """Hyper-parameters of a DSpark drafter (spec §1.7 key names in comments) and the
    fingerprint of the target it belongs to (checked against the target at use)."""

    target_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    target_hc_mult: int
    block_size: int = 5                         # dspark_block_size (γ)
    markov_rank: int = 64                       # dspark_markov_rank (r)
    target_layer_ids: tuple[int, ...] = (1, 2, 3)   # dspark_target_layer_ids
    tap: str = "post"                           # "pre" (docs/MODEL.md §V5.2) or "post" (§1.2)
    noise_token_id: int = 2                     # dspark_noise_token_id
    num_stages: int = 1                         # num_nextn_predict_layers
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    window: int = 128                           # context positions each block sees (W)

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("target_vocab_size", "target_hidden_size", "target_num_layers",
                     "target_hc_mult", "block_size", "markov_rank", "num_stages",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DSparkError(f"DSparkConfig.{name} must be a positive int, got {v!r}")
        if self.tap not in TAPS:
            raise DSparkError(f"DSparkConfig.tap must be one of {TAPS}, got {self.tap!r}")
        if not self.target_layer_ids or any(not 0 <= i < self.target_num_layers
                                            for i in self.target_layer_ids):
            raise DSparkError(f"target_layer_ids {self.target_layer_ids} must be non-empty ids "
                              f"of the target's {self.target_num_layers} layers")
        if not 0 <= self.noise_token_id < self.target_vocab_size:
            raise DSparkError(f"noise_token_id {self.noise_token_id} outside the vocabulary")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise DSparkError(f"num_experts_per_tok {self.num_experts_per_tok} > "
                              f"n_routed_experts {self.n_routed_experts}")

    @classmethod
    def for_target(cls, cfg: ModelConfig, **kwargs) -> "DSparkConfig":
        kwargs.setdefault("window", cfg.sliding_window)
        return cls(target_vocab_size=cfg.vocab_size, target_hidden_size=cfg.hidden_size,
                   target_num_layers=cfg.num_hidden_layers, target_hc_mult=cfg.hc_mult, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSparkConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise DSparkError(f"unknown DSpark config keys {unknown}")
        try:
            return cls(**d)
        except TypeError as e:
            raise DSparkError(f"bad DSpark config: {e}") from e


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSpark:
    """A drafter: weights (pytree), STS confidence temperatures f32 [γ] (1 = uncalibrated,
    spec §1.5) and the config (static)."""

    weights: dict[str, Any]
    sts_temperatures: jax.Array
    config: DSparkConfig = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, key):
        return self.weights[key]


def stage_config(cfg: ModelConfig, dcfg: DSparkConfig) -> ModelConfig:
    """The target config with the draft stages' MoE size (stages never hash-route)."""
    return cfg.replace(n_routed_experts=dcfg.n_routed_experts,
                       num_experts_per_tok=dcfg.num_experts_per_tok,
                       moe_intermediate_size=dcfg.moe_intermediate_size)


def check_target(dcfg: DSparkConfig, cfg: ModelConfig) -> None:
    """Raises DSparkError when the drafter was built for another target."""
    want = dict(vocab_size=dcfg.target_vocab_size, hidden_size=dcfg.target_hidden_size,
                num_hidden_layers=dcfg.target_num_layers, hc_mult=dcfg.target_hc_mult)
    bad = {k: (v, getattr(cfg, k)) for k, v in want.items() if getattr(cfg, k) != v}
    if bad:
        raise DSparkError("the DSpark drafter was built for another target model: " + ", ".join(
            f"{k} drafter {a} vs model {b}" for k, (a, b) in bad.items()))


def dspark_specs(cfg: ModelConfig, dcfg: DSparkConfig) -> dict[str, Any]:
    """Weights of the drafter (spec §1.3-§1.5). Embedding and LM head are the target's."""
    check_target(dcfg, cfg)
    scfg = stage_config(cfg, dcfg)
    D, V, r, m = cfg.hidden_size, cfg.vocab_size, dcfg.markov_rank, len(dcfg.target_layer_ids)
    return {
        "main_proj": linear_spec(m * D, D, "main_proj.weight", BF16, ("tap_embed", "embed")),
        "main_norm": norm_spec(D, "main_norm.weight"),
        "stages": tuple(layer_specs(scfg, SWA, SCORE_MOE) for _ in range(dcfg.num_stages)),
        "hc_head": mhc_specs(scfg, "hc_head", cfg.hc_mult),
        "norm": norm_spec(D, "norm.weight"),
        "markov_embed": Spec((V, r), ("vocab", "markov"), normal(1.0), "markov_head.embed", BF16),
        "markov_head": Spec((V, r), ("vocab", "markov"), normal(0.01), "markov_head.head", BF16),
        "confidence": Spec((D + r,), ("confidence_in",), normal(0.01), "confidence_head.proj",
                           BF16),
        "confidence_bias": Spec((1,), (None,), normal(0.0), "confidence_head.bias", F32,
                                keep_fp32=True),
    }


def init_dspark(cfg: ModelConfig, dcfg: DSparkConfig, key: jax.Array,
                dtype=jnp.float32) -> DSpark:
    """Random drafter weights (gate biases 0 so routing starts balanced)."""
    w = init_tree(dspark_specs(cfg, dcfg), key, dtype)
    w["stages"] = tuple({**s, "ffn": {**s["ffn"], "gate_bias": jnp.zeros_like(s["ffn"]["gate_bias"])}}
                        for s in w["stages"])
    return DSpark(w, jnp.ones((dcfg.block_size,), jnp.float32), dcfg)


# ------------------------------------------------------------------------------- state
def init_draft_state(cfg: ModelConfig, dcfg: DSparkConfig, batch: int, max_len: int,
                     dtype=jnp.float32) -> DecodeState:
    """Per stage a context ring of the last W committed positions (window_kv [B,W,d],
    window_pos [B,W], -1 = empty); lengths = positions pushed so far."""
    shapes = layer_state_shapes(cfg, SWA, batch, max_len, dcfg.window, dtype)
    layer = {k: (jnp.full(s.shape, -1, s.dtype) if k == "window_pos" else jnp.zeros(s.shape, s.dtype))
             for k, s in shapes.items()}
    return DecodeState((layer,) * dcfg.num_stages, jnp.zeros((batch,), jnp.int32), max_len,
                       dcfg.window)


def main_features(drafter: DSpark, features, eps: float):
    """f [..., m, D] (hc-averaged target taps) -> main_x [..., D] (spec §1.2)."""
    flat = features.reshape(*features.shape[:-2], -1)
    return rms_norm(linear(flat, drafter["main_proj"]), drafter["main_norm"], eps)


def context_kv(drafter: DSpark, cfg: ModelConfig, main_x, positions):
    """Each stage's injected key=value of main_x [B,S,D] at positions [B,S]: tuple of [B,S,d]."""
    cos, sin = rope_cos_sin(positions, rope_frequencies(cfg, SWA), main_x.dtype)
    return tuple(kv_projection(sp["attn"], main_x, cos, sin, cfg) for sp in drafter["stages"])


def push(drafter: DSpark, cfg: ModelConfig, dstate: DecodeState, features, n_new) -> DecodeState:
    """Pushes committed positions lengths .. lengths + n_new - 1 into every stage's ring.

    features [B,S,m,D]: the target taps of those positions (entries past n_new[b] ignored)."""
    B, S = features.shape[:2]
    positions = dstate.lengths[:, None] + jnp.arange(S, dtype=jnp.int32)
    kvs = context_kv(drafter, cfg, main_features(drafter, features, cfg.rms_norm_eps), positions)
    end = dstate.lengths + n_new
    slots = dstate.window_slots
    write = (jnp.arange(S)[None] < n_new[:, None]) & (positions >= (end - slots)[:, None])
    slot = jnp.where(write, positions % slots, slots)
    put = jax.vmap(lambda r, i, v: r.at[i].set(v, mode="drop"))
    layers = tuple({"window_kv": put(ls["window_kv"], slot, kv.astype(ls["window_kv"].dtype)),
                    "window_pos": put(ls["window_pos"], slot, positions)}
                   for ls, kv in zip(dstate.layers, kvs))
    return dataclasses.replace(dstate, layers=layers, lengths=end)


# ------------------------------------------------------------------------------- backbone
def stage_stack(drafter: DSpark, cfg: ModelConfig, embed, block_ids, positions, ctx_kv,
                ctx_bias, block_bias):
    """The draft stages over Q query rows: returns the pre-norm collapsed hidden h [B,Q,D].

    block_ids/positions [B,Q]; ctx_kv: per stage [B,C,d] injected context keys; ctx_bias
    [B,Q,C] and block_bias [B,Q,Q] additive masks (0 / -inf) of context and block keys.
    """
    scfg = stage_config(cfg, drafter.config)
    e = embed[block_ids]
    streams = jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], cfg.hc_mult, e.shape[-1]))
    cos, sin = rope_cos_sin(positions, rope_frequencies(cfg, SWA), streams.dtype)
    bias = jnp.concatenate([ctx_bias, block_bias], axis=-1).astype(jnp.float32)

    for sp, kv_ctx in zip(drafter["stages"], ctx_kv):
        def attend(h, sp=sp, kv_ctx=kv_ctx):
            q, _, kv_blk = query_and_kv(sp["attn"], h, cos, sin, scfg)
            keys = jnp.concatenate([kv_ctx.astype(kv_blk.dtype), kv_blk], axis=1)
            o = kernels.attention(q, keys, bias, sp["attn"]["sinks"])
            return output_projection(sp["attn"], o, cos, sin, scfg), None

        streams, _ = sublayer(sp["hc_attn"], sp["attn_norm"], streams, attend, scfg)
        streams, _ = sublayer(sp["hc_ffn"], sp["ffn_norm"], streams,
                              lambda h, sp=sp: (moe_layer(sp["ffn"], h, block_ids, SCORE_MOE, scfg),
                                                None), scfg)
    hc = drafter["hc_head"]
    return head_collapse(streams, hc["fn"], hc["base"], hc["scale"], hc_eps=cfg.hc_eps,
                         norm_eps=cfg.rms_norm_eps)


def base_logits(drafter: DSpark, head, h, eps: float):
    """U = target_head(norm(h)): h [..., D] -> float32 [..., V] (spec §1.4)."""
    x = rms_norm(h, drafter["norm"], eps).astype(head.dtype)
    return jnp.matmul(x, head, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST if head.dtype == jnp.float32 else None)


def markov(drafter: DSpark, prev):
    """Markov head for previous tokens prev [...]: (transition bias f32 [..., V], the
    embedding markov_embed[prev] [..., r])."""
    e = drafter["markov_embed"][prev]
    bias = jnp.einsum("...r,vr->...v", e.astype(jnp.float32),
                      drafter["markov_head"].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return bias, e


def confidence_logits(drafter: DSpark, h, e):
    """c = proj · [h ; e] + bias (fp32 logits, spec §1.5): h [..., D], e [..., r] -> [...]."""
    x = jnp.concatenate([h.astype(jnp.float32), e.astype(jnp.float32)], axis=-1)
    w = drafter["confidence"].astype(jnp.float32)
    return jnp.einsum("...i,i->...", x, w, precision=jax.lax.Precision.HIGHEST) + \
        drafter["confidence_bias"][0]


def anchored_blocks(drafter: DSpark, params, features, seqs, anchors):
    """The drafter without a cache, over many anchors at once (training; test oracle).

    features [B,T,m,D]: target taps of positions 0..T-1; seqs [B,T] their tokens; anchors
    [B,A] anchor positions P (< T). Block a of row b sees context positions P-W..P-1 (their
    KV injected from `features`) and its own γ slots. Returns (h [B,A,γ,D] pre-norm hidden,
    base logits U f32 [B,A,γ,V])."""
    cfg = params.config
    dcfg = drafter.config
    g, W = dcfg.block_size, dcfg.window
    B, T = seqs.shape
    A = anchors.shape[1]
    main_x = main_features(drafter, features, cfg.rms_norm_eps)
    ctx_kv = context_kv(drafter, cfg, main_x,
                        jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    slot = jnp.arange(g, dtype=jnp.int32)
    qpos = (anchors[:, :, None] + slot).reshape(B, A * g)
    first = jnp.take_along_axis(seqs, anchors, axis=1)
    ids = jnp.where(slot[None, None] == 0, first[:, :, None],
                    dcfg.noise_token_id).reshape(B, A * g)
    P = jnp.repeat(anchors, g, axis=1)[:, :, None]                               # [B,Q,1]
    s = jnp.arange(T)[None, None]
    ctx_bias = jnp.where((s < P) & (s >= P - W), 0.0, NEG_INF)
    blk = jnp.repeat(jnp.arange(A), g)
    block_bias = jnp.broadcast_to(jnp.where(blk[:, None] == blk[None], 0.0, NEG_INF),
                                  (B, A * g, A * g))
    h = stage_stack(drafter, cfg, params["embed"], ids, qpos, ctx_kv, ctx_bias, block_bias)
    U = base_logits(drafter, params["head"], h, cfg.rms_norm_eps)
    return h.reshape(B, A, g, -1), U.reshape(B, A, g, -1)


# ------------------------------------------------------------------------------- drafting
def draft(drafter: DSpark, params, dstate: DecodeState, anchor, sampling: SamplingParams, step,
          *, constrain=None):
    """γ draft tokens per row (module docstring).

    params: the target (embedding and head); dstate: holds exactly the committed positions
    0..P-1 (P = dstate.lengths); anchor int32 [B] the token at P; step int32 [B] the
    request-local step counter (draft keys). Returns (drafts int32 [B,γ], q_logits f32
    [B,γ,V] (softmax = the distribution each draft was drawn from), conf_logits f32 [B,γ]).

    constrain = (masks uint32 [B,W], host): grammar masks inside the Markov pass
    (deepinfer_fn/structured.py, "speculative decoding"; docs/MODEL.md §D2.2). Draft k + 1 is
    drawn from the slot's logits under the packed allowed-token mask m_k (m_0 = `masks`, the
    grammar state after the committed tokens), so q_{k+1} is the masked distribution actually
    sampled from; `host(x_{k+1}) -> (m_{k+1} uint32 [B,W], stop bool [B])` advances the
    grammar (an io_callback). The confidence logits do not see the masks. Also returns the
    masks m_0..m_γ uint32 [B,γ+1,W] and stop bool [B,γ] (admit no slot after a stop).
    """
    cfg = params.config
    dcfg = drafter.config
    g = dcfg.block_size
    B = anchor.shape[0]
    anchor = jnp.clip(anchor, 0, cfg.vocab_size - 1).astype(jnp.int32)
    P = dstate.lengths
    positions = P[:, None] + jnp.arange(g, dtype=jnp.int32)
    ids = jnp.concatenate([anchor[:, None], jnp.full((B, g - 1), dcfg.noise_token_id, jnp.int32)], 1)
    ctx_bias = context_bias(dstate.layers[0]["window_pos"], P, dcfg.window, g)
    h = stage_stack(drafter, cfg, params["embed"], ids, positions,
                    tuple(ls["window_kv"] for ls in dstate.layers), ctx_bias,
                    jnp.zeros((B, g, g), jnp.float32))
    U = base_logits(drafter, params["head"], h, cfg.rms_norm_eps)       # [B,γ,V]
    return markov_pass(drafter, h, U, anchor, sampling, step, confidence_logits,
                       constrain=constrain)


def context_bias(ring_pos, P, window: int, g: int):
    """f32 [B,g,C] additive mask (0 / -inf) of the injected context keys: ring entries
    ring_pos [B,C] holding committed positions in [P - window, P) for P [B]."""
    ok = (ring_pos >= 0) & (ring_pos < P[:, None]) & (ring_pos >= (P - window)[:, None])
    return jnp.broadcast_to(jnp.where(ok, 0.0, NEG_INF)[:, None, :], (P.shape[0], g, ring_pos.shape[1]))


def markov_pass(drafter, h, U, anchor, sampling: SamplingParams, step, confidence, *,
                constrain=None):
    """The sequential Markov pass of a DSpark draft (V4 and V4.1): draft k + 1 is drawn from
    U[:, k] + the Markov bias of draft k (draft 0: the anchor), one [r] x [r,V] per slot.

    h [B,γ,D] the stages' hidden, U [B,γ,V] their base logits; confidence(drafter, h_k, e_k)
    the drafter's confidence head. Returns (drafts int32 [B,γ], q_logits f32 [B,γ,V],
    conf_logits f32 [B,γ]) (+ (masks [B,γ+1,W], stop [B,γ]) under `constrain`, as `draft`)."""
    from deepinfer_fn.structured import unpack_bitmask
    prev = anchor
    drafts, qs, confs = [], [], []
    m = None if constrain is None else constrain[0]
    masks, stops = [m], []
    for k in range(U.shape[1]):
        bias, e = markov(drafter, prev)
        confs.append(confidence(drafter, h[:, k], e))
        logits = U[:, k] + bias
        if constrain is not None:
            logits = jnp.where(unpack_bitmask(m, logits.shape[-1]), logits, -jnp.inf)
        x, q = draw(logits, sampling, step, k)
        drafts.append(x)
        qs.append(q)
        prev = x
        if constrain is not None:
            m, stop = constrain[1](x)
            masks.append(m)
            stops.append(stop)
    out = jnp.stack(drafts, 1), jnp.stack(qs, 1), jnp.stack(confs, 1)
    if constrain is None:
        return out
    return out + (jnp.stack(masks, 1), jnp.stack(stops, 1))


# ------------------------------------------------------------------------------- save / load
def _named_specs(specs) -> dict[str, Spec]:
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): s
            for path, s in flat}


def save_dspark(drafter: DSpark, path: str, *, dtype=jnp.bfloat16, extra: dict | None = None) -> None:
    """Writes `dspark.safetensors` (weights in `dtype`, fp32-kept ones in fp32) and
    `dspark_config.json` (config, STS temperatures, `extra` metadata) into directory `path`."""
    import ml_dtypes
    from deepinfer_fn.checkpoint.safetensors_io import save_file
    os.makedirs(path, exist_ok=True)
    flat = jax.tree_util.tree_flatten_with_path(drafter.weights)[0]
    tensors = {}
    for keypath, value in flat:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)
        arr = np.asarray(jnp.asarray(value, jnp.float32))
        keep32 = value.dtype == jnp.float32 and name.rsplit(".", 1)[-1] in _FP32_LEAVES
        tensors[name] = arr if keep32 else arr.astype(
            ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "deepinfer_fn.dspark"})
    meta = dict(config=drafter.config.to_dict(),
                sts_temperatures=[float(t) for t in np.asarray(drafter.sts_temperatures)],
                **(extra or {}))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(meta, f, indent=1)


_FP32_LEAVES = {"fn", "base", "scale", "sinks", "gate_bias", "confidence_bias"}


def load_dspark(path: str, cfg, dtype=jnp.float32) -> DSpark:
    """Reads a drafter saved by `save_dspark` for the target `cfg` (a ModelConfig or the
    target's Params), checking that it belongs to that target. Raises DSparkError /
    CheckpointError naming the problem."""
    from deepinfer_fn.checkpoint.safetensors_io import SafetensorsFile
    cfg = getattr(cfg, "config", cfg)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"load_dspark needs the target's ModelConfig or Params, got {type(cfg).__name__}")
    cfg_file, w_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    missing = [os.path.basename(f) for f in (cfg_file, w_file) if not os.path.isfile(f)]
    if missing:
        raise DSparkError(f"DSpark drafter directory {path!r} lacks {missing} "
                          f"(train one with scripts/train_dspark.py)")
    with open(cfg_file) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise DSparkError(f"{cfg_file}: corrupt JSON ({e})") from e
    if not isinstance(meta, dict) or "config" not in meta:
        raise DSparkError(f"{cfg_file}: no 'config' entry")
    dcfg = DSparkConfig.from_dict(meta["config"])
    temps = np.asarray(meta.get("sts_temperatures", [1.0] * dcfg.block_size), np.float32)
    if temps.shape != (dcfg.block_size,) or not np.all(temps > 0):
        raise DSparkError(f"{cfg_file}: sts_temperatures {temps.tolist()} must be "
                          f"{dcfg.block_size} positive numbers")
    specs = _named_specs(dspark_specs(cfg, dcfg))
    st = SafetensorsFile(w_file)
    absent = sorted(set(specs) - set(st.keys()))
    extra = sorted(set(st.keys()) - set(specs))
    if absent or extra:
        raise DSparkError(f"{w_file}: tensors do not match the config: missing {absent[:5]}, "
                          f"unexpected {extra[:5]}")
    values = {}
    for name, spec in specs.items():
        if st.shape(name) != spec.shape:
            raise DSparkError(f"{w_file}: tensor {name!r} has shape {st.shape(name)}, "
                              f"expected {spec.shape}")
        values[name] = jnp.asarray(np.asarray(st.get(name), np.float32), leaf_dtype(spec, dtype))
    treedef = jax.tree.structure(dspark_specs(cfg, dcfg), is_leaf=is_spec)
    order = list(_named_specs(dspark_specs(cfg, dcfg)))
    weights = jax.tree.unflatten(treedef, [values[n] for n in order])
    return DSpark(weights, jnp.asarray(temps), dcfg)


def default_dspark_path() -> str:
    """The embedded default model's drafter: `assets/default_model/dspark/`."""
    from deepinfer_fn.default_model import default_model_path
    return os.path.join(default_model_path(), "dspark")


def load_default_dspark(cfg: ModelConfig, dtype=jnp.float32) -> DSpark:
    return load_dspark(default_dspark_path(), cfg, dtype)


# ------------------------------------------------------------------------------- the Drafter
def _resolve(params, weights, num_draft_tokens):
    if not isinstance(weights, DSpark):
        raise ArgumentError("speculative='dspark' needs drafter=<a loaded DSpark drafter>, e.g. "
                            "deepinfer_fn.speculative.load_dspark(path, params) (got "
                            f"{type(weights).__name__})")
    check_target(weights.config, params.config)
    gamma = weights.config.block_size
    if num_draft_tokens is not None and num_draft_tokens != gamma:
        raise ArgumentError(f"num_draft_tokens={num_draft_tokens!r} but this DSpark drafter has "
                            f"block size {gamma}: the draft width is a checkpoint constant "
                            f"(docs/MODEL.md §D1.1); leave num_draft_tokens unset (verify_len "
                            f"picks how many to verify)")
    return weights, gamma


def _taps(weights: DSpark) -> dict:
    return dict(taps=weights.config.target_layer_ids, tap=weights.config.tap)


def _init_state(params, weights: DSpark, batch: int, max_len: int, *, window_slots: int, k: int,
                dtype) -> DecodeState:
    return init_draft_state(params.config, weights.config, batch, max_len, dtype=dtype)


def _prefill(params, weights: DSpark, dstate, lengths, feats, ids, n_new, next_ids, n_next):
    """The chunk's tapped features join the context rings (every prefill chunk, §1.2)."""
    return push(weights, params.config, dataclasses.replace(dstate, lengths=lengths), feats.taps,
                n_new)


def _draft(params, weights: DSpark, dstate, anchor, lengths, sampling, step, active, k: int,
           constrain=None):
    out = draft(weights, params, dataclasses.replace(dstate, lengths=lengths), anchor, sampling,
                step, constrain=constrain)
    return Draft(out[0], out[1], out[2], dstate, *out[3:])


def _commit(params, weights: DSpark, dstate, feats, tokens, n_emit, lengths, active):
    """The committed positions' features (anchor + accepted drafts) join the context, so it
    only ever holds committed positions (§2.7: no rollback)."""
    return push(weights, params.config, dataclasses.replace(dstate, lengths=lengths), feats.taps,
                n_emit)


def _sts_temperatures(weights: DSpark):
    return weights.sts_temperatures.astype(jnp.float32)


# DSpark as a `Drafter`: `weights` is the `DSpark` (config + weights + STS temperatures).
DRAFTER = Drafter(name="dspark", resolve=_resolve, taps=_taps, init_state=_init_state,
                  prefill=_prefill, draft=_draft, commit=_commit, confidence=True,
                  sts_temperatures=_sts_temperatures)
