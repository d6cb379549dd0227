"""Requests and their outputs.

A `Request` is one prompt with its own sampling parameters and stop conditions; the engine
returns one `RequestOutput` per request, in submission order. Validation happens on the host
at submission (`validate`): a bad request becomes an output with finish_reason "error" and a
message, and never reaches the device.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from deepinfer_fn.sampling import check_sampling, scalar_sampling_ok
from deepinfer_fn.validate import describe, image_token_message, is_int

FINISH_REASONS = ("stop", "length", "error", "cancelled")

_ids = itertools.count()


@dataclasses.dataclass
class Request:
    """One generation request.

    tokens: the prompt (token ids). temperature 0 = greedy; top_k 0 / top_p 1 / min_p 0 = off;
    seed: the request's sampling seed (its randomness depends only on seed and positions,
    `deepinfer_fn.sampling.request_key`, so it equals `generate(..., seed=seed)`).
    max_new_tokens: generation limit; stop_tokens: the request ends right after emitting one.
    request_id: any hashable; default a fresh integer.
    constraint: structured output (`deepinfer_fn.Regex`, `JsonSchema` or `Grammar`), compiled on
    the host at submission against the engine's tokenizer; every sampled token is drawn under
    the constraint's allowed-token mask, EOS only once the text matches, and the request ends
    when the constraint completes (EOS emitted, included in `tokens`). A constraint that does not
    compile fails this request alone (finish_reason "error").
    """

    tokens: Sequence[int]
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_tokens: Sequence[int] = ()
    request_id: object = None
    constraint: object = None

    def __post_init__(self):
        if self.request_id is None:
            self.request_id = next(_ids)


@dataclasses.dataclass
class RequestMetrics:
    """Per-request timings (seconds, host clock) and counts.

    ttft: from submission to the first token known on the host; tpot: mean time per output
    token after the first ((t_last - t_first) / (n - 1); 0 for one token); prompt_tokens;
    generated_tokens; cached_tokens: prompt tokens served by the prefix cache (at the last
    admission); replayed_tokens: tokens recomputed for window-state replay; preemptions.
    Speculative engines: verified / accepted, per verify step of the request (in order), the
    drafts verified (ell) and accepted (g; the step emitted g + 1 tokens, fewer after a stop).
    """

    ttft: float = float("nan")
    tpot: float = float("nan")
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    replayed_tokens: int = 0
    preemptions: int = 0
    verified: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestOutput:
    """tokens: the generated ids (a stop token included); finish_reason in FINISH_REASONS;
    error: the message when finish_reason == "error"; logprobs: log p of each token under the
    model (before temperature and filters, as `sampling.sample` reports; restricted to the
    allowed tokens for a constrained request). constraint_status: None (free request),
    "complete" (the output fully matches the constraint), "incomplete" (max_new_tokens or a
    stop token ended it first: only a prefix of a match) or "error" (the message in `error`)."""

    request_id: object
    tokens: list[int]
    finish_reason: str
    error: str | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)
    constraint_status: str | None = None


def as_request(item, default_max_new_tokens: int) -> Request:
    """A `Request` from a Request, a `transfer.RequestState` or a plain token-id sequence."""
    if isinstance(item, Request):
        return item
    if hasattr(item, "to_request"):     # an engine.transfer.RequestState (prefill elsewhere)
        return item.to_request()
    return Request(tokens=item, max_new_tokens=default_max_new_tokens)


def validate(req: Request, vocab_size: int, max_len: int, pool_tokens: int,
             image_token_id: int = -1) -> tuple[list[int], str | None]:
    """(prompt as a list of python ints, error message or None) for one request.

    Checks: a non-empty 1-D sequence of integer ids inside the vocabulary; max_new_tokens a
    positive int; prompt + max_new_tokens within the engine's context (max_len) and within the
    whole page pool (pool_tokens: such a request could never run); sampling parameters in range
    (the rules of `sampling.check_sampling`, host only); stop tokens inside the vocabulary; no
    image token (image_token_id >= 0: no vision tower runs it).
    """
    try:
        arr = np.asarray(req.tokens)
    except Exception as e:  # ragged nested lists and the like
        return [], f"tokens could not be read as an array: {e}"
    if arr.ndim != 1:
        return [], f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}"
    if arr.size == 0:
        return [], "empty prompt (0 tokens)"
    if arr.dtype.kind not in "iu":
        return [], f"tokens must be integer token ids, got dtype {arr.dtype}"
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        return [], (f"token id {int(arr[i])} at position {i} is outside the vocabulary "
                    f"[0, {vocab_size})")
    message = image_token_message(image_token_id, arr)
    if message is not None:
        return [], message
    n = req.max_new_tokens
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        return [], f"max_new_tokens must be a positive int, got {n!r}"
    if arr.size + n > max_len:
        return [], (f"prompt ({arr.size} tokens) + max_new_tokens {n} exceeds the engine's "
                    f"context limit of {max_len} tokens")
    if arr.size + n > pool_tokens:
        return [], (f"prompt ({arr.size} tokens) + max_new_tokens {n} exceeds the whole page "
                    f"pool ({pool_tokens} tokens)")
    try:
        if not scalar_sampling_ok(req.temperature, req.top_k, req.top_p, req.min_p, req.seed):
            check_sampling(1, req.temperature, req.top_k, req.top_p, req.min_p, req.seed)
    except (ValueError, TypeError) as e:
        return [], f"bad sampling parameters: {e}"
    if isinstance(req.stop_tokens, (str, bytes)) or is_int(req.stop_tokens):
        return [], f"stop_tokens must be a sequence of token ids, got {describe(req.stop_tokens)}"
    try:
        stops = list(req.stop_tokens)
    except TypeError as e:
        return [], f"stop_tokens must be token ids: {e}"
    wrong = [t for t in stops if not is_int(t)]
    if wrong:
        return [], f"stop_tokens must hold int token ids, got {describe(wrong[0])}"
    stops = [int(t) for t in stops]
    bad_stops = [t for t in stops if not 0 <= t < vocab_size]
    if bad_stops:
        return [], f"stop_tokens {bad_stops} are outside the vocabulary [0, {vocab_size})"
    return arr.tolist(), None
