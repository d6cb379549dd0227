"""The offline engine: many requests, continuous batching, paged state, prefix cache
with SWA bounded replay, asynchronous scheduling, metrics, progress.

    engine = Engine(params, max_batch=16, max_tokens_per_step=512)
    outs = engine.generate([[1, 2, 3], Request([4, 5], max_new_tokens=8, temperature=0.7)])
    for ev in engine.stream(requests): ...          # StreamEvent per newly known tokens

Each step: the host `Scheduler` picks decode rows and chunked-prefill rows under
`max_tokens_per_step`, allocates pages (evicting cache leaves, preempting by recompute when the
pool is full); the device runs one `step.substep` per sub-batch (prefill [rows, width] from a
few compiled shapes, decode [Db, 1] from a few bucket sizes) with the state donated.

Several decode steps per device call (`decode_steps`, default 8): while no request is
prefilling, none could be admitted and none is constrained, a decode sub-batch runs up to
`decode_steps` steps in one device loop (`step.decode_steps_packed`; speculative engines:
`spec_step.spec_decode_packed(steps=)`), each row as many as it may still sample, so the host
schedules, packs and collects once per K tokens. While requests wait for a slot, they are
admitted in batches (`admit_batch` free slots, or a free slot that has waited `decode_steps`
steps) and K stops where the next batch's slots free (running requests reaching
max_new_tokens), so a waiting request waits at most `decode_steps` steps longer than with one
step per call. A row that samples a stop token
inside a block runs to the block's end on the device; the host discards those tokens (as for
the asynchronous lag below). Tokens are those of one step per call (same positions, same
counter-based keys); `decode_steps=1` restores one step per call. On a GPU such a call loops
a fixed count (`decode_loop="fixed"`: 1, 2, 4, .. or decode_steps, rows past their count
masked), since XLA:GPU reads a data-dependent loop condition on the host every iteration and
the call would not return before its loop ends: the host could not prepare the next step
meanwhile.

Asynchronous scheduling (default): step s is dispatched, then the host reads step s-1's tokens
and prepares step s+1 while the device runs step s; decode inputs stay on the device
(`PagedState.last_token`), so only stop detection lags by one step (the extra token of a
finished row is discarded). After a step that only prefills (short on the device) the host
issues the next step before reading step s-1, so the device does not wait while the host
applies a finishing wave's results. `async_scheduling=False` waits for every step before
preparing the next. The two modes give the same tokens whenever a row's result does not depend
on its batch neighbours (tested in f32 on CPU; the one-step lag changes batch compositions, so
bf16 on a GPU is only guaranteed identical under batch-invariant numerics).

Prefix cache (`prefix_cache=True`): full prompt blocks are inserted into a radix tree as soon as
the step that completes them is dispatched; an admitted request sharing a cached prefix of h
tokens (page-aligned) reuses those pages and rebuilds its window ring and compressor rings by
replaying the `replay_tokens` (R, default 128) tokens before h with the shared rows kept
(docs/MODEL.md §7, "bounded replay"; approximate: replayed positions see a truncated window).
`replay_tokens=None` is the exact mode: the replay starts at position 0 (identical tokens to no
cache; only the row pool is shared, no prefill saved).

Design notes / deviations from the suggested design:
* Exact mode recomputes from position 0 instead of restoring a stored window snapshot at the
  page boundary: no extra per-block storage (the ~45 KB/token the architecture avoids, §7).
* Rows written after a bounded-replay hit (and cached in turn) inherit its approximation (the
  "leak" of docs/MODEL.md §V4.3); a preempted request resumes through the cache too, so with
  the cache on and sequences longer than R its continuation is approximate. Use
  `replay_tokens=None` or `prefix_cache=False` for exactness.
* A step is two device calls (prefill, decode), not one fused program: compiled shapes grow as
  (#prefill shapes + #decode buckets) rather than their product; both are issued back to back.

On a mesh (params placed by `shardings.shard_params(params, make_mesh(dp=, ep=))`): requests
are spread over the n = dp x ep batch shards of attention. Each shard owns max_batch / n slots
(max_batch a multiple of n), its own pool of `num_pages` pages (per shard) and its own prefix
cache; a request is assigned to a shard at admission (a prefix-cache hit first, then load:
free slots, running tokens, free pages) and stays there (a preempted request resumes in the
shard of its cached blocks when they are still there). Every sub-batch has n row blocks, block
i holding shard i's rows (prefill rows and decode buckets are multiples of n); the gathers and
scatters of slots and pages run per shard (`step.take_slots` / `gather_state`, a
`jax.shard_map` over the batch axes), the forward between them is the auto-sharded one (routed
experts over `ep`). Tokens equal the single-device engine's (f32, tested). Speculative engines
work on a mesh too (`PagedState.spec` split by slot like the rings), and so do `prefill`
exports and `RequestState` imports (page ids offset to the shard's block of the pool axis).

Structured output (`Request(constraint=Regex | JsonSchema | Grammar)`, deepinfer_fn/structured.py):
the constraint is compiled on the host at submission against the engine's `tokenizer` (a bad
regex / schema / grammar finishes that request alone with finish_reason "error" and the message).
A sub-batch that samples for a constrained row is split in two device calls: `forward_packed`
(dispatched with the rest of the step, asynchronously) and `sample_packed` (a small jitted
masked sampler: packed allowed-token bits uint32 [B, ceil(V/32)], all-ones for free and padding
rows, unpacked and applied inside). A constrained row's mask for step s+1 needs its token of
step s, which the host learns one step late; so the engine dispatches step s+1's forward, then
reads step s's tokens (the matchers consume them in `commit_results`), packs step s+1's masks
and dispatches its sampling. What overlaps: the host's mask work (consume + llguidance masks)
and the previous step's bookkeeping run while the device runs step s+1's forward; the device
waits for the host only between that forward and its sampling call (the masks' host -> device
copy included), and the next step's forward is issued only after the sampling call. Sub-batches
without a constrained sampling row keep the fused `substep_packed` (free requests in the same
engine run sample exactly as without constrained ones: all-ones masks change no logit). A
constrained row may emit EOS only once its matcher accepts (the mask says so); it finishes when
the constraint completes (EOS consumed, finish_reason "stop"); `RequestOutput.constraint_status`
is "complete" / "incomplete" (max_new_tokens or a stop token came first) / "error".

Speculative decoding (`Engine(..., speculative="dspark", drafter=d)` or `speculative="mtp",
num_draft_tokens=k`; docs/MODEL.md §D2-§4): every decode sub-batch is ONE jitted device call
(`spec_step.spec_decode_packed`) that drafts (DSpark block of γ from the slot's context rings, or
the MTP chain of k), picks each row's verify length (verify_len "fixed": every draft the row's
budget allows, min(γ, left - 1), so the device never emits past max_new_tokens; "dynamic":
`schedule.padded_verify_len` from the confidences and the `verify_cost` profile at the
sub-batch's bucket size; the forward runs on 1 + max(ell) columns rounded up to a compiled
`verify_widths` entry), verifies [anchor, drafts] through the paged state, accepts with
`spec.verify` (lossless: greedy match / standard speculative sampling), rolls back by moving the
slot's committed length (window_slots >= sliding_window + γ), feeds the committed positions to
the drafter (DSpark `push` of the tapped features; MTP pending catch-up inputs), and returns per
row up to γ+1 tokens, their count, logprobs and the accepted / verified counts. Per slot on the
device (`PagedState.spec`): committed length, last token, token budget, the request-local step
counter of the counter-based draft/accept/final keys (so each request reproduces
`generate(..., speculative=...)`'s random streams exactly, whatever its batch), and the drafter
state. The host never waits for a row's position: it tracks an upper bound (+γ+1 per in-flight
step, capped at prompt + max_new_tokens - 1) to allocate pages and resets it to the exact length
when the step's results arrive (asynchronous scheduling keeps working). A decode row costs γ+1
tokens of max_tokens_per_step. Tokens after a stop token are discarded on the host.
Prefill sub-steps (`spec_prefill_packed`) also fill the drafter state (DSpark: taps -> push;
MTP: the MTP over the chunk's positions whose next token is known); a request's final chunk
initialises its counters. Prefix-cache hits replay from h - R, so the drafter's rings are
refilled from the replayed tokens too: exact when R >= the drafter's window (DSpark window /
sliding_window for MTP; default R = 128 = both windows of the default model) or in exact mode
(replay_tokens=None); with a smaller R the drafter sees a truncated context (weaker drafts,
still lossless w.r.t. the target). A preempted request resumes by re-prefilling prompt +
generated[:-1] (no sampling) with generated[-1] as its anchor and its step counter kept, so it
continues exactly as if never preempted. Constrained requests (Request(constraint=...)) in a
speculative engine are not speculated: they wait until the speculative requests of the call are
done, then run as plain masked decoding (the constrained path above; one-token decode rows, the
engine's plain sub-step programs, compiled on first use). Their tokens are the plain engine's;
only their latency suffers (no overlap with the speculative phase). Metrics: RunMetrics.mean_verify_len,
acceptance_rate, tau (tokens committed per row per verify step, bonus included),
all_accepted_tokens_per_s (row-steps x (1 + γ) / wall, spec §4.2's "1 + γ" figure) next to the
real throughput_tokens_per_s; RequestMetrics.verified / accepted per step.

DeepSeek-V4.1 (`cfg.is_v41`, docs/MODEL.md §V3-V4): the slots hold `V41DecodeState`'s rings
(window rings on every layer, the code-2 sources' kappa / gate rings, a token ring per slot for
Engram's n-gram history) and the pools the kv sources' latents and index keys (16-token pages
by default). A prefix-cache hit keeps the cached latents / index keys below h and rebuilds the
rings (token ring included) by replaying from h - R (rounded down to an even position: code-2
pairs; R >= engram_max_ngram_size - 1 is required), as `model.replay_v41.replay_logits`.
Decoder SWA bounded replay (`decoder_swa_bounded_replay`, default on for V4.1 engines, plain and
speculative, refused for V4): every prefill extend runs `replay_v41.extend`, the late layers
(from the last kv source) and the head on the last sliding_window rows of the chunk only;
decode steps and speculative verify chunks run every row. A speculative prefill sub-step's
drafter sees the chunk's tail rows (`replay_v41.tail_extend`, as generate's speculative
prefill), all its window context holds. Outputs then depend on the prefill chunking (what
`replay_v41.prefill_logits` with the same chunks computes). Since late-layer window KV exists
only for past tails, a hit then re-prefills at least the last sliding_window matched tokens
(replay span max(R, W), a tail-mode extend from h - that span, latents below h kept).
`decoder_swa_bounded_replay=False` is `generate`'s exact prefill. Speculative V4.1 engines
(speculative="dspark": the params' own mtp stages, `speculative.dspark_v41`) run the generic
speculative sub-steps over the same paged state; MTP is refused for V4.1.

Prefill / decode separation (engine/transfer.py): `Engine.prefill(requests)` returns each
request's state after its prefill and first token as a `RequestState` (host arrays); `generate` /
`stream` of another engine with the same model config, page_size, window_slots, dtype and
speculative method take such states as items and decode them (same tokens as one engine).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import queue
import threading
import time
from typing import Iterable, Iterator

import jax
import numpy as np

from deepinfer_fn.compile_cache import Job, precompile
from deepinfer_fn.engine.pages import PageAllocator
from deepinfer_fn.engine.paged_state import (check_page_size, compression_ratios,
                                             init_paged_state, shard_axes)
from deepinfer_fn.engine.radix import RadixCache
from deepinfer_fn.engine.request import (RequestMetrics, RequestOutput, as_request,
                                          validate)
from deepinfer_fn.engine.scheduler import (PACK_HEAD, Scheduler, Seq, StepPlan,
                                            buckets_up_to, default_admit_batch)
from deepinfer_fn.engine.spec_step import (init_spec_slots, schedule_args, spec_decode_packed,
                                           spec_prefill_packed)
from deepinfer_fn.engine.step import (decode_steps_packed, fixed_trip_counts, forward_packed,
                                      sample_packed, substep_packed)
from deepinfer_fn.engine import transfer
from deepinfer_fn.decoding.checks import check_bounded_replay
from deepinfer_fn import bundle
from deepinfer_fn.params import Params, count_params
from deepinfer_fn.speculative import registry
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.validate import boolean, non_negative_int, one_of, positive_int
# Module import (attributes read at call time): shardings/__init__ imports deepinfer_fn.
from shardings import mesh as mesh_rules


@dataclasses.dataclass
class StreamEvent:
    """New tokens of one request (`tokens` = those not reported before); `output` is the final
    RequestOutput when the request finished with this event, else None."""

    request_id: object
    index: int
    tokens: list[int]
    output: RequestOutput | None = None


@dataclasses.dataclass
class RunMetrics:
    """Per `generate`/`stream` call. throughput = generated tokens / wall seconds;
    mean_decode_occupancy = mean decode rows per step / max_batch; decode_calls = device
    calls that decoded, mean_decode_steps = decode steps per such call (`decode_steps`);
    prefill_tokens_saved =
    prompt positions not computed thanks to the prefix cache (hits minus replay);
    prefill_flops_saved ~ 2 x active parameters x saved tokens (matmul FLOPs; attention
    scores excluded). Idle figures only with Engine(measure_idle=True): device idle between
    consecutive steps = max(0, start of issuing step s+1 - completion of step s), summed over
    steps whose shapes were already compiled; idle_fraction = that idle time / (idle + device busy
    time of those steps)."""

    requests: int = 0
    wall_s: float = 0.0
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    cache_hit_tokens: int = 0
    replayed_tokens: int = 0
    prefill_tokens_saved: int = 0
    prefill_flops_saved: float = 0.0
    preemptions: int = 0
    mean_decode_occupancy: float = 0.0
    decode_calls: int = 0
    mean_decode_steps: float = 0.0
    throughput_tokens_per_s: float = 0.0
    idle_total_s: float = float("nan")
    idle_mean_s: float = float("nan")
    idle_steps_measured: int = 0
    idle_fraction: float = float("nan")
    # speculative engines (docs/MODEL.md §D4.1; NaN / 0 otherwise): spec_row_steps = verify
    # steps summed over rows; spec_verified / spec_accepted = drafts verified / accepted in
    # them; spec_committed = tokens they committed (g + 1 each, the bonus included, before the
    # host's truncation at a stop token); mean_verify_len = spec_verified / spec_row_steps;
    # acceptance_rate = spec_accepted / spec_verified; tau = spec_committed / spec_row_steps;
    # all_accepted_tokens_per_s = spec_row_steps x (1 + γ) / wall (the "1 + γ" figure,
    # §4.2: what the throughput would be if every draft were accepted, next to the real
    # throughput_tokens_per_s); verified_tokens_per_s = (spec_row_steps + spec_verified) / wall.
    spec_row_steps: int = 0
    spec_verified: int = 0
    spec_accepted: int = 0
    spec_committed: int = 0
    mean_verify_len: float = float("nan")
    acceptance_rate: float = float("nan")
    tau: float = float("nan")
    all_accepted_tokens_per_s: float = float("nan")
    verified_tokens_per_s: float = float("nan")


@dataclasses.dataclass(eq=False)
class _RunIds:
    """The request ids of one `generate` / `stream` call and the cancels aimed at them."""

    ids: frozenset
    cancelled: set = dataclasses.field(default_factory=set)


def _prefill_only(plan: StepPlan, outs: list) -> bool:
    """A dispatched step that only prefills, with no constrained row (whose sampling on the
    host needs every earlier result applied first)."""
    return bool(plan.prefill) and not plan.decode and all(e[1] is not None for e in outs)


class _IdleWatcher:
    """Records when each dispatched step's outputs become ready (a background thread), next to
    when the host began issuing the step's device calls."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.records: list[tuple[float, float, bool]] = []   # (dispatched, ready, compiled)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            arrays, t_dispatch, compiled = item
            jax.block_until_ready(arrays)
            self.records.append((t_dispatch, time.perf_counter(), compiled))

    def close(self):
        self.q.put(None)
        self.thread.join()

    def idle(self) -> tuple[float, int, float]:
        """(idle seconds, steps measured, busy seconds) over consecutive compiled steps: step
        s+1 idles max(0, dispatch - ready of s) and is busy from max(dispatch, ready of s) to
        its own ready."""
        total, n, busy = 0.0, 0, 0.0
        for (d0, r0, c0), (d1, r1, c1) in zip(self.records, self.records[1:]):
            if c0 or c1:
                continue
            total += max(0.0, d1 - r0)
            busy += max(0.0, r1 - max(d1, r0))
            n += 1
        return total, n, busy


class Engine:
    """Offline engine over `params` (see the module docstring).

    max_batch: slots (requests running at once; on a mesh a multiple of dp x ep, see the module
    docstring); max_tokens_per_step: token budget of one step
    (decode rows count 1, prefill rows their chunk's real tokens); page_size: tokens per page
    (a multiple of every compression ratio; default their lcm); max_len: context limit per
    request (rounded up to pages; default min(4096, max_position_embeddings)); num_pages: pool
    size, per batch shard on a mesh (default: enough for max_batch full-length requests, on a
    mesh max_batch / n per shard, i.e. no preemption);
    prefill_chunk: the widest prefill row (default min(256, max_tokens_per_step));
    prefill_shapes: the (rows, width) prefill sub-batch shapes to compile; each step uses the
    one that moves the most prompt tokens under the budget (default: (1, chunk) and, for
    widths chunk and chunk // 4, (budget // width rows, width)); decode_buckets: decode row
    counts to compile (default powers of two up to max_batch). Every shape is one compiled
    sub-step (`warmup()` compiles them all up front).
    prefix_cache, replay_tokens (None = exact mode): module docstring; decode_steps: the most
    decode steps one device call runs (module docstring); decode_loop: "dynamic" (a
    multi-step decode call, plain or speculative, loops max(n_b) times: one compiled program
    per decode bucket) or "fixed" (it loops a fixed count, the smallest of
    `step.fixed_trip_counts(decode_steps)` >= max(n_b), rows past their n_b masked: a loop of
    known trip count, which XLA:GPU issues without a host read per iteration, so the call
    returns at once; one program per count and bucket); default: "fixed" on a GPU, else
    "dynamic" (on a CPU the masked iterations cost more than the host reads save);
    admit_batch: while other requests decode, waiting ones are admitted once this many slots
    are free, or once a free slot has waited `decode_steps` steps (1: at once; default 1, and
    `scheduler.default_admit_batch(max_batch)` for a speculative engine), so admissions and
    their prefill come in batches and decode calls stay longer when requests finish at
    staggered steps (speculative decoding, stop tokens);
    async_scheduling: on by default; progress: a tqdm bar; measure_idle: record device idle
    time between steps;
    params: `Params`, or a `Model` bundle (`load_model`) whose tokenizer and DSpark drafter are
    the defaults of `tokenizer=` and `drafter=`.
    tokenizer: the `text.Tokenizer` constraints compile against (default: the bundle's, else
    the V4 vocabulary where the model's holds it, loaded at the first constrained request).

    speculative: None, "dspark" (drafter: a `speculative.DSpark` for this target, γ its block
    size; num_draft_tokens, if given, must equal γ) or "mtp" (the params' MTP block drafts
    num_draft_tokens = k tokens, default 3). verify_len: "fixed" (verify every draft the
    budget allows) or "dynamic" (DSpark only; verify_cost: a `speculative.schedule.VerifyCost`
    profile, read at each decode bucket's size); verify_widths: the verify forward's column
    counts compiled (ascending, ending at 1 + γ; default (1 + γ,) for "fixed" and, for
    "dynamic", per decode bucket the widths where the profile gets cheaper,
    `schedule.column_buckets`, as generate does); each step runs 1 + max(ell) columns rounded
    up to one of them (the dynamic scheduler sees the rounded cost). Fixed and dynamic engines
    with the same shapes and widths share one compiled decode step. See the module
    docstring, "Speculative decoding".

    decoder_swa_bounded_replay: V4.1 decoder SWA bounded replay on prefill extends (module
    docstring); None = on for a V4.1 engine (plain or speculative) whose layers allow it, off
    otherwise; True needs a V4.1 model.
    """

    def __init__(self, params: Params | bundle.Model, *, max_batch: int = 16, max_tokens_per_step: int = 512,
                 page_size: int | None = None, max_len: int | None = None,
                 num_pages: int | None = None, prefill_chunk: int | None = None,
                 prefill_shapes=None, decode_buckets=None, prefix_cache: bool = True,
                 replay_tokens: int | None = 128, async_scheduling: bool = True,
                 window_slots: int | None = None, progress: bool = True,
                 measure_idle: bool = False, tokenizer=None, speculative: str | None = None,
                 drafter=None, num_draft_tokens: int | None = None, verify_len: str = "fixed",
                 verify_cost=None, verify_widths=None, decode_steps: int = 8,
                 decode_loop: str | None = None, admit_batch: int | None = None,
                 decoder_swa_bounded_replay: bool | None = None):
        params, drafter, tokenizer = bundle.unpack(params, speculative=speculative,
                                                   drafter=drafter, tokenizer=tokenizer,
                                                   where="Engine")
        cfg = params.config
        self.params, self.cfg = params, cfg
        self.mesh = mesh_rules.mesh_of(params)       # None: one device
        n = self.shards = mesh_rules.batch_shards(self.mesh) if self.mesh is not None else 1
        ratios = compression_ratios(cfg)
        if page_size is None:       # V4.1: codes 1 and 2, 16-token pages
            page_size = math.lcm(16, *ratios) if cfg.is_v41 else (math.lcm(*ratios) if ratios
                                                                  else 16)
        check_page_size(cfg, page_size)
        for name, v in (("max_batch", max_batch), ("max_tokens_per_step", max_tokens_per_step),
                        ("decode_steps", decode_steps)):
            positive_int("Engine", name, v)
        for name, v in (("max_len", max_len), ("num_pages", num_pages),
                        ("prefill_chunk", prefill_chunk), ("window_slots", window_slots),
                        ("admit_batch", admit_batch)):
            if v is not None:
                positive_int("Engine", name, v)
        if max_batch % n:
            raise ArgumentError(f"Engine: max_batch={max_batch} must be a multiple of the mesh's "
                                f"{n} batch shards (dp x ep)")
        if replay_tokens is not None:
            non_negative_int("Engine", "replay_tokens", replay_tokens)
        if decode_loop is None:     # a loop of known trip count is what keeps a GPU busy
            platform = (self.mesh.devices.flat[0] if self.mesh is not None
                        else jax.devices()[0]).platform
            decode_loop = "fixed" if platform in ("gpu", "cuda", "rocm") else "dynamic"
        one_of("Engine", "decode_loop", decode_loop, ("dynamic", "fixed"))
        self.decode_loop = decode_loop
        for name, v in (("prefix_cache", prefix_cache), ("async_scheduling", async_scheduling),
                        ("progress", progress), ("measure_idle", measure_idle)):
            boolean("Engine", name, v)
        one_of("Engine", "verify_len", verify_len, ("fixed", "dynamic"))
        if window_slots is not None and window_slots < cfg.sliding_window:
            raise ArgumentError(f"Engine: window_slots={window_slots} must be >= the model's "
                                f"sliding_window={cfg.sliding_window}")
        max_len = max_len or min(4096, cfg.max_position_embeddings)
        if max_len > cfg.max_position_embeddings:
            raise ArgumentError(f"max_len={max_len} > max_position_embeddings={cfg.max_position_embeddings}")
        max_pages = -(-max_len // page_size)
        # per shard (one shard: the whole engine): slots, pages
        slots = max_batch // n
        num_pages = num_pages or slots * max_pages + 1
        chunk = min(prefill_chunk or 256, max_tokens_per_step)
        if prefill_shapes is None:
            widths = sorted({chunk, max(16, chunk // 4)})
            rows_of = lambda r: n * -(-r // n)      # rounded up to whole rows per shard
            prefill_shapes = {(n, chunk)} | {
                (rows_of(min(max_batch, max(1, max_tokens_per_step // w))), w) for w in widths}
        prefill_shapes = tuple(sorted((int(r), int(w)) for r, w in prefill_shapes))
        if not prefill_shapes or any(r < 1 or w < 1 or r > max_batch or r % n
                                     for r, w in prefill_shapes):
            raise ArgumentError(f"prefill_shapes {prefill_shapes}: (rows, width) pairs with "
                             f"1 <= rows <= max_batch={max_batch}"
                             + (f", rows a multiple of the {n} batch shards" if n > 1 else ""))
        decode_buckets = tuple(sorted(decode_buckets or tuple(
            n * b for b in buckets_up_to(min(slots, max_tokens_per_step)))))
        if decode_buckets[-1] < n * min(slots, max_tokens_per_step):
            raise ArgumentError(f"decode_buckets {decode_buckets} must reach "
                             f"min(max_batch, max_tokens_per_step)" if n == 1 else
                             f"decode_buckets {decode_buckets} must reach {n} batch shards x "
                             f"min(max_batch / {n}, max_tokens_per_step)")
        if any(b % n for b in decode_buckets):
            raise ArgumentError(f"decode_buckets {decode_buckets} must be multiples of the "
                                f"mesh's {n} batch shards")
        gamma = self._check_speculative(speculative, drafter, num_draft_tokens, verify_len,
                                        verify_cost)
        if gamma and max_tokens_per_step < gamma + 1:
            raise ArgumentError(f"max_tokens_per_step={max_tokens_per_step} must be >= 1 + γ = "
                             f"{gamma + 1} (a speculative decode row verifies up to 1 + γ tokens)")
        if gamma:       # rejected drafts must not overwrite live ring entries (state.py)
            window_slots = max(window_slots or 0, cfg.sliding_window + gamma)
        bounded = check_bounded_replay(cfg, decoder_swa_bounded_replay, "Engine")
        if replay_tokens is not None and not cfg.is_v41 and replay_tokens < cfg.csa_ratio:
            raise ArgumentError(f"replay_tokens={replay_tokens} must be >= the CSA ratio "
                             f"{cfg.csa_ratio} (the first row after a hit pools the window before it)")
        history = cfg.engram_max_ngram_size - 1 if cfg.is_v41 and cfg.engram_layer_ids else 0
        if replay_tokens is not None and replay_tokens < history:
            raise ArgumentError(f"replay_tokens={replay_tokens} must be >= "
                                f"engram_max_ngram_size - 1 = {history} (a V4.1 hit rebuilds "
                                "Engram's n-gram history from the replayed tokens)")
        self.decoder_swa_bounded_replay = bounded
        self._tail = cfg.sliding_window if bounded else None    # prefill extends' tail rows
        sched_replay = replay_tokens
        if bounded and replay_tokens is not None:   # late-layer window KV only of past tails:
            sched_replay = max(replay_tokens, cfg.sliding_window)   # re-prefill >= W tokens
        codes = ratios if cfg.is_v41 else ()
        self.max_batch, self.page_size, self.max_len = max_batch, page_size, max_pages * page_size
        self.async_scheduling, self.progress = async_scheduling, progress
        self.measure_idle = measure_idle
        self.replay_tokens, self.use_cache = replay_tokens, prefix_cache
        self.prefill_shapes, self.decode_buckets = prefill_shapes, decode_buckets
        # one page allocator and prefix cache per batch shard (self.pages / self.cache:
        # shard 0's, the only ones without a mesh)
        self.shard_pages = [PageAllocator(num_pages) for _ in range(n)]
        self.shard_caches = [RadixCache(page_size, p) if prefix_cache else None
                             for p in self.shard_pages]
        self.pages, self.cache = self.shard_pages[0], self.shard_caches[0]
        self.scheduler = Scheduler(max_batch=max_batch, max_tokens_per_step=max_tokens_per_step,
                                   prefill_shapes=prefill_shapes, page_size=page_size,
                                   max_pages=max_pages, pages=self.shard_pages,
                                   cache=self.shard_caches, replay_tokens=sched_replay,
                                   spec_width=gamma + 1 if gamma else 0,
                                   decode_steps=decode_steps, shards=n,
                                   replay_align=2 if 2 in codes else 1,
                                   step_counts=(fixed_trip_counts(decode_steps)
                                                if decode_loop == "fixed" else None),
                                   admit_batch=admit_batch or (default_admit_batch(max_batch)
                                                              if gamma else 1))
        self.state = init_paged_state(cfg, max_batch=max_batch, num_pages=n * num_pages,
                                      page_size=page_size, max_pages=max_pages,
                                      dtype=params.dtype, window_slots=window_slots)
        self.speculative, self.gamma = speculative, gamma
        self._spec_on = bool(gamma)         # False while a speculative engine runs constrained
        self.verify_len = verify_len
        self._verify = {}                   # decode bucket -> (VerifyLen, sched)
        if gamma:
            self.state = dataclasses.replace(self.state, spec=init_spec_slots(
                params, self._kind, self.drafter, max_batch=max_batch,
                max_len=self.state.max_len, window_slots=self.state.window_slots, k=gamma))
            widths = self._check_widths(verify_widths, gamma)
            for b in decode_buckets:
                self._verify[b] = schedule_args(self._kind, self.drafter, gamma, verify_len,
                                                verify_cost, b, widths)
        elif verify_widths is not None:
            raise ArgumentError("verify_widths needs speculative='dspark' or 'mtp'")
        if self.mesh is not None:       # slots and pages split over the batch shards
            self.state = jax.device_put(self.state, mesh_rules.batch_split_shardings(
                shard_axes(self.state), self.mesh))
        self._active_params = count_params(cfg)["active"]
        self._tokenizer = tokenizer
        self._watch = None                  # (t_issue, compiled) of a step awaiting its sampling
        self._cancel_lock = threading.Lock()
        self._runs: list[_RunIds] = []      # submitted runs not yet ended (cancel targets)
        self._ended_ids: set = set()        # ids of requests of ended runs (cancel: no-op)
        self._shapes_seen: set = set()
        self.last_run = RunMetrics()

    @staticmethod
    def _check_widths(widths, gamma):
        if widths is None:
            return None
        w = tuple(int(x) for x in widths)
        if not w or list(w) != sorted(set(w)) or w[0] < 1 or w[-1] != gamma + 1:
            raise ArgumentError(f"verify_widths {widths} must be ascending distinct column counts "
                             f"in 1..{gamma + 1} ending at 1 + γ = {gamma + 1}")
        return w

    def _check_speculative(self, speculative, drafter, k, verify_len, verify_cost) -> int:
        """Validates the speculative arguments (sets the drafter: `self._kind`, its weights
        `self.drafter`); returns γ (drafts per step) or 0."""
        self._kind, self.drafter = None, drafter
        if speculative is None:
            if drafter is not None or k is not None or verify_cost is not None:
                raise ArgumentError("drafter / num_draft_tokens / verify_cost need speculative="
                                 "'dspark' or 'mtp'")
            return 0
        from deepinfer_fn.speculative.loop import check_confidence
        kind = registry.get(speculative)
        if verify_len not in ("fixed", "dynamic"):
            raise ArgumentError(f"verify_len must be 'fixed' or 'dynamic', got {verify_len!r}")
        if verify_len == "fixed" and verify_cost is not None:
            raise ArgumentError("verify_cost is only used with verify_len='dynamic'")
        self.drafter, k = kind.resolve(self.params, drafter, k)
        if verify_len == "dynamic":
            check_confidence(kind)
        self._kind = kind
        return k

    # ------------------------------------------------------------------ public
    def generate(self, requests: Iterable, *, max_new_tokens: int = 16) -> list[RequestOutput]:
        """One RequestOutput per request, in order. Items: token-id sequences (with
        `max_new_tokens`, greedy) or `Request` objects."""
        outs: dict[int, RequestOutput] = {}
        for ev in self._run(*self._submit(requests, max_new_tokens), partial_events=False):
            if ev.output is not None:
                outs[ev.index] = ev.output
        return [outs[i] for i in range(len(outs))]

    def cancel(self, request_id) -> None:
        """Cancels a submitted request (thread-safe; takes effect at the next step). Its output
        gets finish_reason "cancelled" with the tokens produced so far.

        A request is submitted by the `generate` / `stream` call that carries it (from the
        call, before the stream's first event); a cancel applies to that call's requests with
        this id only and never to a later request reusing the id. Cancelling a request that
        already finished is a no-op; an id this engine was never given raises ValueError."""
        with self._cancel_lock:
            runs = [run for run in self._runs if request_id in run.ids]
            for run in runs:
                run.cancelled.add(request_id)
            if not runs and request_id not in self._ended_ids:
                raise ValueError(f"cancel: no request with request_id={request_id!r} was "
                                 "submitted to this engine")

    def stream(self, requests: Iterable, *, max_new_tokens: int = 16) -> Iterator[StreamEvent]:
        """Runs the requests, yielding a StreamEvent whenever tokens become known on the host
        (and one final event per request, `output` set). Closing the iterator early drains the
        engine: in-flight steps finish, unfinished requests are cancelled."""
        return self._run(*self._submit(requests, max_new_tokens), partial_events=True)

    def _submit(self, requests: Iterable, max_new_tokens: int) -> tuple:
        """(run, requests): the items as `Request`s, registered as one run (their ids become
        cancellable)."""
        reqs = [as_request(r, max_new_tokens) for r in requests]
        for r in reqs:
            try:
                hash(r.request_id)
            except TypeError:
                raise ValueError(f"request_id must be hashable, got {r.request_id!r}") from None
        run = _RunIds(frozenset(r.request_id for r in reqs))
        with self._cancel_lock:
            self._runs.append(run)
        return run, reqs

    def _run(self, run: _RunIds, reqs: list, partial_events: bool) -> Iterator[StreamEvent]:
        """`stream` of one submitted run; partial_events=False yields only the final event
        of each request."""
        sched = self.scheduler
        t0 = time.perf_counter()
        base = dict(steps=0, decode_rows=0, decode_calls=0, decode_steps=0, pre=sched.preemptions, hit=sched.cache_hit_tokens,
                    prefill=sched.prefill_tokens, spec=self._spec_counters())
        seqs, emitted, pending_events, deferred = [], {}, [], []
        for i, r in enumerate(reqs):
            prompt, err = validate(r, self.cfg.vocab_size, self.max_len,
                                   self.pages.capacity * self.page_size,   # one shard's pool
                                   self.cfg.image_token_id)
            seq = Seq(r, i, prompt, frozenset(int(t) for t in r.stop_tokens) if err is None else frozenset(), t0)
            if err is None and r.constraint is not None:
                seq.matcher, err = self._compile(r.constraint)
            err = self._attach_import(seq, err)     # a RequestState item (transfer.py)
            seqs.append(seq)
            if err is not None:
                seq.finish = "error"
                pending_events.append(StreamEvent(r.request_id, i, [], self._output(seq, err)))
            elif seq.matcher is not None and self.gamma:
                deferred.append(seq)        # constrained: a plain phase after the speculative one
            else:
                sched.add(seq)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="engine", unit="req", leave=False)
        watcher = _IdleWatcher() if self.measure_idle else None
        inflight = collections.deque()     # dispatched steps whose results are not applied
        try:
            for ev in pending_events:
                if bar is not None:
                    bar.update(1)
                yield ev
            stall = 0
            while sched.has_work() or inflight or deferred:
                if not sched.has_work() and not inflight:    # the constrained phase
                    self._set_spec_mode(False)
                    for seq in deferred:
                        sched.add(seq)
                    deferred = []
                self._apply_cancels(run, deferred)
                plan = sched.schedule()
                outs = self._dispatch(plan, watcher) if plan else None
                if outs is not None:
                    base["steps"] += 1
                    base["decode_rows"] += len(plan.decode)
                    if plan.decode:
                        base["decode_calls"] += 1
                        base["decode_steps"] += plan.decode_steps
                # apply earlier steps' results while this one runs; after a prefill-only step
                # (short on the device) one more stays in flight, so the next step is issued
                # before the host applies them (a finishing wave's results take a while)
                keep = 1 if outs is not None and _prefill_only(plan, outs) else 0
                collected = len(inflight) > keep
                while len(inflight) > keep:
                    yield from self._collect(inflight.popleft(), emitted, bar, partial_events)
                if outs is not None:        # constrained sub-batches: masks, then sampling
                    self._sample_constrained(outs, watcher)
                    if self.async_scheduling:
                        inflight.append(outs)
                    else:
                        yield from self._collect(outs, emitted, bar, partial_events)
                if plan or inflight or collected:
                    stall = 0               # progress (collected: slots or pages may be free now)
                    continue
                yield from self._drain_finished(emitted, bar)
                if sched.has_work():        # nothing schedulable and nothing in flight
                    # The scheduler already evicted every cache leaf admission could use
                    # (`Scheduler._allocate`); a head that still does not fit with nothing
                    # running can never run.
                    stall += 1
                    if stall > 1 and not sched.running:
                        sched.finish(sched.waiting.popleft(), "error")
            yield from self._drain_finished(emitted, bar)
        finally:
            with self._cancel_lock:         # the run's cancels end with it
                self._runs.remove(run)
                self._ended_ids |= run.ids
            if inflight:                    # early close: finish the in-flight steps
                jax.block_until_ready(self.state)
                inflight.clear()
            if sched.has_work():
                sched.cancel({s.req.request_id for s in list(sched.waiting) + sched.running})
                sched.finished.clear()
            self._set_spec_mode(True)
            if bar is not None:
                bar.close()
            idle = watcher.idle() if watcher else (float("nan"), 0, float("nan"))
            if watcher:
                watcher.close()
            self._record_run(seqs, t0, base, idle)

    # ------------------------------------------------------------------ internals
    def _on_mesh(self):
        """The context of every device call: the params' mesh (`jax.set_mesh`), or nothing."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _to_device(self, x: np.ndarray):
        """A packed host buffer as a device call's input: on a mesh its rows split over the
        batch shards (row block i -> shard i); else the host array itself."""
        if self.mesh is None:
            return x
        return jax.device_put(x, mesh_rules.batch_split_shardings(0, self.mesh))

    def _apply_cancels(self, run: _RunIds, deferred=()):
        with self._cancel_lock:
            ids, run.cancelled = run.cancelled, set()
        if ids:
            self.scheduler.cancel(ids)
            for seq in [s for s in deferred if s.req.request_id in ids]:
                deferred.remove(seq)
                seq.finish = "cancelled"
                self.scheduler.finished.append(seq)

    def _set_spec_mode(self, on: bool) -> None:
        """Speculative engines: decode rows verify drafts (on) or are plain one-token steps
        (off: the constrained phase; nothing else is running then)."""
        self._spec_on = bool(on and self.gamma)
        self.scheduler.spec_width = self.gamma + 1 if self._spec_on else 0
        self.scheduler.decode_cost = self.scheduler.spec_width or 1

    def _compile(self, constraint):
        """(Matcher, None) or (None, error message) for a request's constraint (host, at
        submission); a constraint that allows nothing at the start is an error too."""
        from deepinfer_fn import structured
        try:
            if self._tokenizer is None:
                self._tokenizer = bundle.constraint_tokenizer(self.params, where="Engine")
            m = structured.Matcher(constraint, self._tokenizer, self.cfg.vocab_size)
            if m.error is None:
                m.allowed_mask()            # sets m.error when nothing is allowed
        except Exception as e:              # no llguidance, a tokenizer of another model, ...
            return None, f"constraint: {type(e).__name__}: {e}"
        if m.error is not None:
            return None, f"constraint: {m.error}"
        return m, None

    def _sample_constrained(self, outs, watcher):
        """For each sub-batch dispatched as a bare forward (it samples for constrained rows):
        packs the allowed-token masks (every earlier token of those rows is known and consumed
        by now) and dispatches the masked sampling. A row whose constraint turns out to allow
        nothing finishes with "error"."""
        if not any(e[1] is None for e in outs):
            return
        from deepinfer_fn import structured
        failed = []
        for entry in outs:
            rows, out, packed, logits = entry[:4]
            if out is not None:
                continue
            masks = np.full((packed.shape[0], structured.mask_words(self.cfg.vocab_size)),
                            0xFFFFFFFF, np.uint32)
            live, live_seqs = [], []
            for i, row in zip(self.scheduler.row_positions(rows, packed.shape[0]), rows):
                seq, m = row.seq, row.seq.matcher
                if (m is None or not row.samples or seq.finish is not None
                        or row.epoch != seq.epoch or m.is_finished()):
                    continue
                assert seq.in_flight == 1, "a constrained row's earlier tokens must be known"
                live.append((int(i), m))
                live_seqs.append(seq)
            structured.fill_masks([m for _, m in live], masks, [i for i, _ in live])
            for (i, m), seq in zip(live, live_seqs):
                if m.error is not None:
                    masks[i] = 0xFFFFFFFF
                    failed.append(seq)
            with self._on_mesh():
                self.state, out = sample_packed(self.state, logits,
                                                self._to_device(packed[:, :PACK_HEAD]),
                                                self._to_device(masks))
            out.copy_to_host_async()
            entry[1], entry[2], entry[3] = out, None, None
        for seq in failed:
            if seq.finish is None:
                self.scheduler.finish(seq, "error")
        if watcher is not None and self._watch is not None:
            watcher.q.put(([e[1] for e in outs],) + self._watch)
        self._watch = None

    def _dispatch(self, plan: StepPlan, watcher):
        """Packs both sub-batches (one int32 buffer each), then issues them back to back (no
        host work between the two device calls). Nothing here waits for the device's results
        (on XLA:GPU the call of a program with a device loop returns when the loop ends). A
        sub-batch that samples for a constrained row is issued as its forward only (entry
        [rows, None, packed, logits]; `_sample_constrained` completes it)."""
        sched = self.scheduler
        calls, compiled = [], False
        if plan.prefill:
            shape = plan.prefill_shape
            compiled |= shape not in self._shapes_seen
            self._shapes_seen.add(shape)
            calls.append((plan.prefill, sched.pack(plan.prefill, *shape), False))
        if plan.decode:
            shape = (sched.sub_batch_rows(plan.decode, self.decode_buckets), None)
            compiled |= shape not in self._shapes_seen
            self._shapes_seen.add(shape)
            calls.append((plan.decode, sched.pack(plan.decode, *shape), True))
        # the device may idle from here at most: on XLA:GPU a call whose program loops on
        # a device-side condition (several decode steps) returns only when the loop ends
        outs, t_issue = [], time.perf_counter()
        for rows, packed, is_decode in calls:
            with self._on_mesh():
                dev = self._to_device(packed)
                if self._spec_on and is_decode:
                    self.state, out = self._spec_decode(dev, plan.decode_steps)
                    outs.append([rows, out, None, None, "spec"])
                elif self._spec_on:
                    self.state, out = self._spec_prefill(dev)
                    outs.append([rows, out, None, None])
                elif any(row.samples and row.seq.matcher is not None for row in rows):
                    self.state, logits = forward_packed(self.params, self.state, dev,
                                                        **self._tail_arg(is_decode))
                    outs.append([rows, None, packed, logits])
                elif is_decode and self.scheduler.decode_steps > 1:
                    self.state, out = self._decode(dev, plan.decode_steps)
                    outs.append([rows, out, None, None, "multi"])
                else:
                    self.state, out = substep_packed(self.params, self.state, dev,
                                                     **self._tail_arg(is_decode))
                    outs.append([rows, out, None, None])
        for entry in outs:
            if entry[1] is not None:
                entry[1].copy_to_host_async()   # ready on the host as soon as the step finishes
        sched.commit_plan(plan)
        self._watch = (t_issue, compiled)
        if watcher is not None and all(e[1] is not None for e in outs):
            watcher.q.put(([o[1] for o in outs], t_issue, compiled))
            self._watch = None
        return outs

    def _collect(self, outs, emitted, bar, partial_events=True):
        now = None
        for rows, out, *rest in outs:
            out = np.asarray(out)                       # waits for this step (the only sync)
            out = out[self.scheduler.row_positions(rows, out.shape[0])]
            now = time.perf_counter()
            if rest[-1:] == ["spec"]:
                self.scheduler.commit_spec_steps(rows, out, now)
                continue
            if rest[-1:] == ["multi"]:
                self.scheduler.commit_decode_results(rows, out, now)
                continue
            self.scheduler.commit_results(rows, out[:, 0].tolist(),
                                          out.view(np.float32)[:, 1].tolist(), now)
        seen = set()
        for rows, *_ in (outs if partial_events else ()):
            for row in rows:
                seq = row.seq
                if id(seq) in seen or seq.finish is not None:
                    continue
                seen.add(id(seq))
                k = emitted.get(seq.index, 0)
                if len(seq.generated) > k:
                    emitted[seq.index] = len(seq.generated)
                    yield StreamEvent(seq.req.request_id, seq.index, seq.generated[k:])
        yield from self._drain_finished(emitted, bar)

    def _drain_finished(self, emitted, bar):
        sched = self.scheduler
        done, sched.finished = sched.finished, []
        for seq in done:
            k = emitted.get(seq.index, 0)
            emitted[seq.index] = len(seq.generated)
            err = None
            if seq.finish == "error":
                err = ("the request could not be scheduled (page pool exhausted)"
                       if seq.matcher is None or seq.matcher.error is None
                       else f"constraint: {seq.matcher.error}")
            if bar is not None:
                bar.update(1)
            yield StreamEvent(seq.req.request_id, seq.index, seq.generated[k:], self._output(seq, err))

    def _output(self, seq: Seq, err: str | None) -> RequestOutput:
        n = len(seq.generated)
        m = RequestMetrics(prompt_tokens=len(seq.prompt), generated_tokens=n,
                           cached_tokens=seq.cached_tokens, replayed_tokens=seq.replayed_tokens,
                           preemptions=seq.preemptions,
                           verified=[v for v, _ in seq.spec_log],
                           accepted=[g for _, g in seq.spec_log])
        if seq.t_first is not None:
            m.ttft = seq.t_first - seq.t_submit
            m.tpot = (seq.t_last - seq.t_first) / (n - 1) if n > 1 else 0.0
        status = None
        if seq.req.constraint is not None:
            mt = seq.matcher
            status = ("error" if mt is None or mt.error is not None or seq.finish == "error"
                      else "complete" if mt.is_accepting() else "incomplete")
        return RequestOutput(seq.req.request_id, list(seq.generated), seq.finish, err,
                             list(seq.logprobs), m, status)

    def _spec_counters(self) -> tuple[int, int, int, int]:
        s = self.scheduler
        return s.spec_row_steps, s.spec_verified, s.spec_accepted, s.spec_committed

    def _record_run(self, seqs, t0, base, idle):
        sched = self.scheduler
        wall = time.perf_counter() - t0
        gen = sum(len(s.generated) for s in seqs)
        hit = sched.cache_hit_tokens - base["hit"]
        replayed = sum(s.replayed_tokens for s in seqs if s.finish != "error")
        saved = max(0, hit - replayed)
        steps = base["steps"]
        self.last_run = RunMetrics(
            requests=len(seqs), wall_s=wall, steps=steps,
            prompt_tokens=sum(len(s.prompt) for s in seqs), generated_tokens=gen,
            prefill_tokens_computed=sched.prefill_tokens - base["prefill"],
            cache_hit_tokens=hit, replayed_tokens=replayed, prefill_tokens_saved=saved,
            prefill_flops_saved=2.0 * self._active_params * saved,
            preemptions=sched.preemptions - base["pre"],
            mean_decode_occupancy=base["decode_rows"] / max(steps, 1) / self.max_batch,
            decode_calls=base["decode_calls"],
            mean_decode_steps=base["decode_steps"] / max(base["decode_calls"], 1),
            throughput_tokens_per_s=gen / wall if wall > 0 else 0.0,
            idle_total_s=idle[0], idle_mean_s=idle[0] / idle[1] if idle[1] else float("nan"),
            idle_steps_measured=idle[1],
            idle_fraction=idle[0] / (idle[0] + idle[2]) if idle[1] else float("nan"))
        rows, ver, acc, com = (a - b for a, b in zip(self._spec_counters(), base["spec"]))
        if self.gamma:
            nan = float("nan")
            m = self.last_run
            m.spec_row_steps, m.spec_verified, m.spec_accepted, m.spec_committed = rows, ver, acc, com
            m.mean_verify_len = ver / rows if rows else nan
            m.acceptance_rate = acc / ver if ver else nan
            m.tau = com / rows if rows else nan
            m.all_accepted_tokens_per_s = rows * (1 + self.gamma) / wall if wall > 0 else nan
            m.verified_tokens_per_s = (rows + ver) / wall if wall > 0 else nan

    def _trip_counts(self) -> tuple[int, ...]:
        """The loop lengths of the compiled multi-step decode programs."""
        K = self.scheduler.decode_steps
        return fixed_trip_counts(K) if self.decode_loop == "fixed" else (K,)

    def _substep_jobs(self, n: int, width: int | None) -> list[Job]:
        """The jitted calls of a sub-step of n rows with prefill tokens of `width` (None:
        decode) on all-padding inputs, as precompile jobs."""
        packed = self._to_device(self.scheduler.pack([], n, width))
        fixed = self.decode_loop == "fixed"
        if not self.gamma and width is None and self.scheduler.decode_steps > 1:
            return [Job(decode_steps_packed, (self.params, self.state, packed),
                        dict(steps=t, fixed_trips=fixed)) for t in self._trip_counts()]
        if self.gamma and width is None:
            verify_len, sched = self._verify[n]
            return [Job(spec_decode_packed, (self.params, self.drafter, self.state, packed,
                                             sched),
                        dict(drafter=self._kind, k=self.gamma, verify_len=verify_len, steps=t,
                             fixed_trips=fixed)) for t in self._trip_counts()]
        return [self._substep_job(n, width, packed)]

    def _substep_job(self, n: int, width: int | None, packed) -> Job:
        """The precompile job of a prefill sub-step or a plain one-step decode."""
        if not self.gamma:
            return Job(substep_packed, (self.params, self.state, packed),
                       self._tail_arg(width is None))
        return Job(spec_prefill_packed, (self.params, self.drafter, self.state, packed),
                   dict(drafter=self._kind, k=self.gamma, **self._tail_arg(False)))

    def _tail_arg(self, is_decode: bool) -> dict:
        """The `tail` keyword of a prefill sub-step (plain or speculative): V4.1 decoder SWA
        bounded replay on prefill sub-batches (none for decode, nor when off: the V4 programs
        unchanged)."""
        return {} if is_decode or self._tail is None else {"tail": self._tail}

    def _decode(self, packed, steps: int):
        """A plain decode sub-batch of up to `steps` steps (`step.decode_steps_packed`): (state,
        out int32 [Db, T, 2]), T the smallest compiled loop length >= steps."""
        T = min(t for t in self._trip_counts() if t >= steps)
        return decode_steps_packed(self.params, self.state, packed, steps=T,
                                   fixed_trips=self.decode_loop == "fixed")

    def _spec_decode(self, packed, steps: int):
        """A speculative decode sub-batch of up to `steps` verify steps
        (`spec_step.spec_decode_packed`): (state, out int32 [Db, T, 2(γ+1) + 4]), T the
        smallest compiled loop length >= steps."""
        verify_len, sched = self._verify[packed.shape[0]]
        T = min(t for t in self._trip_counts() if t >= steps)
        return spec_decode_packed(self.params, self.drafter, self.state, packed, sched,
                                  drafter=self._kind, k=self.gamma, verify_len=verify_len,
                                  steps=T, fixed_trips=self.decode_loop == "fixed")

    def _spec_prefill(self, packed):
        """A speculative prefill sub-batch (`spec_step.spec_prefill_packed`): (state, out)."""
        return spec_prefill_packed(self.params, self.drafter, self.state, packed,
                                   drafter=self._kind, k=self.gamma, **self._tail_arg(False))

    def warmup(self, threads: int | None = None) -> float:
        """Compiles every sub-step shape (prefill and decode buckets) in parallel threads
        (`compile_cache.precompile`), then runs each once with all-padding rows, which change
        nothing; returns the seconds it took."""
        t0 = time.perf_counter()
        shapes = self.prefill_shapes + tuple((n, None) for n in self.decode_buckets)
        with self._on_mesh():
            precompile([job for n, width in shapes for job in self._substep_jobs(n, width)],
                       threads)
        for n, width in shapes:
            with self._on_mesh():
                packed = self._to_device(self.scheduler.pack([], n, width))
                if not self.gamma and width is None and self.scheduler.decode_steps > 1:
                    for t in self._trip_counts():
                        self.state, _ = self._decode(packed, t)
                elif not self.gamma:
                    self.state, _ = substep_packed(self.params, self.state, packed,
                                                   **self._tail_arg(width is None))
                elif width is None:
                    for t in self._trip_counts():
                        self.state, _ = self._spec_decode(packed, t)
                else:
                    self.state, _ = self._spec_prefill(packed)
            self._shapes_seen.add((n, width))
        jax.block_until_ready(self.state)
        return time.perf_counter() - t0

    def reset_cache(self) -> None:
        """Drops every cached prefix block no running request holds."""
        for cache, pages in zip(self.shard_caches, self.shard_pages):
            if cache is not None:
                cache.evict(pages.num_pages)

    # ------------------------------------------------------------------ prefill / decode separation
    # (engine/transfer.py; hooks: `_attach_import` in `_run`, `Scheduler.on_import`,
    # `Scheduler.on_finish` while `prefill` runs)
    def prefill(self, requests: Iterable, *, max_new_tokens: int = 16) -> list:
        """Runs each request's prefill and samples its first token; returns, in order, a
        `transfer.RequestState` per request that goes on decoding (its slot and pages are then
        released; full prompt blocks stay in the prefix cache), or the final `RequestOutput` of
        one that ended here (an error, a stop token first, max_new_tokens 1, cancelled). Feed the
        states to `generate` / `stream` of a compatible engine (`transfer_fingerprint`)."""
        originals = []
        for item in requests:
            r = as_request(item, max_new_tokens)
            if isinstance(r, transfer.ImportedRequest):
                raise ArgumentTypeError("Engine.prefill: got a RequestState; pass it to "
                                        "generate / stream to continue decoding it")
            originals.append(r)
        run, reqs = self._submit([transfer.PrefillRequest.of(r) for r in originals],
                                 max_new_tokens)
        exports, outs = {}, {}
        self.scheduler.on_finish = functools.partial(self._export_finished, exports)
        try:
            for ev in self._run(run, reqs, partial_events=False):
                if ev.output is not None:
                    outs[ev.index] = ev.output
        finally:
            self.scheduler.on_finish = None
        fp = self.transfer_fingerprint()
        result = []
        for i, r in enumerate(originals):
            if i not in exports:
                result.append(outs[i])
                continue
            seq, pending = exports[i]
            rings, pages, spec, drafter, last = transfer.finish_export(pending)
            assert last == seq.generated[-1], (last, seq.generated)
            position = len(seq.prompt) + len(seq.generated) - 1
            if spec:        # the host's exact counters (the device's budget was this run's 1)
                spec = dict(length=position, left=r.max_new_tokens - len(seq.generated),
                            step=seq.spec_steps)
            result.append(transfer.RequestState(
                r, np.asarray(seq.prompt, np.int32), np.asarray(seq.generated, np.int32),
                np.asarray(seq.logprobs, np.float32), position, rings, pages, spec, drafter,
                fp))
        return result

    def transfer_fingerprint(self) -> dict:
        """What a `RequestState` shares with the engine that imports it (`transfer.fingerprint`)."""
        return transfer.fingerprint(self.cfg, page_size=self.page_size,
                                    window_slots=self.state.window_slots, dtype=self.params.dtype,
                                    speculative=self.speculative if self.gamma else None,
                                    gamma=self.gamma, drafter=self.drafter if self.gamma else None)

    @property
    def _page_buckets(self) -> tuple[int, ...]:
        return buckets_up_to(self.state.max_pages)

    def _export_finished(self, exports: dict, seq: Seq, reason: str) -> None:
        """`Scheduler.on_finish` during `prefill`: a request whose first token is known and
        which goes on decoding has its slot and pages gathered (dispatched before any later
        step can reuse them)."""
        full = getattr(seq.req, "full", None)
        if reason == "length" and full is not None and full.max_new_tokens > 1:
            exports[seq.index] = (seq, transfer.start_export(self.state, seq.slot,
                                                             self._pool_ids(seq),
                                                             self._page_buckets))

    def _attach_import(self, seq: Seq, err: str | None) -> str | None:
        """A `RequestState` item (`transfer.ImportedRequest`): checks it against this engine
        (before the request's own error `err`: an incompatible state is named first) and
        restores the host side (tokens so far, step counter, constraint matcher); the device
        state is scattered in at admission. Returns the error message or None."""
        if not isinstance(seq.req, transfer.ImportedRequest):
            return err
        rs = seq.req.state
        bad = (transfer.fingerprint_mismatch(rs.fingerprint, self.transfer_fingerprint())
               or transfer.state_error(rs))
        if bad is None and err is None:
            bad = transfer.shape_mismatch(rs, transfer.expected_shapes(
                self.state, rs.num_pages, self._page_buckets))
        if bad is not None or err is not None:
            return err if bad is None else f"RequestState import: {bad}"
        seq.generated, seq.logprobs = rs.generated.tolist(), rs.logprobs.tolist()
        seq.spec_steps, seq.imported = rs.spec_steps, rs
        self.scheduler.on_import = self._import_state
        seq.t_first = seq.t_last = seq.t_submit
        if seq.matcher is not None:
            for t in seq.generated:
                seq.matcher.consume(int(t))
            if seq.matcher.error is not None or seq.matcher.is_finished():
                return f"constraint: {seq.matcher.error or 'already complete'}"
        return None

    def _import_state(self, seq: Seq, rs) -> None:
        """`Scheduler.on_import`: writes a request admitted from a `RequestState` into its slot
        and fresh pages (dispatched at admission: after every step dispatched before, before
        any that reads, caches or preempts them)."""
        self.state = transfer.import_state(self.state, seq.slot, self._pool_ids(seq), rs,
                                           self._page_buckets)
        if self.mesh is not None:       # keep the slots / pages split over the batch shards
            self.state = jax.device_put(self.state, mesh_rules.batch_split_shardings(
                shard_axes(self.state), self.mesh))

    def _pool_ids(self, seq: Seq) -> list[int]:
        """seq's pages as ids into the whole pool axis (shard-local ids offset by the shard's
        block of pages; unchanged without a mesh)."""
        return [seq.shard * self.pages.num_pages + p for p in seq.pages]
