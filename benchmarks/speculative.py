"""Speculative decoding: fixed-γ vs dynamic verify length, the shape of DeepInfer's table.

docs/MODEL.md §D4. Target: the embedded default model; drafter: the shipped DSpark drafter
(`assets/default_model/dspark/`) when present, else the checkpoint's MTP block (fixed arms
only: MTP has no confidence head, so no dynamic arm). Steps:

(a) the verify cost profile: `schedule.measure_verify_cost` times the target's verify forward
    (`forward_chunk`, all logits, decode state filled to the benchmark's mean context) for
    batches x columns 1..γ+1; saved as benchmarks/results/verify_cost_<device>.json;
(b) for each concurrency N (default 16 and 60) on the same N prompts (fixed output length,
    stop tokens ignored, spec §4.2): plain decoding (the peer baseline), fixed-γ and dynamic
    verification. Every arm is compiled and warmed up first, then `--repeats` rounds run the
    arms interleaved (ABAB, spec §4.3); median wall time, block_until_ready. The dynamic arm
    uses the profile plus the step overhead measured on the fixed arm (step time minus the
    verify forward at γ+1 columns: draft, sampling, bookkeeping).
    Reported per arm: mean verified length ℓ̄ (drafts verified per row per step), acceptance
    rate Σg/Σℓ, τ (tokens committed per row per step incl. the bonus), real committed tokens/s
    (tokens returned / wall time) and, side by side, the "all drafts accepted" figure
    R·(1+γ)·steps / wall time that DeepInfer's published numbers use, plus processed
    tokens/s Σ(1+ℓ)/wall time;
(c) JSON + PNG under benchmarks/results/.

(d) a CPU cross-check per concurrency (spec §4.3 item 7, `simulate`): synthetic acceptance
    (the spec's illustration generator) replayed through the schedulers on the measured
    profile: fixed vs padded dynamic (with / without shrinking the forward to 1 + max(ell)
    columns) vs the packed-layout scheduler. Labelled as a simulation in the JSON.

Wall times include the prefill of the prompts (one chunk; small next to the decode loop),
the same for every arm. The padded verify layout only saves compute when generate runs the
forward on 1 + max(ell) columns (`schedule.run_with_columns`); the JSON records whether the
tree's generate does (`dynamic_shrinks_columns`).

    python benchmarks/speculative.py                      # GPU: profile + N = 16, 60
    python benchmarks/speculative.py --only-cost          # split runs: the profile first,
    python benchmarks/speculative.py --cost-file benchmarks/results/verify_cost_h200.json \
        --concurrency 16 [--append]                       # then one concurrency per call
    python benchmarks/speculative.py --auto-concurrency   # + N at 0.5x / 2x the cost knee
    python benchmarks/speculative.py --simulate-only --cost-file F --concurrency 16 60 200
    python benchmarks/speculative.py --quick              # CPU smoke run (tiny sizes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_fn as di
from deepinfer_fn.default_model import default_model_path
from deepinfer_fn.speculative import schedule

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_tag() -> str:
    kind = jax.devices()[0].device_kind.lower()
    for tag in ("h200", "h100", "a100", "l4", "v100", "tpu"):
        if tag in kind:
            return tag
    return "cpu" if jax.default_backend() == "cpu" else kind.replace(" ", "_")


def make_prompts(n: int, length: int, seed: int = 0, offset: int = 0) -> np.ndarray:
    """n prompts of `length` tokens: windows of Python standard-library sources (what the
    default model was trained on), tokenised with its tokenizer, BOS first. Deterministic.
    Windows start at offset + multiples of 4 * length: offsets 0 and 2 * length give disjoint
    prompt sets (benchmark vs calibration)."""
    from deepinfer_fn import text
    tok = text.load_tokenizer(default_model_path())
    stdlib = os.path.dirname(os.__file__)
    files = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))
    rng = np.random.default_rng(seed)
    rows = []
    for name in rng.permutation(files):
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
            ids = tok.encode(f.read()[:200_000])
        for start in range(offset, len(ids) - length + 1, 4 * length):
            rows.append([tok.bos_id] + ids[start:start + length - 1])
            if len(rows) == n:
                return np.asarray(rows, np.int32)
    raise RuntimeError(f"not enough standard-library text for {n} prompts of {length} tokens")


def load_drafter(params, kind: str, path: str | None):
    """("dspark", drafter) when the DSpark code and weights are there, else ("mtp", None)."""
    if kind in ("auto", "dspark"):
        try:
            from deepinfer_fn.speculative import default_dspark_path, load_dspark
        except ImportError:
            if kind == "dspark":
                raise SystemExit("--drafter dspark: this tree has no deepinfer_fn.speculative."
                                 "load_dspark (DSpark not merged yet)")
        else:
            p = path or default_dspark_path()
            if os.path.isfile(os.path.join(p, "dspark_config.json")):
                return "dspark", load_dspark(p, params, dtype=params.dtype)
            if kind == "dspark":
                raise SystemExit(f"--drafter dspark: no drafter at {p}")
    if not params["mtp"]:
        raise SystemExit("no DSpark drafter and the target has no MTP block")
    return "mtp", None


def arm_kwargs(arm: str, method: str, drafter, gamma: int, cost):
    if arm == "plain":
        return {}
    if method == "mtp":
        return dict(speculative="mtp", num_draft_tokens=gamma)
    kw = dict(speculative="dspark", drafter=drafter, verify_len=arm)
    if arm in ("dynamic", "fixed") and cost is not None:
        kw["verify_cost"] = cost     # fixed + a profile: the dynamic arm's program, flag off
    return kw


def run_arm(params, prompts, new_tokens, temperature, kwargs):
    """One timed generate call -> (seconds, output)."""
    B = prompts.shape[0]
    t0 = time.perf_counter()
    out = di.generate(params, prompts, max_new_tokens=new_tokens, temperature=temperature,
                      seed=np.arange(B), stop_tokens=(), **kwargs)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t0, out


def arm_stats(out, seconds: float, gamma: int, speculative: bool) -> dict:
    committed = int(np.asarray(out.lengths).sum())
    B = int(np.asarray(out.lengths).shape[0])
    row = dict(seconds=seconds, committed_tokens=committed, real_tok_s=committed / seconds)
    if not speculative:
        return row
    acc, ver = np.asarray(out.accepted), np.asarray(out.verified)
    live = acc >= 0
    steps = int(live.any(axis=0).sum())              # loop iterations (the batch steps together)
    g, ell = acc[live].astype(np.float64), ver[live].astype(np.float64)
    row.update(steps=steps, row_steps=int(live.sum()),
               mean_verify_len=float(ell.mean()),
               acceptance_rate=float(g.sum() / max(ell.sum(), 1)),
               tau=float((g + 1).mean()),
               verify_efficiency=float((g + 1).sum() / (ell + 1).sum()),
               all_accepted_tok_s=B * (1 + gamma) * steps / seconds,
               processed_tok_s=float((ell + 1).sum()) / seconds,
               step_seconds=seconds / max(steps, 1))
    return row


def calibrate(params, drafter, n, prompt_len, new_tokens, temperature, gamma):
    """STS calibration (spec §1.5) on a log of FIXED full-length verification over a separate
    prompt set (seed 1; the benchmark prompts use seed 0): the steps where all γ drafts were
    verified, their confidence logits (`GenerateOutput.draft_confidence`) and accepted counts.
    Returns (drafter with the calibrated temperatures, report) or (drafter, None) when the
    tree's generate does not return confidences."""
    import dataclasses
    prompts = make_prompts(n, prompt_len, seed=1, offset=2 * prompt_len)
    _, out = run_arm(params, prompts, new_tokens, temperature,
                     arm_kwargs("fixed", "dspark", drafter, gamma, None))
    conf = getattr(out, "draft_confidence", None)
    if conf is None:
        return drafter, None
    acc, ver, conf = np.asarray(out.accepted), np.asarray(out.verified), np.asarray(conf)
    full = (acc >= 0) & (ver == gamma)
    temps, report = schedule.sts_calibrate(conf[full], acc[full])
    report["shipped_temperatures"] = [float(t) for t in np.asarray(drafter.sts_temperatures)]
    return dataclasses.replace(drafter, sts_temperatures=jnp.asarray(temps)), report


def simulate(cost, n: int, gamma: int, overhead: float, *, steps: int = 300, seed: int = 0,
             eps: float = 1e-6, conf_noise: float = 0.6) -> dict:
    """CPU cross-check (spec §4.3 item 7) with SYNTHETIC acceptance: the generator of the
    spec's illustration (per-request first-slot acceptance ~ Beta(5, 2), x0.97 per later
    slot, confidence logit = true logit + N(0, conf_noise)), common random numbers for every
    arm, the measured cost profile. Predicts committed tokens/s for fixed-γ; the padded
    dynamic scheduler with the forward shrunk to 1 + max(ell) columns ("padded") and without
    ("padded_noswitch", every step costs γ+1 columns); and the packed-layout synchronous
    scheduler (§3.3) costed on the token curve ("packed", an approximation: the profile is
    measured on padded shapes). Not a measurement of the engine."""
    rng = np.random.default_rng(seed)
    c = rng.beta(5, 2, (steps, n, 1)) * 0.97 ** np.arange(gamma)
    ok = rng.random((steps, n, gamma)) < c
    g_full = np.argmin(np.concatenate([ok, np.zeros((steps, n, 1), bool)], -1), -1)
    z = (np.log(c) - np.log1p(-c) + rng.normal(0, conf_noise, c.shape)).astype(np.float32)
    sec = cost.step_seconds_for(n).astype(np.float64)
    pad = jax.jit(jax.vmap(lambda zs: schedule.padded_verify_len(
        zs, jnp.ones(gamma), jnp.ones(n, bool), jnp.full(n, gamma), sec.astype(np.float32),
        overhead, eps)))
    ell_pad = np.asarray(pad(z))
    a = schedule.survivals_np(z, np.ones(gamma))
    tok_cost = lambda b: float(cost.seconds_at_tokens(b))
    ell_packed = np.stack([schedule.schedule_sync(a[i], np.full(n, gamma), tok_cost, overhead, eps)
                           for i in range(steps)])
    def arm(ell, seconds):
        tokens = float((np.minimum(g_full, ell) + 1).sum())
        return dict(tok_s=tokens / seconds, mean_verify_len=float(ell.mean()),
                    acceptance_rate=float(np.minimum(g_full, ell).sum() / max(ell.sum(), 1)))
    full = np.full((steps, n), gamma)
    out = dict(
        fixed=arm(full, steps * (overhead + sec[gamma])),
        padded=arm(ell_pad, float(np.sum(overhead + sec[ell_pad.max(axis=1)]))),
        padded_noswitch=arm(ell_pad, steps * (overhead + sec[gamma])),
        packed_fixed=arm(full, steps * (overhead + tok_cost(n * (gamma + 1)))),
        packed=arm(ell_packed, float(sum(overhead + tok_cost(n + e.sum()) for e in ell_packed))))
    for k in ("padded", "padded_noswitch"):
        out[k]["over_fixed"] = out[k]["tok_s"] / out["fixed"]["tok_s"]
    out["packed"]["over_fixed"] = out["packed"]["tok_s"] / out["packed_fixed"]["tok_s"]
    return out


def print_simulation(n, sim):
    print(f"  simulated N={n:4d}: " + "  ".join(
        f"{k} ell {v['mean_verify_len']:.2f} {v['tok_s']:9.1f} tok/s"
        + (f" (x{v['over_fixed']:.3f})" if "over_fixed" in v else "") for k, v in sim.items()))


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    cost = result["verify_cost"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    for b, sec in zip(cost["points"], cost["seconds"]):
        ax.plot(np.arange(1, len(sec) + 1) * b, np.asarray(sec) * 1e3, "o-", ms=3, label=f"B={b}")
    ax.set_xlabel("tokens in the verify forward (rows x columns)")
    ax.set_ylabel("verify forward (ms, isotonic fit)")
    ax.set_xscale("log")
    ax.set_title(f"verify cost, {result['device']}")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    labels, real, assumed = [], [], []
    for conc in result["concurrency"]:
        for arm in ("plain", "fixed", "dynamic"):
            r = conc["arms"].get(arm)
            if r is None:
                continue
            labels.append(f"N={conc['n']}\n{arm}")
            real.append(r["real_tok_s"])
            assumed.append(r.get("all_accepted_tok_s", np.nan))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, real, 0.4, label="real committed tok/s")
    ax.bar(x + 0.2, assumed, 0.4, label='"all drafts accepted" tok/s')
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{result['method']} drafter, γ={result['gamma']}, T={result['temperature']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def remeasure(params, cost, points, context: int, quick: bool, in_loop: int):
    """`cost` with the raw medians at `points` ("B:S" strings) measured again on this device
    (`schedule.measure_verify_times`) and the grid re-fitted."""
    if cost.kind != "grid" or cost.raw is None:
        raise SystemExit("--remeasure needs a grid profile with raw medians")
    raw = np.array(cost.raw, np.float64)
    for point in points:
        b, s_ = (int(x) for x in point.split(":"))
        if b not in cost.points or not 1 <= s_ <= cost.gamma + 1:
            raise SystemExit(f"--remeasure {point}: not a point of the loaded grid "
                             f"(batches {cost.points}, columns 1..{cost.gamma + 1})")
        sec = schedule.measure_verify_times(params, [b], [s_], context=context,
                                            repeats=3 if quick else 20, warmup=1 if quick else 3,
                                            slack=cost.gamma, in_loop=in_loop, verbose=True)
        raw[cost.points.index(b), s_ - 1] = sec[0, 0]
    meta = dict(cost.meta, remeasured=list(points),
                remeasured_device=str(jax.devices()[0].device_kind))
    return schedule.VerifyCost.from_grid(cost.points, raw, overhead_seconds=cost.overhead_seconds,
                                         meta=meta)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--gamma", type=int, default=5, help="draft length (MTP; DSpark: block size)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--cost-batches", type=int, nargs="+", default=None)
    ap.add_argument("--cost-file", default=None, help="load this profile instead of measuring")
    ap.add_argument("--cost-loop", type=int, default=20, metavar="N",
                    help="time the verify forward inside a device loop of N forwards (what "
                         "generate's decode loop pays); 0: one device call per forward")
    ap.add_argument("--eps", type=float, default=0.0, help="scheduler hysteresis")
    ap.add_argument("--drafter", choices=("auto", "dspark", "mtp"), default="auto")
    ap.add_argument("--calibrate", choices=("auto", "off"), default="auto",
                    help="STS-calibrate the DSpark confidences on separate prompts first")
    ap.add_argument("--dspark-path", default=None)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--out", default=None, help="JSON path (default results/speculative_<dev>.json)")
    ap.add_argument("--only-cost", action="store_true", help="measure and save the profile only")
    ap.add_argument("--simulate-only", action="store_true",
                    help="no decoding: the synthetic-acceptance simulation on the profile")
    ap.add_argument("--overhead", type=float, default=None,
                    help="step overhead (s) for --simulate-only (default: the profile's)")
    ap.add_argument("--auto-concurrency", action="store_true",
                    help="also run N_low, N_high with N*(1+γ) = 0.5x / 2x the profile's knee")
    ap.add_argument("--arms", nargs="+", choices=("plain", "fixed", "dynamic"), default=None,
                    help="arms to run (default: all the drafter supports)")
    ap.add_argument("--remeasure", nargs="+", default=(), metavar="B:S",
                    help="with --cost-file: re-measure these (batch, columns) points of the "
                         "loaded grid first (e.g. points a previous run did not reach)")
    ap.add_argument("--wait-for", nargs="+", default=(), metavar="FILE",
                    help="after compiling every arm, wait until these files exist before the "
                         "timed rounds (processes sharing one GPU: compile in parallel, time "
                         "one after another)")
    ap.add_argument("--compiled-file", default=None, metavar="FILE",
                    help="create FILE once every arm is compiled and warmed up")
    ap.add_argument("--done-file", default=None, metavar="FILE",
                    help="create FILE when the timed rounds are over")
    ap.add_argument("--append", action="store_true",
                    help="keep the other concurrencies already in --out (split runs)")
    args = ap.parse_args(argv)
    # persistent compile cache (a second run on a warm machine skips the compiles)
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(os.path.dirname(RESULTS), os.pardir, ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    quick = args.quick
    conc = args.concurrency or ([2, 4] if quick else [16, 60])
    prompt_len = args.prompt_len or (32 if quick else 128)
    new_tokens = args.new_tokens or (24 if quick else 384)
    repeats = args.repeats or (1 if quick else 3)
    cost_batches = args.cost_batches or (sorted(set(conc)) if quick else
                                         sorted(set([256] + conc)))
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    dev = device_tag()
    out_json = args.out or os.path.join(RESULTS, f"speculative_{dev}{'_quick' if quick else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)

    params = di.load_params(default_model_path(), dtype=dtype)
    method, drafter = load_drafter(params, args.drafter, args.dspark_path)
    gamma = drafter.config.block_size if method == "dspark" else args.gamma
    arms = ["plain", "fixed"] + (["dynamic"] if method == "dspark" else [])
    if args.arms:
        bad = set(args.arms) - set(arms)
        if bad:
            raise SystemExit(f"--arms {sorted(bad)}: not available with the {method} drafter")
        arms = [a for a in arms if a in args.arms]
    import importlib
    import inspect
    shrinks = "run_with_columns" in inspect.getsource(importlib.import_module("deepinfer_fn.generate"))
    if method == "dspark" and not shrinks:
        print("NOTE: generate's dynamic arm does not shrink the padded verify forward "
              "(no schedule.run_with_columns): shorter verify lengths save no compute there")
    print(f"device {jax.devices()[0].device_kind} ({jax.default_backend()}), dtype {dtype.name}, "
          f"drafter {method}, γ={gamma}, arms {arms}, N={conc}, prompt {prompt_len} + "
          f"{new_tokens} new tokens, T={args.temperature}", flush=True)

    # (a) verify cost profile
    if args.cost_file:
        cost = schedule.VerifyCost.load(args.cost_file)
        if args.remeasure:
            if int(cost.meta.get("in_loop", 0)) != args.cost_loop:
                raise SystemExit(f"--remeasure: the loaded profile was measured with in_loop="
                                 f"{cost.meta.get('in_loop', 0)}, not --cost-loop {args.cost_loop}")
            cost = remeasure(params, cost, args.remeasure, prompt_len + new_tokens // 2, quick,
                             args.cost_loop)
            cost_path = os.path.join(os.path.dirname(os.path.abspath(out_json)),
                                     f"verify_cost_{dev}{'_quick' if quick else ''}.json")
            cost.save(cost_path)
            print(f"re-measured {list(args.remeasure)} -> {cost_path}")
    elif args.remeasure:
        raise SystemExit("--remeasure needs --cost-file")
    else:
        t0 = time.perf_counter()
        cost = schedule.measure_verify_cost(params, cost_batches, gamma,
                                            context=prompt_len + new_tokens // 2,
                                            repeats=3 if quick else 20, warmup=1 if quick else 3,
                                            in_loop=args.cost_loop, verbose=True)
        cost_path = os.path.join(os.path.dirname(os.path.abspath(out_json)),
                                 f"verify_cost_{dev}{'_quick' if quick else ''}.json")
        cost.save(cost_path)
        print(f"verify cost profile ({time.perf_counter() - t0:.1f} s incl. compiles) -> {cost_path}")
    if not int(cost.meta.get("in_loop", 0)):
        print("NOTE: this profile times one device call per verify forward (dispatch and sync "
              "included); generate's decode loop pays the in-loop cost (--cost-loop)")
    for b in cost.points:
        print(f"  B={b:4d}: " + " ".join(f"{s * 1e3:7.3f}" for s in cost.step_seconds_for(b)) + " ms")
    knee = cost.knee_tokens()
    print(f"knee of the verify cost curve: {knee} tokens (slope reaches half its large-B value)")
    if args.auto_concurrency and knee is not None:
        extra = sorted({max(1, round(0.5 * knee / (gamma + 1))), max(1, round(2 * knee / (gamma + 1)))})
        print(f"--auto-concurrency: adding N = {extra}")
        conc = sorted(set(conc) | set(extra))
    if args.only_cost:
        return
    if args.simulate_only:
        overhead = cost.overhead_seconds if args.overhead is None else args.overhead
        sims = {}
        for n in conc:
            sims[n] = simulate(cost, n, gamma, overhead)
            print_simulation(n, sims[n])
        sim_path = out_json.replace(".json", "_simulated.json")
        with open(sim_path, "w") as f:
            json.dump(dict(overhead_seconds=overhead, gamma=gamma, verify_cost=cost.to_json(),
                           simulation={str(k): v for k, v in sims.items()}), f, indent=1)
        print(f"wrote {sim_path}")
        return

    result = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                  host=platform.node(), method=method, gamma=gamma, temperature=args.temperature,
                  prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, eps=args.eps,
                  dtype=dtype.name, quick=quick, verify_cost=cost.to_json(), concurrency=[],
                  dynamic_shrinks_columns=shrinks, knee_tokens=knee,
                  notes=("wall times include prefill; 'all_accepted_tok_s' = R*(1+gamma)*steps/"
                         "time is DeepInfer's convention, 'real_tok_s' counts returned tokens; "
                         "prompts are stdlib sources (the default model's training domain)"))

    kept = []
    if args.append and os.path.isfile(out_json):
        with open(out_json) as f:
            kept = [e for e in json.load(f).get("concurrency", []) if e["n"] not in conc]

    def save():
        result["concurrency"].sort(key=lambda e: e["n"])
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)

    # STS calibration of the drafter's confidences (a separate prompt set, fixed verification)
    if method == "dspark" and args.calibrate == "auto":
        t0 = time.perf_counter()
        drafter, report = calibrate(params, drafter, max(conc), prompt_len, new_tokens,
                                    args.temperature, gamma)
        result["calibration"] = report
        if report is None:
            print("no draft_confidence in GenerateOutput: shipped STS temperatures kept")
        else:
            print(f"STS calibration ({time.perf_counter() - t0:.1f} s, {report['n']} steps): "
                  f"temperatures {np.round(np.asarray(drafter.sts_temperatures), 3).tolist()}")
            for r in report["positions"]:
                print(f"  slot {r['position']}: A rate {r['base_rate']:.3f}  ECE "
                      f"{r['ece_before']:.4f} -> {r['ece_after']:.4f}  AUC {r['auc_after']:.3f}  "
                      f"Brier {r['brier_before']:.4f} -> {r['brier_after']:.4f}")

    # (b) arms per concurrency
    result["concurrency"].extend(kept)
    for n in conc:
        prompts = make_prompts(n, prompt_len)
        # fixed and dynamic share one compiled program (generate's traced flag) when both run
        kw = {arm: arm_kwargs(arm, method, drafter, gamma,
                              cost if arm == "fixed" and "dynamic" in arms else None)
              for arm in arms}
        entry = dict(n=n, arms={}, times={arm: [] for arm in arms})
        # warm-up (compile) + the overhead estimate for the dynamic arm from the fixed arm
        for arm in arms:
            if arm == "dynamic":
                fixed_step = entry["warm_fixed"]["step_seconds"]
                overhead = max(0.0, fixed_step - float(cost.step_seconds_for(n)[-1]))
                dyn_cost = cost.with_overhead(overhead)
                if args.eps:
                    dyn_cost = dyn_cost.with_eps(args.eps)
                kw[arm] = arm_kwargs(arm, method, drafter, gamma, dyn_cost)
                entry["overhead_seconds"] = overhead
            t0 = time.perf_counter()
            run_arm(params, prompts, new_tokens, args.temperature, kw[arm])      # compile
            compile_s = time.perf_counter() - t0
            sec, out = run_arm(params, prompts, new_tokens, args.temperature, kw[arm])
            print(f"N={n} {arm}: compile+run {compile_s:.1f} s, warm run {sec:.3f} s", flush=True)
            if arm == "fixed":
                entry["warm_fixed"] = arm_stats(out, sec, gamma, True)
        if args.compiled_file:
            open(args.compiled_file, "w").close()
        if args.wait_for:
            t0 = time.perf_counter()
            while not all(os.path.exists(f) for f in args.wait_for):
                time.sleep(0.5)
            print(f"N={n}: waited {time.perf_counter() - t0:.1f} s for {args.wait_for}", flush=True)
        outs = {}
        for rep in range(repeats):                          # interleaved ABAB rounds
            for arm in (arms if rep % 2 == 0 else arms[::-1]):
                sec, outs[arm] = run_arm(params, prompts, new_tokens, args.temperature, kw[arm])
                entry["times"][arm].append(sec)
        for arm in arms:
            med = float(np.median(entry["times"][arm]))
            entry["arms"][arm] = arm_stats(outs[arm], med, gamma, arm != "plain")
        if "warm_fixed" in entry:
            overhead = entry.get("overhead_seconds", max(
                0.0, entry["warm_fixed"]["step_seconds"] - float(cost.step_seconds_for(n)[-1])))
            entry["simulation"] = simulate(cost, n, gamma, overhead)
        if "dynamic" in entry["arms"]:
            entry["dynamic_over_fixed"] = (entry["arms"]["dynamic"]["real_tok_s"] /
                                           entry["arms"]["fixed"]["real_tok_s"])
        result["concurrency"].append(entry)
        save()
    if args.done_file:
        open(args.done_file, "w").close()

    # report
    print(f"\n{'N':>4} {'arm':>8} {'ell':>5} {'acc':>6} {'tau':>5} {'real tok/s':>11} "
          f"{'all-acc tok/s':>13} {'proc tok/s':>11} {'step ms':>8}")
    for entry in result["concurrency"]:
        for arm, r in entry["arms"].items():
            if arm == "plain":
                print(f"{entry['n']:>4} {arm:>8} {'':>5} {'':>6} {'':>5} {r['real_tok_s']:11.1f}")
                continue
            print(f"{entry['n']:>4} {arm:>8} {r['mean_verify_len']:5.2f} {r['acceptance_rate']:6.3f} "
                  f"{r['tau']:5.2f} {r['real_tok_s']:11.1f} {r['all_accepted_tok_s']:13.1f} "
                  f"{r['processed_tok_s']:11.1f} {r['step_seconds'] * 1e3:8.3f}")
        if "dynamic_over_fixed" in entry:
            print(f"{entry['n']:>4} dynamic/fixed real throughput: {entry['dynamic_over_fixed']:.3f}")
        if "simulation" in entry:
            print_simulation(entry["n"], entry["simulation"])
    save()
    print(f"wrote {out_json}")
    plot(result, out_json.replace(".json", ".png"))


if __name__ == "__main__":
    main()
