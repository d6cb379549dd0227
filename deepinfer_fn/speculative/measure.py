"""Measuring the verify forward's cost on the current device (`measure_verify_cost` ->
`cost.VerifyCost`): the target's `transformer.forward_chunk` over [B, S] tokens of a prefilled
decode state, timed as one device call per forward or inside a device loop."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.decoding.prefill import prefill
from deepinfer_fn.model import transformer
from deepinfer_fn.speculative.cost import VerifyCost
from deepinfer_fn.speculative.verify import rollback
from deepinfer_fn.state import init_state


def measure_verify_cost(params, batches: Sequence[int], gamma: int, *, context: int = 256,
                        repeats: int = 10, warmup: int = 2, seed: int = 0,
                        window_slots: int | None = None, in_loop: int = 0,
                        verbose: bool = False) -> VerifyCost:
    """Times the target's verify forward on the default device (`measure_verify_times` for
    columns 1..gamma+1) and returns `VerifyCost.from_grid` (isotonic fit; raw medians kept).
    in_loop > 0 times it inside a device loop (generate's decode loop); 0 as one device call
    per forward (the engine's steps)."""
    if gamma < 1 or not batches:
        raise ValueError(f"need gamma >= 1 and at least one batch, got {gamma}, {batches}")
    table = measure_verify_times(params, batches, range(1, gamma + 2), context=context,
                                 repeats=repeats, warmup=warmup, seed=seed,
                                 window_slots=window_slots or 0, slack=gamma, in_loop=in_loop,
                                 verbose=verbose)
    return VerifyCost.from_grid([int(b) for b in batches], table,
                                meta=_measure_meta(params, context, repeats, in_loop))


def _measure_meta(params, context, repeats, in_loop=0) -> dict:
    return dict(device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
                context=context, repeats=repeats, dtype=str(jnp.dtype(params.dtype)),
                in_loop=int(in_loop))


def measure_verify_times(params, batches: Sequence[int], columns: Sequence[int], *,
                         context: int = 256, repeats: int = 10, warmup: int = 2, seed: int = 0,
                         window_slots: int = 0, slack: int | None = None, in_loop: int = 0,
                         compile_threads: int | None = None,
                         verbose: bool = False) -> np.ndarray:
    """seconds float64 [len(batches), len(columns)]: median time of the target's verify forward.

    For each batch B: a decode state prefilled with `context` random tokens per row (real
    prefill, so every ring/row is valid), then for each S in `columns` the jitted
    `transformer.forward_chunk(params, state, ids [B,S], n_new=S, all_logits=True)` with the
    state donated and its lengths moved back after each forward (what a rejected verify does).

    in_loop = 0: one jitted call per forward, timed from the host (block_until_ready): what a
    step that is its own device call pays, dispatch and sync included.
    in_loop = n > 0: one jitted call runs n forwards in a `lax.fori_loop` (each followed by the
    rollback, each one's logits reduced by an argmax so none is elided) and reports the call's
    time / n: the cost inside a device-side decode loop (generate's), where no forward pays a
    host round trip. For a small model the two differ by the launch/sync floor.

    All (B, S) programs are compiled first, `compile_threads` at a time (default: all at once;
    XLA compiles release the GIL, and GPU compiles are slow); then each is timed: `warmup` runs,
    then the median of `repeats`. `slack` (default max(columns) - 1): extra window slots, as a
    speculative loop has."""
    cfg = params.config
    columns = [int(c) for c in columns]
    batches = [int(b) for b in batches]
    if not batches or not columns or min(columns) < 1 or min(batches) < 1:
        raise ValueError(f"need batches and columns >= 1, got {batches}, {columns}")
    if in_loop < 0 or repeats < 1 or warmup < 0:
        raise ValueError(f"need in_loop >= 0, repeats >= 1, warmup >= 0, got {in_loop}, "
                         f"{repeats}, {warmup}")
    slack = max(columns) - 1 if slack is None else slack
    if context < 1 or context + max(columns) > cfg.max_position_embeddings:
        raise ValueError(f"context={context} out of range for max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    slots = max(window_slots, cfg.sliding_window + slack)
    fwd = jax.jit(verify_forward_program(max(in_loop, 1), looped=in_loop > 0),
                  donate_argnums=(1,))
    rng = np.random.default_rng(seed)
    states, calls = {}, []
    for B in batches:
        state = init_state(cfg, B, context + max(columns) + 16, window_slots=slots,
                           dtype=params.dtype)
        prompt = rng.integers(2, cfg.vocab_size, size=(B, context)).astype(np.int32)
        _, states[B] = prefill(params, state, prompt, np.full((B,), context, np.int32),
                               min(context, 512))
        for S in columns:
            ids = jnp.asarray(rng.integers(2, cfg.vocab_size, size=(B, S)), jnp.int32)
            calls.append((B, S, ids, jnp.full((B,), S, jnp.int32)))

    def compile_one(call):
        B, S, ids, n_new = call
        return fwd.lower(params, states[B], ids, n_new, states[B].lengths).compile()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=compile_threads or len(calls)) as pool:
        programs = list(pool.map(compile_one, calls))
    if verbose:
        print(f"  verify cost: {len(calls)} programs compiled in {time.perf_counter() - t0:.1f} s",
              flush=True)
    per_call = max(in_loop, 1)
    seconds = {}
    for (B, S, ids, n_new), program in zip(calls, programs):
        state = states[B]
        lengths0 = np.asarray(state.lengths)   # a host copy: the state is donated
        times = []
        for it in range(warmup + repeats):
            rewind = jnp.asarray(lengths0)
            t = time.perf_counter()
            check, state = program(params, state, ids, n_new, rewind)
            check.block_until_ready()
            if it >= warmup:
                times.append((time.perf_counter() - t) / per_call)
            state = rollback(state, jnp.asarray(lengths0))
        states[B] = state
        seconds[B, S] = float(np.median(times))
        if verbose:
            print(f"  verify cost: batch {B:4d} columns {S}: {seconds[B, S] * 1e3:8.3f} ms"
                  f"{f' (in a loop of {in_loop})' if in_loop else ''}", flush=True)
    return np.asarray([[seconds[B, S] for S in columns] for B in batches], np.float64)


def verify_forward_program(n: int, *, looped: bool):
    """fn(params, state, ids [B,S], n_new [B], lengths0 [B]) -> (check, state): n verify forwards
    from the same state (rolled back to lengths0 after each) in a fori_loop (looped), or one
    forward (not looped). `check` int32: the sum of every forward's argmax tokens, so each
    forward's logits are needed, and equal n x the single forward's sum."""

    def one(params, state, ids, n_new):
        logits, state = transformer.forward_chunk(params, state, ids, n_new, all_logits=True)[:2]
        return jnp.sum(jnp.argmax(logits, axis=-1), dtype=jnp.int32), state

    def run(params, state, ids, n_new, lengths0):
        if not looped:
            return one(params, state, ids, n_new)

        def body(_, carry):
            total, st = carry
            check, st = one(params, st, ids, n_new)
            return total + check, rollback(st, lengths0)

        return jax.lax.fori_loop(0, n, body, (jnp.int32(0), state))

    return run

