"""Lossless verification of draft tokens, and the state rollback (docs/MODEL.md §D2, §5).

Alignment (§2.1): row b verified `[y_L, x_1 .. x_l]` at positions L .. L+l in one target
forward; target logits o_j (j = 0..k) judge x_{j+1} and o_l gives the bonus. A row emits its
g accepted drafts plus one more token (correction at the first rejection, bonus when all l
are accepted): g + 1 tokens, 1 <= g + 1 <= l + 1.

* Greedy rows (temperature < GREEDY_TEMPERATURE): accept while x_{j+1} == argmax o_j (ties ->
  lowest id, as `sampling.sample`); the extra token is argmax o_g. This reproduces plain
  greedy decoding token for token.
* Sampled rows: standard speculative sampling (Leviathan et al.; Chen et al.). With
  p_j = `probabilities(o_j)` (the request's processors, exactly what the plain sampler draws
  from) and q_{j+1} the distribution x_{j+1} was drawn from: accept iff
  u_j * q(x) < p_j(x) (u_j ~ U[0,1), strict, q(x) = 0 rejects); at the first rejection draw
  from the residual max(p_g - q_{g+1}, 0) (p_g when it has no mass); if all l are accepted,
  draw the bonus from p_l. Each emitted token is then distributed exactly as the plain
  sampler's token at that position.

Randomness is per request and counter-based (§5.2): u_j from request_key(seed, step=s,
role=ACCEPT, slot=j), the residual/bonus draw (Gumbel-max over log w) from request_key(seed,
step=s, role=FINAL), with s the request's own verify-step counter, so a row's result never
depends on its batch. A different verify length per row (`ell`) is supported: slots j >= ell
are not admitted, so the row gets the bonus from p_ell after ell acceptances.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_fn.sampling import (Role, SamplingParams, gumbel_noise, probabilities,
                                   request_key)


def _repeat_rows(sampling: SamplingParams, n: int) -> SamplingParams:
    """Each row's settings repeated n times (for [B*n, V] logits laid out row-major)."""
    return jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), sampling)


def _uniforms(keys):
    flat = keys.reshape(-1)
    return jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(flat).reshape(keys.shape)


def verify(target_logits, drafts, q_logits, sampling: SamplingParams, step, ell=None):
    """Accept/reject the drafts of every row.

    target_logits f32 [B,k+1,V]; drafts int32 [B,k]; q_logits f32 [B,k,V] the processed
    logits each draft was drawn from (softmax = q; only read for sampled rows); step int32 [B]
    the request-local step counter; ell int32 [B] the verify length per row (default k).
    Returns (tokens int32 [B,k+1]: the g accepted drafts then the correction/bonus token,
    zeros after; accepted int32 [B] = g).
    """
    B, K1, V = target_logits.shape
    k = K1 - 1
    ell = jnp.full((B,), k, jnp.int32) if ell is None else jnp.asarray(ell, jnp.int32)
    slot = jnp.arange(k)
    admitted = slot[None] < ell[:, None]                                # [B,k]
    target_max = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)   # [B,k+1]
    greedy_acc = (drafts == target_max[:, :k]) & admitted

    def leading(acc):
        return jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)

    def at(x, g):  # x [B, n, ...] -> x[b, g[b]]
        return jnp.take_along_axis(x, g.reshape((B, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]

    def sampled():
        p = probabilities(target_logits.reshape(B * K1, V), _repeat_rows(sampling, K1))
        p = p.reshape(B, K1, V)
        q = jax.nn.softmax(q_logits, axis=-1)                            # -inf -> 0
        px = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        qx = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = _uniforms(request_key(sampling.seed[:, None], None, step=step[:, None],
                                  slot=slot[None], role=Role.ACCEPT))
        acc = (u * qx < px) & (qx > 0) & admitted
        g = leading(acc)
        pg = at(p, g)
        qg = jnp.where((g < ell)[:, None], at(q, jnp.minimum(g, k - 1)), 0.0)
        w = jnp.maximum(pg - qg, 0.0)
        w = jnp.where(jnp.sum(w, axis=-1, keepdims=True) > 0, w, pg)
        noise = gumbel_noise(request_key(sampling.seed, None, step=step, role=Role.FINAL), V)
        final = jnp.argmax(jnp.log(w) + noise, axis=-1).astype(jnp.int32)
        return acc, final

    def greedy_only():
        return greedy_acc, at(target_max, leading(greedy_acc))

    greedy = sampling.greedy()
    acc, final = jax.lax.cond(jnp.any(~greedy), sampled, greedy_only)
    acc = jnp.where(greedy[:, None], greedy_acc, acc)
    g = leading(acc)
    final = jnp.where(greedy, at(target_max, g), final)
    j = jnp.arange(K1)[None]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < g[:, None], padded, jnp.where(j == g[:, None], final[:, None], 0))
    return tokens.astype(jnp.int32), g.astype(jnp.int32)


def rollback(state, lengths):
    """The state after keeping only `lengths` processed tokens per row.

    Every piece of `DecodeState` is addressed by absolute position (deepinfer_fn/state.py), so
    moving `lengths` back is the whole rollback, provided the state was built with
    `window_slots >= sliding_window + k - 1` for verify chunks of k + 1 tokens: the window and
    compressor rings then still hold every position the next chunk reads, rows of windows that
    closed inside the rejected tail are invisible until recomputed. Works for the backbone
    state and for the MTP drafter's state alike.
    """
    return dataclasses.replace(state, lengths=jnp.asarray(lengths, jnp.int32))
