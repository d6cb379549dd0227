"""Speculative decoding (DESIGN.md "speculative"; spec/dspark.md).

`mtp`: the V4 MTP block as a drafter with its own window state (k drafts per step, chained on
its own output streams). `verify`: lossless verification (greedy match; standard speculative
sampling with residual and bonus draws; per-request counter-based keys) and the rollback of
the decode state. `dspark`: the DSpark drafter (parallel block backbone with KV injection of
target features, Markov head, confidence head; spec/dspark.md §1), its context state and
save/load. The decode loops live in `deepinfer_fn.generate`
(`generate(..., speculative="mtp", num_draft_tokens=k)`,
`generate(..., speculative="dspark", drafter=load_dspark(path, params))`).
"""

from deepinfer_fn.speculative.mtp import draft, init_mtp_state, mtp_chunk
from deepinfer_fn.speculative.verify import rollback, verify
from deepinfer_fn.speculative.dspark import (DSpark, DSparkConfig, DSparkError, default_dspark_path,
                                             init_dspark, load_default_dspark, load_dspark,
                                             save_dspark)

__all__ = ["draft", "init_mtp_state", "mtp_chunk", "rollback", "verify", "DSpark", "DSparkConfig",
           "DSparkError", "default_dspark_path", "init_dspark", "load_default_dspark",
           "load_dspark", "save_dspark"]
