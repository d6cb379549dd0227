"""speculative="dspark" for both target families: a `Drafter` that runs the V4 drafter
(`speculative.dspark`, weights a `DSpark`) or the V4.1 checkpoint drafter
(`speculative.dspark_v41`, weights a `DSparkV41`).

`resolve` picks by the target config (V4.1: drafter=None means the params' own mtp stages);
every later call picks by the type of the resolved weights, which is fixed at trace time.
"""

from __future__ import annotations

from deepinfer_fn.speculative import dspark, dspark_v41
from deepinfer_fn.speculative.drafter import Drafter


def _impl(weights) -> Drafter:
    return dspark_v41.DRAFTER if isinstance(weights, dspark_v41.DSparkV41) else dspark.DRAFTER


def _resolve(params, weights, num_draft_tokens):
    kind = dspark_v41.DRAFTER if params.config.is_v41 else dspark.DRAFTER
    return kind.resolve(params, weights, num_draft_tokens)


def _taps(weights):
    return _impl(weights).taps(weights)


def _init_state(params, weights, *args, **kwargs):
    return _impl(weights).init_state(params, weights, *args, **kwargs)


def _prefill(params, weights, *args):
    return _impl(weights).prefill(params, weights, *args)


def _draft(params, weights, *args, **kwargs):
    return _impl(weights).draft(params, weights, *args, **kwargs)


def _commit(params, weights, *args):
    return _impl(weights).commit(params, weights, *args)


def _sts_temperatures(weights):
    return _impl(weights).sts_temperatures(weights)


DRAFTER = Drafter(name="dspark", resolve=_resolve, taps=_taps, init_state=_init_state,
                  prefill=_prefill, draft=_draft, commit=_commit, confidence=True,
                  sts_temperatures=_sts_temperatures)
