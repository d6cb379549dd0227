"""Speculative decoding (docs/ARCHITECTURE.md "speculative"; docs/MODEL.md (DSpark)).

`drafter`: the drafter interface (`Drafter`: init state, prefill chunk, draft, commit) that the
one speculative step works with; `registry`: method names -> drafters. `loop`: that step
(`speculative_step`: draft -> verify length -> verify forward -> accept -> rollback -> drafter
update, with grammar masks) and the verify-length policy (`VerifyLen`, `verify_policy`).
`mtp`: the V4 MTP block as a drafter with its own window state (k drafts per step, chained on
its own output streams). `dspark`: the DSpark drafter (parallel block backbone with KV
injection of target features, Markov head, confidence head; docs/MODEL.md §D1), its context
state and save/load. `verify`: lossless verification (greedy match; standard speculative
sampling with residual and bonus draws; per-request counter-based keys) and the rollback of
the decode state. `schedule`: the verify-length scheduler, cost profiles, calibration.
The step runs in `generate` (`deepinfer_fn.decoding.speculative`: `generate(...,
speculative="mtp", num_draft_tokens=k)`, `generate(..., speculative="dspark",
drafter=load_dspark(path, params))`) and in the engine (`deepinfer_fn.engine.spec_step`).
"""

from deepinfer_fn.speculative.drafter import Draft, Drafter, Features
from deepinfer_fn.speculative.mtp import draft, init_mtp_state, mtp_chunk
from deepinfer_fn.speculative.verify import rollback, verify
from deepinfer_fn.speculative.dspark import (DSpark, DSparkConfig, DSparkError, default_dspark_path,
                                             init_dspark, load_default_dspark, load_dspark,
                                             save_dspark)

__all__ = ["Draft", "Drafter", "Features", "draft", "init_mtp_state", "mtp_chunk", "rollback",
           "verify", "DSpark", "DSparkConfig", "DSparkError", "default_dspark_path",
           "init_dspark", "load_default_dspark", "load_dspark", "save_dspark"]
