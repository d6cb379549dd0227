"""Plain decoding: one jitted `lax.while_loop` that samples, feeds each row its own token and
stops rows independently (state donated; nothing returns to the host until the block ends).

`decode_block` is that loop for up to n tokens per row (a traced limit <= n, so one program
serves every length in a bucket); with packed grammar masks and a session id it also runs
constrained rows (one host callback per step, `deepinfer_fn.decoding.constrained`).
`plain_blocks` drives it block by block for `generate` / `stream_generate`.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deepinfer_fn import structured
from deepinfer_fn.api import mesh_context
from deepinfer_fn.compile_cache import DISABLED
from deepinfer_fn.decoding.output import GenerateOutput
from deepinfer_fn.decoding.prefill import bucket
from deepinfer_fn.model import transformer
from deepinfer_fn.params import Params
from deepinfer_fn.program_cache import program
from deepinfer_fn.sampling import SamplingParams, sample
from deepinfer_fn.state import DecodeState


@program(static_argnames=("n", "feed_last"), donate_argnums=(1,))
def decode_block(params: Params, state: DecodeState, logits, done, sampling: SamplingParams,
                 pad_id, masks=None, session=None, *, n: int, stops, limit=None,
                 feed_last: bool, prompt=None):
    """Samples up to `limit` (traced int32, <= n; default n) tokens per row inside one
    `lax.while_loop`, feeding each row its own token (rows that stopped feed nothing and keep
    their state). n (static) is the output width: one compiled program serves every
    limit <= n. stops: int32 [S] stop tokens (-1 = none; `stop_array`). Returns
    (tokens [B,n], logprobs [B,n], counts [B], state, next logits [B,V], done [B]);
    with feed_last=False the limit-th token is not fed (no wasted model step at the end).

    prompt: optional (tokens int32 [B,P], lengths int32 [B]): each row first feeds its
    lengths[b] prompt tokens, one per step through the same model step (the loop prefill of
    short prompts; `logits` is ignored for rows with lengths[b] > 0), then samples its up to
    `limit` tokens from the logits of its last prompt token. Rows with length 0 sample at once.

    Constrained (masks: packed allowed-token bits uint32 [B, ceil(V/32)] for the first step;
    session: int32 id of a registered `structured.ConstrainedBatch`): each step samples under
    the unpacked masks, then one io_callback hands the sampled tokens to the host, which
    advances the matchers and returns the next step's masks and the rows whose constraint
    finished (they stop). The last masks come back as a 7th output, for the next block.
    """
    B = logits.shape[0]
    limit = jnp.int32(n) if limit is None else jnp.minimum(limit, n)
    constrained = masks is not None
    if prompt is not None:
        if constrained:
            raise ValueError("decode_block: prompt= (loop prefill) does not take grammar masks")
        return _prompted_block(params, state, logits, done, sampling, pad_id, prompt, n=n,
                               stops=stops, limit=limit, feed_last=feed_last)

    def cond(loop):
        i, done = loop[0], loop[6]
        return (i < limit) & ~jnp.all(done)

    def body(loop):
        i, state, logits, out, logp, count, done = loop[:7]
        allowed = structured.unpack_bitmask(loop[7], logits.shape[-1]) if constrained else None
        token, lp = sample(logits, sampling, state.lengths, allowed)
        token = jnp.where(done, pad_id, token)
        out = out.at[:, i].set(token)
        logp = logp.at[:, i].set(jnp.where(done, 0.0, lp))
        count = count + (~done).astype(jnp.int32)
        feed = (~done).astype(jnp.int32)
        active = ~done
        done = done | jnp.isin(token, stops)
        extra = ()
        if constrained:  # the host consumes the tokens and packs the next step's masks
            next_masks, finished = io_callback(
                structured.host_step, (jax.ShapeDtypeStruct(loop[7].shape, jnp.uint32),
                                       jax.ShapeDtypeStruct((B,), jnp.bool_)),
                session, token, active, ordered=False)
            done = done | finished
            extra = (next_masks,)

        def step(args):
            state, logits = args
            logits, state, _ = transformer.forward_chunk(params, state, token[:, None], feed)
            return state, logits

        if feed_last:
            state, logits = step((state, logits))
        else:
            state, logits = jax.lax.cond(i + 1 < limit, step, lambda a: a, (state, logits))
        return (i + 1, state, logits, out, logp, count, done) + extra

    init = (jnp.int32(0), state, logits, jnp.full((B, n), pad_id, jnp.int32),
            jnp.zeros((B, n), jnp.float32), jnp.zeros((B,), jnp.int32), done)
    init += (masks,) if constrained else ()
    _, state, logits, out, logp, count, done, *rest = jax.lax.while_loop(cond, body, init)
    return (out, logp, count, state, logits, done, *rest)


def _prompted_block(params, state, logits, done, sampling, pad_id, prompt, *, n, stops, limit,
                    feed_last):
    """`decode_block` with a loop prefill: at iteration i row b feeds prompt token i while
    i < lengths[b], then samples its output j = i - lengths[b] (j < limit). A row's tokens,
    keys (positions) and stops are those of the plain loop after a chunked prefill."""
    tokens, plen = prompt
    B, P = tokens.shape
    plen = jnp.asarray(plen, jnp.int32)
    columns = jnp.arange(n, dtype=jnp.int32)[None]

    def cond(loop):
        i, done = loop[0], loop[6]
        return (i < limit + jnp.max(plen)) & ~jnp.all(done | (i - plen >= limit))

    def body(loop):
        i, state, logits, out, logp, count, done = loop
        j = i - plen                                       # output index per row; < 0: prompt
        prefilling = j < 0
        emit = ~prefilling & (j < limit) & ~done
        token, lp = sample(logits, sampling, state.lengths)
        here = (columns == j[:, None]) & emit[:, None]      # [B, n]: this step's output column
        out = jnp.where(here, token[:, None], out)
        logp = jnp.where(here, lp[:, None], logp)
        count = count + emit.astype(jnp.int32)
        done = done | (emit & jnp.isin(token, stops))
        sampled_feed = emit if feed_last else emit & (j + 1 < limit)
        feed = prefilling | sampled_feed
        fed = jnp.where(prefilling, tokens[:, jnp.clip(i, 0, P - 1)], token)

        def step(args):
            state, logits = args
            new, state, _ = transformer.forward_chunk(params, state, fed[:, None],
                                                      feed.astype(jnp.int32))
            # rows that fed nothing keep their logits (a later block samples from them)
            return state, jnp.where(feed[:, None], new, logits)

        state, logits = jax.lax.cond(jnp.any(feed), step, lambda a: a, (state, logits))
        return (i + 1, state, logits, out, logp, count, done)

    init = (jnp.int32(0), state, logits, jnp.full((B, n), pad_id, jnp.int32),
            jnp.zeros((B, n), jnp.float32), jnp.zeros((B,), jnp.int32), done)
    _, state, logits, out, logp, count, done = jax.lax.while_loop(cond, body, init)
    return out, logp, count, state, logits, done


def feeds_last_token(max_new_tokens: int, block: int) -> bool:
    """decode_block's feed_last for a run of max_new_tokens in blocks of `block`: False for a
    single block (no model step after the last token), True when streaming in several, so
    every block of the stream is the same program (the last block feeds one token more)."""
    return max_new_tokens > block


def decode_width(max_new_tokens: int, block: int) -> int:
    """Output width of generate's decode program: `block` when streaming in blocks, else
    max_new_tokens rounded up to a power of two (at least 16); the loop runs a traced limit."""
    if block < max_new_tokens:
        return int(block)
    return bucket(max_new_tokens, 16)


def stop_array(stop_tokens: Sequence[int]) -> jax.Array:
    """Stop tokens as int32 [S], padded with -1 to a power of two (at least 4): the decode
    program takes them as data, so changing them compiles nothing."""
    stop_tokens = tuple(stop_tokens)
    width = bucket(max(len(stop_tokens), 1), 4)
    return jax.device_put(np.asarray(stop_tokens + (-1,) * (width - len(stop_tokens)), np.int32))


def plain_blocks(params: Params, state: DecodeState, logits, done, sampling: SamplingParams,
                 pad, *, B: int, max_new_tokens: int, block: int, stops, width: int,
                 return_logprobs: bool, prompt=None):
    """`GenerateOutput`s of up to `block` tokens per row after the prefill (logits [Bp,V] of
    each row's last prompt token; rows >= B are mesh padding, done from the start).
    prompt: the loop prefill's (tokens [Bp,P], lengths [Bp]) (`loop_prompt`; then `logits`
    is a placeholder): the first block feeds them, later blocks the same arrays with
    lengths 0, so every block runs one program."""
    produced = 0
    while produced < max_new_tokens:
        n = min(block, max_new_tokens - produced)
        last = produced + n >= max_new_tokens
        # prompt= only when given: an explicit None would key another program than the
        # precompiled one (`generate_programs`).
        loop_prefill = {} if prompt is None else dict(prompt=prompt)
        with mesh_context(params)[1]:
            out, logp, count, state, logits, done = decode_block(
                params, state, logits, done, sampling, pad, n=width, stops=stops,
                limit=np.int32(n), feed_last=feeds_last_token(max_new_tokens, block),
                **loop_prefill)
        if prompt is not None:
            prompt = (prompt[0], jax.device_put(np.zeros(prompt[1].shape, np.int32)))
        produced += n
        # Sliced on the host: a device slice would compile a program per (rows, n).
        out_h, count_h, done_h, logp_h = jax.device_get((out, count, done, logp))
        yield GenerateOutput(out_h[:B, :n], count_h[:B], done_h[:B],
                             logp_h[:B, :n] if return_logprobs else None)
        if last or bool(done_h[:B].all()):
            return


# Prompts of at most this many tokens (the padded width) are fed by generate's decode loop
# itself (`decode_block(prompt=)`): a call then compiles no prefill program, whose compile
# costs more than the short prompt's steps. DEEPINFER_LOOP_PREFILL=off turns it off.
LOOP_PREFILL_MAX_TOKENS = 16


def uses_loop_prefill(prompt_len: int, *, sharded: bool = False, constrained: bool = False,
                      bounded_replay: bool = False) -> bool:
    """Whether generate feeds a [B, prompt_len] prompt batch through its decode loop instead
    of `prefill.prefill_forward`: single-device plain runs of short prompts (the chunked
    prefill keeps sharded, constrained, speculative and bounded-replay runs)."""
    if os.environ.get("DEEPINFER_LOOP_PREFILL", "on").strip().lower() in DISABLED:
        return False
    return (int(prompt_len) <= LOOP_PREFILL_MAX_TOKENS and not sharded and not constrained
            and not bounded_replay)


def loop_prompt(tokens: np.ndarray, lengths: np.ndarray):
    """The loop prefill's device arrays: (tokens int32 [B, LOOP_PREFILL_MAX_TOKENS], lengths
    int32 [B]) from right-padded prompts [B, T <= LOOP_PREFILL_MAX_TOKENS]."""
    B, T = tokens.shape
    assert T <= LOOP_PREFILL_MAX_TOKENS, (T, LOOP_PREFILL_MAX_TOKENS)
    padded = np.zeros((B, LOOP_PREFILL_MAX_TOKENS), np.int32)
    padded[:, :T] = tokens
    return jax.device_put(padded), jax.device_put(np.asarray(lengths, np.int32))
