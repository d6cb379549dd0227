"""Verify-length scheduling for speculative decoding (docs/MODEL.md §D3, §1.5, §2.5): one import
for the modules below.

Each step the drafter proposes g tokens per row with confidence logits z [B,g]; the scheduler
decides how many of them (ell_r, 0 <= ell_r <= g) the target verifies, trading expected
accepted tokens tau = sum_r (1 + sum_{j<=ell_r} a_{r,j}) against the verify forward's cost.

  survival         prefix survivals a_{r,j} from the confidence logits and STS temperatures
  verify_length    the padded [B, S] layout's policy (`padded_verify_len`) and running the
                   verify forward on the chosen columns (`run_with_columns`, `column_buckets`)
  packed_schedule  the packed (ragged) layout's policies (`schedule_sync`, `choose_capacity`,
                   `allocate_topk`)
  cost             `VerifyCost`, the measured verify time vs (rows, columns) or tokens
  measure          `measure_verify_cost` / `measure_verify_times` on the current device
  calibration      STS calibration (`sts_calibrate`, `calibration_report`)
"""

from deepinfer_fn.speculative.survival import sigmoid_np, survivals, survivals_np
from deepinfer_fn.speculative.verify_length import (bucketed_seconds, column_buckets,
                                                    padded_verify_len, run_with_columns,
                                                    verify_columns)
from deepinfer_fn.speculative.cost import VerifyCost, cost_function, flat_cost, isotonic_increasing
from deepinfer_fn.speculative.packed_schedule import (allocate_topk, candidate_order,
                                                      choose_capacity, default_buckets,
                                                      schedule_sync)
from deepinfer_fn.speculative.measure import (measure_verify_cost, measure_verify_times,
                                              verify_forward_program)
from deepinfer_fn.speculative.calibration import (auc, brier, calibration_report,
                                                  default_temperature_grid, ece, prefix_outcomes,
                                                  sts_calibrate)

__all__ = ["sigmoid_np", "survivals", "survivals_np", "bucketed_seconds", "column_buckets",
           "padded_verify_len", "run_with_columns", "verify_columns", "VerifyCost",
           "cost_function", "flat_cost", "isotonic_increasing", "allocate_topk",
           "candidate_order", "choose_capacity", "default_buckets", "schedule_sync",
           "measure_verify_cost", "measure_verify_times", "verify_forward_program", "auc",
           "brier", "calibration_report", "default_temperature_grid", "ece", "prefix_outcomes",
           "sts_calibrate"]
