"""Host-side checks of `generate` / `stream_generate` arguments (nothing is traced or compiled)."""

from __future__ import annotations

import numpy as np

from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.model.replay_v41 import late_layer_start
from deepinfer_fn.sampling import check_sampling
from deepinfer_fn.speculative import registry
from deepinfer_fn.validate import (boolean, describe, image_token_message, is_int, one_of,
                                   optional_boolean, positive_int, token_id)


def check_prompts(tokens, lengths, cfg, max_new_tokens: int, max_len: int | None,
                  where: str = "generate"):
    """Host-side validation of a prompt batch; returns (tokens int32 [B,T], lengths int32 [B])."""
    try:
        arr = np.asarray(tokens)
    except ValueError as e:
        raise ArgumentError(f"{where}: tokens must be a rectangular [batch, length] array of "
                            f"token ids (right-pad ragged prompts and pass lengths=): {e}") from None
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ArgumentError(f"tokens must be [batch, length], got shape {arr.shape}")
    if arr.size == 0:
        raise ArgumentError(f"empty prompt batch (tokens shape {arr.shape})")
    if arr.dtype.kind not in "iu":
        raise ArgumentTypeError(f"tokens must hold integer token ids, got dtype {arr.dtype}")
    B, T = arr.shape
    if lengths is None:
        lens = np.full((B,), T, np.int64)
    else:
        try:
            lens = np.asarray(lengths)
        except ValueError as e:
            raise ArgumentError(f"{where}: lengths must be a [batch] int array: {e}") from None
        if lens.dtype.kind not in "iu":
            raise ArgumentTypeError(f"{where}: lengths must hold ints (real prompt lengths), got "
                                    f"{describe(lengths)} with dtype {lens.dtype}")
        lens = lens.astype(np.int64)
    if lens.shape != (B,):
        raise ArgumentError(f"lengths has shape {lens.shape}, expected ({B},) for {B} prompts")
    if np.any(lens < 1):
        raise ArgumentError(f"empty prompt(s): rows {np.flatnonzero(lens < 1).tolist()} have length < 1")
    if np.any(lens > T):
        raise ArgumentError(f"lengths {lens.tolist()} exceed the token array width {T}")
    real = np.arange(T)[None] < lens[:, None]
    bad = real & ((arr < 0) | (arr >= cfg.vocab_size))
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ArgumentError(f"token id {int(arr[row, col])} at row {row}, position {col} is outside "
                            f"the vocabulary [0, {cfg.vocab_size})")
    message = image_token_message(cfg.image_token_id, np.where(real, arr, -1), "prompts")
    if message is not None:
        raise ArgumentError(f"{where}: {message}")
    max_new_tokens = positive_int(where, "max_new_tokens", max_new_tokens)
    if max_len is not None:
        max_len = positive_int(where, "max_len", max_len)
    limit = cfg.max_position_embeddings if max_len is None else min(max_len, cfg.max_position_embeddings)
    over = lens + max_new_tokens > limit
    if over.any():
        r = int(np.flatnonzero(over)[0])
        raise ArgumentError(f"prompt {r} ({int(lens[r])} tokens) + max_new_tokens {max_new_tokens} "
                            f"exceeds the context limit of {limit} tokens")
    return np.where(real, arr, 0).astype(np.int32), lens.astype(np.int32)


def check_stop_tokens(stop_tokens, cfg, where: str = "generate") -> tuple[int, ...]:
    """stop_tokens as a tuple of ids in [0, vocab) (ints, not bools or floats)."""
    if isinstance(stop_tokens, (str, bytes)) or is_int(stop_tokens):
        raise ArgumentTypeError(f"{where}: stop_tokens must be a sequence of token ids, got "
                                f"{describe(stop_tokens)} (for one id write [id])")
    try:
        items = np.asarray(stop_tokens).reshape(-1).tolist() if hasattr(stop_tokens, "shape") \
            else list(stop_tokens)
    except TypeError:
        raise ArgumentTypeError(f"{where}: stop_tokens must be a sequence of token ids, got "
                                f"{describe(stop_tokens)}") from None
    wrong = [t for t in items if not is_int(t)]
    if wrong:
        raise ArgumentTypeError(f"{where}: stop_tokens must hold int token ids, got "
                                f"{describe(wrong[0])} in {items!r}")
    stop_tokens = tuple(int(t) for t in items)
    bad = [t for t in stop_tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ArgumentError(f"stop_tokens {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    return stop_tokens


def check_options(cfg, batch: int, *, where: str, temperature=0.0, top_k=None, top_p=None,
                  min_p=None, seed=0, pad_id=None, prefill_chunk=512, window_slots=None,
                  return_logprobs=False, speculative=None, num_draft_tokens=None,
                  verify_len="fixed") -> None:
    """Host-side checks of generate's remaining keyword arguments (nothing is traced)."""
    check_sampling(batch, temperature, top_k, top_p, min_p, seed)
    if pad_id is not None:
        token_id(where, "pad_id", pad_id, cfg.vocab_size)
    positive_int(where, "prefill_chunk", prefill_chunk)
    if window_slots is not None:
        positive_int(where, "window_slots", window_slots)
    boolean(where, "return_logprobs", return_logprobs)
    if speculative is not None:
        one_of(where, "speculative", speculative, registry.names())
    if num_draft_tokens is not None:
        positive_int(where, "num_draft_tokens", num_draft_tokens)
    one_of(where, "verify_len", verify_len, ("fixed", "dynamic", "random"))


def check_bounded_replay(cfg, value, where: str = "generate") -> bool:
    """decoder_swa_bounded_replay resolved: None -> on for a DeepSeek-V4.1 config whose layers
    allow it (`replay_v41.late_layer_start`), off otherwise; True on a V4 config (or a V4.1
    config that does not allow it) raises ArgumentError naming the flag."""
    value = optional_boolean(where, "decoder_swa_bounded_replay", value)
    if value is False:
        return False
    if not cfg.is_v41:
        if value:
            raise ArgumentError(f"{where}: decoder_swa_bounded_replay=True needs a DeepSeek-V4.1 "
                                f"model (model_type {cfg.model_type!r} has no late stack to run "
                                f"on a tail); leave it None or pass False")
        return False
    try:
        late_layer_start(cfg)
    except ValueError as e:
        if value:
            raise ArgumentError(f"{where}: decoder_swa_bounded_replay=True: {e}") from None
        return False
    return True
