"""The DSpark drafter of a DeepSeek-V4.1 checkpoint (docs/MODEL.md §V5; the V4 drafter it
differs from is `speculative.dspark`).

The weights are the checkpoint's stages `mtp.0..S-1` (`params.v41_dspark_specs`; `init_params`
puts them in `params["mtp"]`): `main_proj` / `main_norm` (mtp.0), S code-0 V4.1 blocks, and
`norm`, `markov_embed` / `markov_head`, `confidence` (mtp.S-1). Everything else is fixed by the
target config: block size γ = dspark_block_size, noise id, tapped layers
dspark_target_layer_ids, context window W = sliding_window.

One drafting cycle, for a row whose target state holds positions 0..P-1 and whose anchor y_P
is committed but not processed:

* Context (§V5.2). For every committed position t the target exposes f_t, the hc-averaged
  input residual (after Engram) of the tapped layers (`transformer.forward_chunk(...,
  taps=ids, tap="pre")`); m_t = main_norm(main_proj(f_t)) and each stage writes
  kv_projection(m_t) (its own wkv / kv_norm, main RoPE at t) into its own ring of the last W
  positions (`dspark.push`, shared with V4: only committed positions, no rollback).
* Block. Ids [y_P, noise x (γ-1)] at positions P..P+γ-1, the target embedding broadcast to
  the n streams; S stages, each a lagged-mHC V4.1 block (`model.lagged_mhc`, the chain starts
  from stream 0) with window-only attention (no q head norm, own sink; every row sees the
  context entries P-W..P-1 and all γ block rows) and the score-routed stage MoE
  (`params.dspark_stage_config`, `gate_bias_vl` ignored); collapse with the last FFN pre
  (no hc_head) -> h_k, `norm`, the target head -> base logits U_k (fp32).
* Markov head (§V5.3): z_k = U_k + markov_head · markov_embed[x_{k-1}], x_0 = y_P; x_k is the
  argmax or a Gumbel-max draw with the DRAFT key (`mtp.draw`, as V4).
* Confidence head (§V5.4): c_k = proj · [h_k ; markov_embed[x_{k-1}]] (no bias), returned as
  logits; sigmoid(c_k / τ_k) with the STS temperatures τ is applied by the scheduler.

`DRAFTER` puts it behind the `speculative.drafter.Drafter` interface; `speculative.dspark_select`
serves speculative="dspark" with it for V4.1 targets.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.config import SCORE_MOE, SWA, ModelConfig
from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.model.attention import kv_projection, output_projection
from deepinfer_fn.model.attention_v41 import query
from deepinfer_fn.model.lagged_mhc import final_collapse, initial_pending, lagged_sublayer
from deepinfer_fn.model.moe import moe_layer
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies
from deepinfer_fn.params import Params, dspark_stage_config, init_tree, v41_dspark_specs
from deepinfer_fn.sampling import SamplingParams
from deepinfer_fn.speculative.drafter import Draft, Drafter
from deepinfer_fn.speculative.dspark import (DSparkError, base_logits, context_bias,
                                             markov_pass, push)
from deepinfer_fn.state import DecodeState

TAP = "pre"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSparkV41:
    """A V4.1 drafter: the `v41_dspark_specs` weights (pytree), STS confidence temperatures
    f32 [γ] (1 = uncalibrated) and the tapped target layers (static, the config's
    dspark_target_layer_ids)."""

    weights: dict
    sts_temperatures: jax.Array
    target_layer_ids: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, key):
        return self.weights[key]


def check_config(cfg: ModelConfig) -> None:
    """DSparkError unless cfg is a V4.1 config with DSpark stages."""
    if not cfg.is_v41:
        raise DSparkError(f"the V4.1 DSpark drafter needs a DeepSeek-V4.1 target, got "
                          f"model_type {cfg.model_type!r}")
    if not cfg.dspark_block_size or cfg.num_mtp_layers < 1:
        raise DSparkError("this V4.1 config has no DSpark stages (dspark_block_size = 0 or "
                          "num_nextn_predict_layers = 0)")


def _check_weights(cfg: ModelConfig, weights) -> None:
    want = jax.tree.structure(v41_dspark_specs(cfg), is_leaf=lambda x: hasattr(x, "shape"))
    got = jax.tree.structure(weights)
    if got != want:
        raise DSparkError(f"V4.1 DSpark weights do not have the tree of v41_dspark_specs: "
                          f"{got} vs {want}")
    specs = jax.tree.leaves(v41_dspark_specs(cfg), is_leaf=lambda x: hasattr(x, "shape"))
    for s, w in zip(specs, jax.tree.leaves(weights)):
        if tuple(w.shape) != tuple(s.shape):
            raise DSparkError(f"V4.1 DSpark weight {s.name!r} has shape {tuple(w.shape)}, "
                              f"expected {tuple(s.shape)}")


def from_params(params: Params, sts_temperatures=None) -> DSparkV41:
    """The drafter stored in a V4.1 model's params["mtp"] (a checkpoint's mtp.* tensors)."""
    cfg = params.config
    check_config(cfg)
    w = params["mtp"]
    if not w:
        raise DSparkError("these V4.1 params have no DSpark stages (checkpoint without mtp.* "
                          "tensors, or init_params(..., include_mtp=False))")
    temps = jnp.ones((cfg.dspark_block_size,), jnp.float32) if sts_temperatures is None else \
        jnp.asarray(sts_temperatures, jnp.float32)
    return make(cfg, w, temps)


def make(cfg: ModelConfig, weights: dict, sts_temperatures) -> DSparkV41:
    """A checked DSparkV41 for target cfg."""
    check_config(cfg)
    _check_weights(cfg, weights)
    temps = jnp.asarray(sts_temperatures, jnp.float32)
    if temps.shape != (cfg.dspark_block_size,):
        raise DSparkError(f"sts_temperatures must have shape ({cfg.dspark_block_size},), got "
                          f"{temps.shape}")
    return DSparkV41(weights, temps, tuple(cfg.dspark_target_layer_ids))


def init_dspark_v41(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> DSparkV41:
    """Random V4.1 drafter weights (stage gate biases 0 so routing starts balanced)."""
    check_config(cfg)
    w = init_tree(v41_dspark_specs(cfg), key, dtype)
    w["stages"] = tuple({**s, "ffn": {**s["ffn"], "gate_bias": jnp.zeros_like(s["ffn"]["gate_bias"])}}
                        for s in w["stages"])
    return DSparkV41(w, jnp.ones((cfg.dspark_block_size,), jnp.float32),
                     tuple(cfg.dspark_target_layer_ids))


# ------------------------------------------------------------------------------- state
def init_draft_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> DecodeState:
    """Per stage a context ring of the last W = sliding_window committed positions
    (window_kv [B,W,d], window_pos [B,W], -1 = empty); lengths = positions pushed so far."""
    W, d = cfg.sliding_window, cfg.head_dim
    layers = tuple({"window_kv": jnp.zeros((batch, W, d), dtype),       # one buffer per stage
                    "window_pos": jnp.full((batch, W), -1, jnp.int32)}  # (donated separately)
                   for _ in range(cfg.num_mtp_layers))
    return DecodeState(layers, jnp.zeros((batch,), jnp.int32), max_len, W)


# ------------------------------------------------------------------------------- backbone
def stage_stack(drafter: DSparkV41, cfg: ModelConfig, embed, block_ids, positions, ctx_kv,
                ctx_bias, block_bias):
    """The S stages over Q query rows: the collapsed pre-norm hidden h [B,Q,D].

    block_ids/positions [B,Q]; ctx_kv: per stage [B,C,d] injected context keys; ctx_bias
    [B,Q,C] and block_bias [B,Q,Q] additive masks (0 / -inf) of context and block keys."""
    scfg = dspark_stage_config(cfg)
    e = embed[block_ids]
    B, Q, D = e.shape
    streams = jnp.broadcast_to(e[:, :, None, :], (B, Q, cfg.hc_mult, D))
    pending = initial_pending((B, Q), cfg.hc_mult)
    cos, sin = rope_cos_sin(positions, rope_frequencies(cfg, SWA), streams.dtype)
    bias = jnp.concatenate([ctx_bias, block_bias], axis=-1).astype(jnp.float32)
    for sp, kv_ctx in zip(drafter["stages"], ctx_kv):
        def attend(h, sp=sp, kv_ctx=kv_ctx):
            q, _ = query(sp["attn"], h, cos, sin, scfg)
            kv_blk = kv_projection(sp["attn"], h, cos, sin, scfg)
            keys = jnp.concatenate([kv_ctx.astype(kv_blk.dtype), kv_blk], axis=1)
            o = kernels.attention(q, keys, bias, sp["attn"]["sinks"])
            return output_projection(sp["attn"], o, cos, sin, scfg), None

        def ffn(h, sp=sp):
            return moe_layer(sp["ffn"], h, block_ids, SCORE_MOE, scfg), None

        streams, pending, _ = lagged_sublayer(sp["hc_attn"], sp["attn_norm"], streams, pending,
                                              attend, scfg)
        streams, pending, _ = lagged_sublayer(sp["hc_ffn"], sp["ffn_norm"], streams, pending,
                                              ffn, scfg)
    return final_collapse(streams, pending)


def confidence_logits(drafter: DSparkV41, h, e):
    """c = proj · [h ; e] (fp32 logits, no bias): h [..., D], e [..., r] -> [...]."""
    x = jnp.concatenate([h.astype(jnp.float32), e.astype(jnp.float32)], axis=-1)
    w = drafter["confidence"][0].astype(jnp.float32)
    return jnp.einsum("...i,i->...", x, w, precision=jax.lax.Precision.HIGHEST)


def draft(drafter: DSparkV41, params, dstate: DecodeState, anchor, sampling: SamplingParams,
          step, *, constrain=None):
    """γ draft tokens per row: (drafts int32 [B,γ], q_logits f32 [B,γ,V], conf_logits f32
    [B,γ]), plus (masks [B,γ+1,W], stop [B,γ]) when constrained (as `dspark.draft`).

    dstate holds exactly the committed positions 0..P-1 (P = dstate.lengths); anchor [B] the
    token at P; step [B] the request-local step counter (draft keys)."""
    cfg = params.config
    g = cfg.dspark_block_size
    B = anchor.shape[0]
    anchor = jnp.clip(anchor, 0, cfg.vocab_size - 1).astype(jnp.int32)
    P = dstate.lengths
    positions = P[:, None] + jnp.arange(g, dtype=jnp.int32)
    ids = jnp.concatenate(
        [anchor[:, None], jnp.full((B, g - 1), cfg.dspark_noise_token_id, jnp.int32)], 1)
    ctx_bias = context_bias(dstate.layers[0]["window_pos"], P, cfg.sliding_window, g)
    h = stage_stack(drafter, cfg, params["embed"], ids, positions,
                    tuple(ls["window_kv"] for ls in dstate.layers), ctx_bias,
                    jnp.zeros((B, g, g), jnp.float32))
    U = base_logits(drafter, params["head"], h, cfg.rms_norm_eps)       # [B,γ,V]
    return markov_pass(drafter, h, U, anchor, sampling, step, confidence_logits,
                       constrain=constrain)


# ------------------------------------------------------------------------------- the Drafter
def resolve(params, weights, num_draft_tokens):
    """(DSparkV41, γ): `weights` a DSparkV41, or None for the params' own mtp stages."""
    cfg = params.config
    try:
        check_config(cfg)
        if weights is None:
            weights = from_params(params)
    except DSparkError as e:
        raise ArgumentError(f"speculative='dspark': {e}") from e
    if not isinstance(weights, DSparkV41):
        raise ArgumentError(f"speculative='dspark' on a DeepSeek-V4.1 model needs drafter=None "
                            f"(the checkpoint's mtp stages) or a speculative.dspark_v41."
                            f"DSparkV41, got {type(weights).__name__}")
    _check_weights(cfg, weights.weights)
    if weights.target_layer_ids != tuple(cfg.dspark_target_layer_ids):
        raise ArgumentError(f"this V4.1 DSpark drafter taps layers {weights.target_layer_ids}, "
                            f"the model's config says {cfg.dspark_target_layer_ids}")
    gamma = cfg.dspark_block_size
    if num_draft_tokens is not None and num_draft_tokens != gamma:
        raise ArgumentError(f"num_draft_tokens={num_draft_tokens!r} but this DSpark drafter has "
                            f"block size {gamma} (dspark_block_size); leave num_draft_tokens "
                            f"unset (verify_len picks how many to verify)")
    return weights, gamma


def _taps(weights: DSparkV41) -> dict:
    return dict(taps=weights.target_layer_ids, tap=TAP)


def _init_state(params, weights, batch: int, max_len: int, *, window_slots: int, k: int,
                dtype) -> DecodeState:
    return init_draft_state(params.config, batch, max_len, dtype=dtype)


def _prefill(params, weights, dstate, lengths, feats, ids, n_new, next_ids, n_next):
    return push(weights, params.config, dataclasses.replace(dstate, lengths=lengths), feats.taps,
                n_new)


def _draft(params, weights, dstate, anchor, lengths, sampling, step, active, k: int,
           constrain=None):
    out = draft(weights, params, dataclasses.replace(dstate, lengths=lengths), anchor, sampling,
                step, constrain=constrain)
    return Draft(out[0], out[1], out[2], dstate, *out[3:])


def _commit(params, weights, dstate, feats, tokens, n_emit, lengths, active):
    """The committed positions' features (anchor + accepted drafts) join the context."""
    return push(weights, params.config, dataclasses.replace(dstate, lengths=lengths), feats.taps,
                n_emit)


def _sts_temperatures(weights):
    return weights.sts_temperatures.astype(jnp.float32)


# The V4.1 drafter as a `Drafter`; speculative="dspark" reaches it through
# `speculative.dspark_select` (V4.1 targets).
DRAFTER = Drafter(name="dspark", resolve=resolve, taps=_taps, init_state=_init_state,
                  prefill=_prefill, draft=_draft, commit=_commit, confidence=True,
                  sts_temperatures=_sts_temperatures)
