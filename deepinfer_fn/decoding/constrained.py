"""Constrained plain decoding: `decode_block` under per-step grammar masks.

Each step samples under the packed allowed-token masks of the rows' matchers, then one host
callback (`structured.host_step`) advances the matchers with the sampled tokens and returns the
next step's masks and the rows whose constraint finished. A constraint that failed to compile
leaves its row done from the start with status "error: ..."; the others are unaffected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn import structured
from deepinfer_fn.api import mesh_context
from deepinfer_fn.decoding.output import GenerateOutput
from deepinfer_fn.decoding.plain import decode_block, feeds_last_token


def constrained_blocks(params, state, logits, done, sampling, pad, constrained, *, B,
                       max_new_tokens, block, stops, width, return_logprobs):
    """`plain.plain_blocks` under per-step host masks of `constrained` (a
    `structured.ConstrainedBatch`): rows [0, B) are the requests, any further rows mesh
    padding (free, already done)."""
    constrained.pad_rows(done.shape[0])
    masks, failed = constrained.initial()
    done = done | jnp.asarray(failed)  # a constraint that failed to compile: the row never runs
    masks, sid = jnp.asarray(masks), jnp.int32(structured.register(constrained))
    try:
        produced = 0
        while produced < max_new_tokens:
            n = min(block, max_new_tokens - produced)
            last = produced + n >= max_new_tokens
            with mesh_context(params)[1]:
                out, logp, count, state, logits, done, masks = decode_block(
                    params, state, logits, done, sampling, pad, masks, sid, n=width,
                    stops=stops, limit=np.int32(n),
                    feed_last=feeds_last_token(max_new_tokens, block))
            produced += n
            # waits for the block: the matchers are up to date
            out_h, count_h, done_h, logp_h = jax.device_get((out, count, done, logp))
            done_host = done_h[:B]
            final = last or bool(done_host.all())
            status = tuple(st if st is None or final or done_host[b] else "pending"
                           for b, st in enumerate(constrained.statuses()[:B]))
            yield GenerateOutput(out_h[:B, :n], count_h[:B], done_host,
                                 logp_h[:B, :n] if return_logprobs else None, status)
            if final:
                return
    finally:
        structured.unregister(int(sid))
