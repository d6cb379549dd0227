"""DeepSeek-V4.1 latents: the compress codes and their cross-layer sharing (docs/MODEL.md
§V1.2, §V1.3, §V2.3, §V2.4).

Codes are group sizes: 0 = window only, 2 = one latent per pair of tokens, 1 = one latent per
token. Only kv-source layers compute latents and index keys; every later layer of the same
code reads the nearest preceding source's (`ModelConfig.kv_source_of`). A whole-sequence
forward keeps one buffer per code, {"rows": rotated latents [B, N, d], "keys": index keys
[B, N, d_I]}, N = T // code, that each kv source overwrites (`empty_latents`, `publish`).

* Code 1: L_t = norm(x_t @ wkv), row position t.
* Code 2: kappa = x @ wkv, g = x @ wgate per token; for the pair {2j, 2j+1} pooled[c] =
  sum_s softmax_s(g_s[c]) kappa_s[c]; L_j = norm(pooled), row position 2j; an unpaired
  trailing token emits nothing.
* Rows: compress RoPE of L at the row position (trailing channels). Index keys from the
  pre-RoPE latent: K_j = RoPE(k_norm(L_j @ wk), row position).
* Visibility: row j of code c is visible to query t iff j < floor((t + 1) / c).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn.config import SWA, TOKEN, ModelConfig
from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.rope import apply_rope, rope_cos_sin, rope_frequencies

CODES = (2, 1)          # the compressed codes (0 has no latents)


def pair_pool(kappa: jax.Array, gate: jax.Array) -> jax.Array:
    """Per-channel softmax pooling of token pairs: kappa [..., N, 2, d] (act dtype), gate
    [..., N, 2, d] fp32 -> pooled [..., N, d] in kappa's dtype (fp32 sums)."""
    assert kappa.shape == gate.shape and kappa.shape[-2] == 2, (kappa.shape, gate.shape)
    w = jax.nn.softmax(gate.astype(jnp.float32), axis=-2)
    return jnp.sum(w * kappa.astype(jnp.float32), axis=-2).astype(kappa.dtype)


def pair_inputs(p, x: jax.Array):
    """Per-token code-2 compressor inputs: kappa [B, T, d] (act dtype), gate [B, T, d] fp32."""
    return linear(x, p["wkv"]), linear(x, p["wgate"]).astype(jnp.float32)


def source_latents(p, x: jax.Array, code: int, eps: float) -> jax.Array:
    """Pre-RoPE latents of a kv source over a sequence from position 0: x [B, T, D] (the
    layer's attention input) -> L [B, T // code, d] (normed, act dtype)."""
    B, T, _ = x.shape
    if code == 1:
        return rms_norm(linear(x, p["wkv"]), p["norm"], eps)
    if code != 2:
        raise ValueError(f"source_latents: code must be 1 or 2, got {code}")
    kappa, gate = pair_inputs(p, x)
    N = T // 2
    d = kappa.shape[-1]
    pooled = pair_pool(kappa[:, :2 * N].reshape(B, N, 2, d), gate[:, :2 * N].reshape(B, N, 2, d))
    return rms_norm(pooled, p["norm"], eps)


def row_positions(n_rows: int, code: int) -> jax.Array:
    """Row j sits at position code * j (the pair's first token): int32 [N]."""
    return code * jnp.arange(n_rows, dtype=jnp.int32)


def compress_freqs(cfg: ModelConfig):
    """The compress RoPE table every tensor of a code-1/2 layer uses (§V1.2)."""
    return rope_frequencies(cfg, TOKEN)


def rotate(latents: jax.Array, positions: jax.Array, freqs) -> jax.Array:
    """Compress RoPE of rows at their positions: [B, N, w], positions [N] -> [B, N, w]."""
    cos, sin = rope_cos_sin(positions, freqs, latents.dtype)
    return apply_rope(latents, cos, sin)


def index_keys(ip, latents: jax.Array, positions: jax.Array, freqs, eps: float) -> jax.Array:
    """Index keys from pre-RoPE latents: rope(k_norm(L @ wk)) [B, N, d_I] (§V2.4)."""
    k = rms_norm(linear(latents, ip["wk"]), ip["k_norm"], eps)
    return rotate(k, positions, freqs)


def visible_rows(q_pos: jax.Array, n_rows: int, code: int) -> jax.Array:
    """Row j visible to query t iff j < floor((t+1)/code): q_pos [B, T] -> bool [B, T, N]."""
    return jnp.arange(n_rows)[None, None, :] < ((q_pos + 1) // code)[:, :, None]


def empty_latents(cfg: ModelConfig, batch: int, n_rows, dtype) -> dict[int, dict]:
    """Zero buffers per compressed code used by cfg: {code: {"rows" [B, N, d], "keys"
    [B, N, d_I]}} with N = n_rows(code)."""
    codes = sorted({cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)} - {0},
                   reverse=True)
    return {c: {"rows": jnp.zeros((batch, n_rows(c), cfg.head_dim), dtype),
                "keys": jnp.zeros((batch, n_rows(c), cfg.index_head_dim), dtype)}
            for c in codes}


def publish(p, x: jax.Array, code: int, cfg: ModelConfig) -> dict:
    """A kv source's buffer entry {"rows", "keys"} from its attention input x [B, T, D]."""
    eps = cfg.rms_norm_eps
    freqs = compress_freqs(cfg)
    lat = source_latents(p["compressor"], x, code, eps)
    pos = row_positions(lat.shape[1], code)
    return {"rows": rotate(lat, pos, freqs),
            "keys": index_keys(p["indexer"], lat, pos, freqs, eps).astype(lat.dtype)}


def layer_code(cfg: ModelConfig, layer_type: str) -> int:
    """The compress code of a V4.1 layer type (0 for the window-only type)."""
    return 0 if layer_type == SWA else cfg.compress_ratio_of(layer_type)
