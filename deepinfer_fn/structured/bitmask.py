"""Packed token masks: bit t % 32 of uint32 word t // 32 is token t (host pack/unpack in numpy,
the sampler's unpack on device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mask_words(vocab_size: int) -> int:
    """uint32 words of a packed mask over `vocab_size` tokens."""
    return (int(vocab_size) + 31) // 32


def pack_mask(allowed) -> np.ndarray:
    """bool [..., V] -> uint32 [..., ceil(V/32)] (bit t % 32 of word t // 32 is token t)."""
    allowed = np.asarray(allowed, bool)
    V = allowed.shape[-1]
    pad = mask_words(V) * 32 - V
    bits = np.pad(allowed, [(0, 0)] * (allowed.ndim - 1) + [(0, pad)])
    return np.packbits(bits, axis=-1, bitorder="little").view(np.uint32)


def unpack_mask(packed, vocab_size: int) -> np.ndarray:
    """Host inverse of pack_mask: uint32 [..., W] -> bool [..., vocab_size]."""
    packed = np.ascontiguousarray(packed, np.uint32)
    bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def unpack_bitmask(packed: jax.Array, vocab_size: int) -> jax.Array:
    """Device unpack (jittable): uint32 [B, W] -> bool [B, vocab_size], the sampler's allowed_mask."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (packed[..., None] >> shifts) & jnp.uint32(1)
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 32)[..., :vocab_size] != 0
