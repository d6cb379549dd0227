"""Speculative decoding (DESIGN.md "speculative"; spec/dspark.md).

`mtp`: the V4 MTP block as a drafter with its own window state (k drafts per step, chained on
its own output streams). `verify`: lossless verification (greedy match; standard speculative
sampling with residual and bonus draws; per-request counter-based keys) and the rollback of
the decode state. The decode loop lives in `deepinfer_fn.generate`
(`generate(..., speculative="mtp", num_draft_tokens=k)`).
"""

from deepinfer_fn.speculative.mtp import draft, init_mtp_state, mtp_chunk
from deepinfer_fn.speculative.verify import rollback, verify

__all__ = ["draft", "init_mtp_state", "mtp_chunk", "rollback", "verify"]
