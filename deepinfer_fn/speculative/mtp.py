"""The V4 MTP block as a drafter, with its own decode state (docs/MODEL.md §2.11).

The MTP block at position i reads the backbone's final residual streams at i and the token at
i+1 and predicts the token at i+2. Its body is one V4 block with sliding-window attention and
no compressor, so its decode state is one window ring (a one-layer `DecodeState`), advanced
by `mtp_chunk` exactly as `transformer.forward_chunk` advances the backbone (same
`attention_chunk`, same `sublayer` helper). `mtp_chunk` over a sequence equals
`transformer.mtp_block` (the no-cache form) at every position.

Drafting k tokens per step (`draft`). With the backbone state holding positions 0..L-1 and the
anchor y_L (committed, not processed yet):

  1. the MTP catches up on the committed positions it has not seen (those of the last verify
     step: backbone streams at i plus the token at i+1, the last of them being y_L); its
     logits at position L-1 give draft 1 (the token at L+1);
  2. drafts 2..k chain the MTP on its own output: the MTP output streams at position j stand
     in for the (not yet computed) backbone streams at j+1, and with the draft at j+2 they
     predict the token at j+3. This is the recursive use of a single MTP module that vLLM's
     and SGLang's DeepSeek MTP proposers use for k > 1 (the DeepSeek-V3 paper chains D
     modules, each one feeding the next its output; here the one module is reused and moved
     one position per draft, so each draft's window attention sees the entries of the
     earlier drafts). The MTP was trained only for depth 1, so drafts 2..k are weaker.
  3. The chained positions L..L+k-2 are speculative: the MTP state's `lengths` goes back to
     L afterwards, and the next step's catch-up rewrites those ring slots with entries built
     from real backbone streams (the ring needs `sliding_window + k` slots, the same rule as
     the backbone: deepinfer_fn/state.py).

Draft tokens are drawn from q = `sampling.probabilities(logits)` (the request's own
temperature / top-k / top-p / min-p applied to the MTP logits; greedy rows take the argmax)
with Gumbel-max noise from request_key(seed, step=s, role=DRAFT, slot=j): the request-local
step counter, never the position alone (docs/MODEL.md §D2.5, §5.2).

`DRAFTER` puts this behind the `speculative.drafter.Drafter` interface: its per-row state
`MTPState` is the window ring plus the pending catch-up input (the committed positions of the
last step, or the prompt's last position after the prefill), so one `speculative_step` drives
it in `generate` and in the engine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.config import SCORE_MOE, SWA
from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.model.cached import attention_chunk
from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.moe import moe_layer
from deepinfer_fn.model.transformer import head_logits, sublayer
from deepinfer_fn.sampling import Role, SamplingParams, filter_logits, gumbel_noise, request_key
from deepinfer_fn.speculative.drafter import Draft, Drafter
from deepinfer_fn.state import DecodeState, layer_state_shapes


def init_mtp_state(cfg, batch: int, max_len: int, *, window_slots: int | None = None,
                   dtype=jnp.float32) -> DecodeState:
    """An empty MTP state: one SWA layer (window ring) per row; lengths = positions the MTP
    has processed (position i needs the token at i+1, so it trails the backbone by one)."""
    window_slots = window_slots or cfg.sliding_window
    shapes = layer_state_shapes(cfg, SWA, batch, max_len, window_slots, dtype)
    layer = {k: (jnp.full(s.shape, -1, s.dtype) if k == "window_pos" else jnp.zeros(s.shape, s.dtype))
             for k, s in shapes.items()}
    return DecodeState((layer,), jnp.zeros((batch,), jnp.int32), max_len, window_slots)


def mtp_chunk(params, mstate: DecodeState, streams, next_ids, n_new, *, depth: int = 0,
              all_logits: bool = False):
    """The MTP block over a chunk against its state: positions i = mstate.lengths + j.

    streams [B,S,n,D]: hidden streams at positions i (backbone final streams, or the MTP's own
    output when chaining); next_ids [B,S]: the tokens at i+1; n_new [B] valid entries per row.
    Returns (logits, new_state, out_streams [B,S,n,D]): logits float32 [B,S,V] (token i+2) if
    all_logits, else those of each row's last valid entry [B,V].
    """
    cfg = params.config
    mp = params["mtp"][depth]
    lp = mp["block"]
    eps = cfg.rms_norm_eps
    B, S = next_ids.shape
    next_ids = jnp.clip(next_ids, 0, cfg.vocab_size - 1)
    start = mstate.lengths
    e = rms_norm(params["embed"][next_ids], mp["enorm"], eps)
    x = linear(e, mp["e_proj"])[:, :, None, :] + linear(rms_norm(streams, mp["hnorm"], eps),
                                                        mp["h_proj"])
    ls = mstate.layers[0]
    x, new_ls = sublayer(lp["hc_attn"], lp["attn_norm"], x,
                         lambda h: attention_chunk(lp["attn"], h, ls, start, n_new, SWA, cfg), cfg)
    x, _ = sublayer(lp["hc_ffn"], lp["ffn_norm"], x,
                    lambda h: (moe_layer(lp["ffn"], h, next_ids, SCORE_MOE, cfg), None), cfg)
    new_state = DecodeState((new_ls,), start + n_new, mstate.max_len, mstate.window_slots)
    head = lambda s: head_logits(mp["hc_head"], mp["norm"], params["head"], s, cfg)
    if all_logits:
        return head(x), new_state, x
    last = jnp.clip(n_new - 1, 0, S - 1)
    return head(jnp.take_along_axis(x, last[:, None, None, None], axis=1))[:, 0], new_state, x


def draw(logits, sampling: SamplingParams, step, slot):
    """One draft token per row from q = probabilities(logits): greedy rows take the argmax,
    sampled rows Gumbel-max over the processed logits with the DRAFT key of (step, slot).
    Returns (tokens int32 [B], processed logits f32 [B,V] — softmax of them is q)."""
    filtered = filter_logits(logits, sampling)
    keys = request_key(sampling.seed, None, step=step, slot=slot, role=Role.DRAFT)
    sampled = jnp.argmax(filtered + gumbel_noise(keys, filtered.shape[-1]), axis=-1)
    greedy = jnp.argmax(logits, axis=-1)
    return jnp.where(sampling.greedy(), greedy, sampled).astype(jnp.int32), filtered


def draft(params, mstate: DecodeState, streams, next_ids, n_new, k: int,
          sampling: SamplingParams, step, *, depth: int = 0, constrain=None):
    """k draft tokens per row (module docstring).

    streams [B,S,n,D] / next_ids [B,S] / n_new [B]: the committed positions the MTP has not
    processed yet (backbone streams at i, token at i+1; the last token is the anchor); rows
    with n_new = 0 are idle (their drafts are garbage, their state is unchanged). step [B]:
    the request-local step counter for the draft keys.
    Returns (drafts int32 [B,k], q_logits f32 [B,k,V] (processed logits the drafts were drawn
    from), new MTP state with lengths = old + n_new).

    constrain = (masks uint32 [B,W], host): grammar masks at every draft position
    (deepinfer_fn/structured.py, "speculative decoding"). Draft j + 1 is drawn from the MTP
    logits under the packed allowed-token mask m_j (m_0 = `masks`, the grammar state after the
    committed tokens), so q_{j+1} -- the returned processed logits -- is the masked
    distribution actually sampled from; then `host(x_{j+1}) -> (m_{j+1} uint32 [B,W], stop
    bool [B])` advances the grammar (an io_callback). Also returns the masks m_0..m_k
    uint32 [B,k+1,W] (for the target's p~_0..p~_k) and stop bool [B,k].
    """
    from deepinfer_fn.structured import unpack_bitmask

    def pick(logits, masks, slot):
        if constrain is None:
            return draw(logits, sampling, step, slot)
        allowed = unpack_bitmask(masks, logits.shape[-1])
        return draw(jnp.where(allowed, logits, -jnp.inf), sampling, step, slot)

    def advance(x):
        return constrain[1](x) if constrain is not None else (None, None)

    m0 = None if constrain is None else constrain[0]
    logits, mstate, out = mtp_chunk(params, mstate, streams, next_ids, n_new, depth=depth)
    committed = mstate.lengths
    last = jnp.clip(n_new - 1, 0, streams.shape[1] - 1)
    h = jnp.take_along_axis(out, last[:, None, None, None], axis=1)     # [B,1,n,D]
    x, q = pick(logits, m0, 0)
    m1, stop1 = advance(x)
    if k == 1:
        extra = () if constrain is None else (jnp.stack([m0, m1], 1), stop1[:, None])
        return (x[:, None], q[:, None], mstate) + extra
    active = (n_new > 0).astype(jnp.int32)

    def chain(carry, slot):
        mst, h, x, m = carry
        logits, mst, h = mtp_chunk(params, mst, h, x[:, None], active, depth=depth)
        x, q = pick(logits, m, slot)
        m, stop = advance(x)
        return (mst, h, x, m), (x, q, m, stop)

    (mst, _, _, _), (xs, qs, ms, stops) = jax.lax.scan(chain, (mstate, h, x, m1),
                                                       jnp.arange(1, k))
    drafts = jnp.concatenate([x[:, None], xs.T], axis=1)
    q = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    # The chained entries (positions committed .. committed + k - 2) are speculative.
    mst = dataclasses.replace(mst, lengths=committed)
    if constrain is None:
        return drafts, q, mst
    masks = jnp.concatenate([m0[:, None], m1[:, None], jnp.moveaxis(ms, 0, 1)], axis=1)
    stop = jnp.concatenate([stop1[:, None], stops.T], axis=1)
    return drafts, q, mst, masks, stop


# ------------------------------------------------------------------------------- the Drafter
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
    """The MTP drafter's per-row state: its window ring (`ring`, a one-layer `DecodeState`
    whose lengths are re-derived from the target's at every use) and the pending catch-up
    input: the backbone streams [B,k+1,n,D] of the committed positions it has not processed
    yet, the tokens after them [B,k+1] (the last one is the anchor, filled in at draft time)
    and their count n [B] (the ring holds positions 0..P-n-1 for a target length P)."""

    ring: DecodeState
    streams: jax.Array
    ids: jax.Array
    n: jax.Array


def _resolve(params, weights, num_draft_tokens):
    if weights is not None:
        raise ArgumentError("drafter= is only used with speculative='dspark'")
    k = 3 if num_draft_tokens is None else num_draft_tokens
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ArgumentError(f"num_draft_tokens must be a positive int, got {k!r}")
    if params.config.is_v41:
        raise ArgumentError("speculative='mtp': DeepSeek-V4.1 has no MTP block (its mtp.0..2 "
                            "tensors are the DSpark drafter's stages); use speculative='dspark'")
    if not params["mtp"]:
        raise ArgumentError("speculative='mtp' needs params with an MTP block (these have none)")
    return None, int(k)


def _init_state(params, weights, batch: int, max_len: int, *, window_slots: int, k: int,
                dtype) -> MTPState:
    cfg = params.config
    return MTPState(init_mtp_state(cfg, batch, max_len, window_slots=window_slots, dtype=dtype),
                    jnp.zeros((batch, k + 1, cfg.hc_mult, cfg.hidden_size), dtype),
                    jnp.zeros((batch, k + 1), jnp.int32), jnp.zeros((batch,), jnp.int32))


def _ring_at(state: MTPState, lengths) -> DecodeState:
    return dataclasses.replace(state.ring, lengths=lengths - state.n)


def _prefill(params, weights, state: MTPState, lengths, feats, ids, n_new, next_ids, n_next):
    """The MTP over the chunk's positions whose next token is known; the others stay pending.
    With next_ids (the caller knows the continuation) the chunk's first n_next positions run
    with those tokens (no position is pending before the chunk). Without, a position's next
    token is the chunk's next one: the pending position before the chunk (at most one) and
    all but the chunk's last run, and the last one becomes pending."""
    streams = feats.streams
    S = ids.shape[1]
    last = jnp.clip(n_new - 1, 0, S - 1)
    last_streams = jnp.take_along_axis(streams, last[:, None, None, None], 1)[:, 0]
    ring = _ring_at(state, lengths)
    if next_ids is not None:
        _, ring, _ = mtp_chunk(params, ring, streams, next_ids, n_next)
        pend_here = n_new > n_next
        pend_n = jnp.where(n_new > 0, n_new - n_next, state.n)
    else:
        pend_n = state.n
        pend = state.streams[:, :1].astype(streams.dtype)
        both = jnp.concatenate([pend, streams], axis=1)                     # [B,S+1,n,D]
        nxt = jnp.concatenate([ids, jnp.zeros_like(ids[:, :1])], axis=1)     # [B,S+1]
        idx = jnp.clip(jnp.arange(S + 1)[None] + (1 - pend_n)[:, None], 0, S)
        n_mtp = jnp.where(n_new > 0, n_new - 1 + pend_n, 0)
        _, ring, _ = mtp_chunk(params, ring, jnp.take_along_axis(both, idx[:, :, None, None], 1),
                               jnp.take_along_axis(nxt, idx, 1), n_mtp)
        pend_here = n_new > 0
        pend_n = jnp.where(pend_here, 1, pend_n)
    first = jnp.where(pend_here[:, None, None], last_streams.astype(state.streams.dtype),
                      state.streams[:, 0])
    return MTPState(ring, state.streams.at[:, 0].set(first), state.ids, pend_n)


def _draft(params, weights, state: MTPState, anchor, lengths, sampling, step, active, k: int,
           constrain=None):
    K1 = state.ids.shape[1]
    ids = jnp.where(jnp.arange(K1)[None] == (state.n - 1)[:, None], anchor[:, None], state.ids)
    pending = jnp.where(active, state.n, 0)
    out = draft(params, _ring_at(state, lengths), state.streams, ids, pending, k, sampling, step,
                constrain=constrain)
    new = dataclasses.replace(state, ring=out[2])
    if constrain is None:
        return Draft(out[0], out[1], None, new)
    return Draft(out[0], out[1], None, new, out[3], out[4])


def _commit(params, weights, state: MTPState, feats, tokens, n_emit, lengths, active):
    """The committed positions (streams at the anchor and the accepted drafts, the tokens
    after them) become the next step's catch-up input."""
    keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (old.ndim - 1)),
                                      new.astype(old.dtype), old)
    return MTPState(state.ring, keep(feats.streams, state.streams), keep(tokens, state.ids),
                    jnp.where(active, n_emit, state.n))


def _no_taps(weights) -> dict:
    return {}


# The MTP block as a `Drafter` (no confidence head: fixed verify lengths, or random ones as a
# diagnostic). Its weights are the target's (params["mtp"]): `weights` is None.
DRAFTER = Drafter(name="mtp", resolve=_resolve, taps=_no_taps, init_state=_init_state,
                  prefill=_prefill, draft=_draft, commit=_commit)
