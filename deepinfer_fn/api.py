"""Public entry points with input checks at the boundary (docs/ARCHITECTURE.md "Public API")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.model import transformer
from deepinfer_fn.params import Params


def as_token_array(tokens):
    """A jax/numpy array as is; lists and tuples as a numpy array (a ragged list is an error)."""
    if hasattr(tokens, "shape") and hasattr(tokens, "dtype"):
        return tokens
    if not isinstance(tokens, (list, tuple)):
        raise ArgumentTypeError(f"tokens must be a 2-D int array [batch, length], got "
                                f"{type(tokens).__name__}")
    try:
        return np.asarray(tokens)
    except ValueError as e:
        raise ArgumentError(f"tokens must be a rectangular [batch, length] array of token ids: "
                            f"{e}") from None


def check_tokens(tokens, cfg, *, name: str = "tokens") -> None:
    """Shape, dtype and vocabulary checks; value checks only when the ids are concrete."""
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 2:
        raise ArgumentError(f"{name} must be a 2-D int array [batch, length], got shape {shape}")
    if shape[0] == 0 or shape[1] == 0:
        raise ArgumentError(f"{name} is empty (shape {tuple(shape)})")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ArgumentTypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if shape[1] > cfg.max_position_embeddings:
        raise ArgumentError(f"{name} has length {shape[1]} > max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if not isinstance(tokens, jax.core.Tracer):
        ids = np.asarray(tokens)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
            raise ArgumentError(f"{name} has ids outside the vocabulary [0, {cfg.vocab_size}): "
                             f"{sorted(set(bad.tolist()))[:8]}")


@jax.jit
def _forward(params: Params, tokens: jax.Array) -> jax.Array:
    return transformer.logits_and_streams(params, tokens)[0]


def mesh_context(params: Params):
    """(mesh or None, context manager): params placed by `shard_params` run under their mesh.

    The context is created lazily: `jax.set_mesh(mesh)` changes the global mesh as soon as it
    is called, so it must only be called as the `with` statement is entered.
    """
    import contextlib
    from shardings.mesh import mesh_of
    mesh = mesh_of(params)

    @contextlib.contextmanager
    def ctx():
        if mesh is None:
            yield
        else:
            with jax.set_mesh(mesh):
                yield
    return mesh, ctx()


def pad_batch(x: np.ndarray, multiple: int, fill=0) -> np.ndarray:
    """Pads the leading (batch) axis up to a multiple of the mesh's batch shards."""
    extra = -x.shape[0] % multiple
    if not extra:
        return x
    return np.concatenate([x, np.full((extra,) + x.shape[1:], fill, x.dtype)], 0)


def forward(params: Params, tokens) -> jax.Array:
    """Logits of every position, no cache: int32 [B, T] -> float32 [B, T, vocab] (spec §2).

    Params placed on a mesh (`shard_params`, `load_params(..., mesh=)`) run under that mesh:
    the batch is split over dp x ep (padded to a multiple), experts over ep.
    """
    if not isinstance(params, Params):
        raise ArgumentTypeError(f"forward: params must be deepinfer_fn.Params, got "
                                f"{type(params).__name__}")
    tokens = as_token_array(tokens)
    check_tokens(tokens, params.config)
    mesh, ctx = mesh_context(params)
    if mesh is None:
        return _forward(params, jnp.asarray(tokens, jnp.int32))
    from shardings.mesh import batch_shards, batch_sharding
    ids = np.asarray(tokens, np.int32)
    with ctx:
        x = jax.device_put(pad_batch(ids, batch_shards(mesh)), batch_sharding(mesh, 2))
        return _forward(params, x)[: ids.shape[0]]


@jax.jit
def _forward_with_streams(params, tokens):
    return transformer.logits_and_streams(params, tokens)


@jax.jit
def _mtp_logits(params, streams, tokens):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
    return transformer.mtp_block(params, streams[:, :-1], tokens[:, 1:], positions)[0]


def mtp_forward(params: Params, tokens) -> jax.Array:
    """MTP draft logits for a whole sequence, no cache (§2.11).

    tokens [B,T] -> float32 [B, T-1, vocab]: row i predicts token i+2 from the backbone's
    streams at i and token i+1.
    """
    if not isinstance(params, Params):
        raise ArgumentTypeError(f"mtp_forward: params must be deepinfer_fn.Params, got "
                                f"{type(params).__name__}")
    if params.config.is_v41:
        raise ArgumentError("mtp_forward: DeepSeek-V4.1 has no MTP block (its mtp.0..2 stages "
                            "are the DSpark drafter: generate(..., speculative='dspark'))")
    tokens = as_token_array(tokens)
    check_tokens(tokens, params.config)
    if tokens.shape[1] < 2:
        raise ArgumentError("mtp_forward needs at least 2 tokens per row")
    if not params["mtp"]:
        raise ArgumentError("these params have no MTP block (checkpoint without mtp.* tensors, "
                         "or init_params(..., include_mtp=False))")
    tokens = jnp.asarray(tokens, jnp.int32)
    _, streams = _forward_with_streams(params, tokens)
    return _mtp_logits(params, streams, tokens)
