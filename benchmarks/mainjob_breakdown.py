"""Where the README main job's seconds go, cold and warm, in fresh processes.

Each arm runs `python -m deepinfer_fn generate --prompt "import os" --max-new-tokens 96
--temperature 0.7 --top-p 0.95` in a new process (through `cli.main`, so the job is the real
one) with JAX's compile log on, and reports:

* wall_s: the process from start to exit, measured outside; in_process_s: from the first
  line of the worker (before `import jax`) to the end of the job;
* programs: every XLA compile with its program name, seconds and finish time (seconds since
  the worker started), and the seconds spent tracing and lowering;
* the program cache's counts and its seconds serializing + writing executables
  (`program_cache.stats`), and the cache directory's size after the run.

Arms (environment):
  cold            a fresh cache directory (JAX's persistent cache and the program cache on)
  warm            the same directory again
  cold_no_quick   a fresh directory, DEEPINFER_QUICK_COMPILE=off (every call compiled with
                  XLA's defaults)
  no_cache        DEEPINFER_COMPILE_CACHE=off (nothing written: cold minus the cache writes)
  no_cache_no_quick
  cold_chunked    a fresh directory, DEEPINFER_LOOP_PREFILL=off (the prompt through the chunked
                  prefill program instead of the decode loop)
  no_cache_chunked

    python benchmarks/mainjob_breakdown.py --out benchmarks/results/mainjob_breakdown.json
    python benchmarks/mainjob_breakdown.py --arms cold,warm --max-new-tokens 8   # a CPU smoke
"""

from __future__ import annotations

import time

WORKER_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("cold", "warm", "cold_no_quick", "no_cache", "no_cache_no_quick", "cold_chunked",
        "no_cache_chunked")
JOB = ["generate", "--prompt", "import os", "--temperature", "0.7", "--top-p", "0.95"]
MARK = "MAINJOB_BREAKDOWN "


def arm_env(arm: str, cache_dirs: dict) -> dict:
    """The environment of one arm (cache_dirs: arm -> its directory, filled here)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "DEEPINFER_COMPILE_CACHE",
                        "DEEPINFER_PROGRAM_CACHE", "DEEPINFER_QUICK_COMPILE",
                        "DEEPINFER_LOOP_PREFILL")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    if arm.startswith("no_cache"):
        env["DEEPINFER_COMPILE_CACHE"] = "off"
    else:
        source = "cold" if arm == "warm" else arm
        if source not in cache_dirs:
            cache_dirs[source] = tempfile.mkdtemp(prefix=f"mainjob_{source}_")
        env["DEEPINFER_COMPILE_CACHE"] = cache_dirs[source]
    if arm.endswith("no_quick"):
        env["DEEPINFER_QUICK_COMPILE"] = "off"
    if arm.endswith("chunked"):
        env["DEEPINFER_LOOP_PREFILL"] = "off"
    return env


def dir_bytes(path: str | None) -> int:
    if not path or not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def worker(max_new_tokens: int) -> dict:
    """The main job in this process, with its compile log."""
    import io
    import logging
    import re
    from contextlib import redirect_stdout

    import jax
    jax.config.update("jax_log_compiles", True)
    pattern = re.compile(r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation)"
                         r"(?: of| for)? ?(.*?) in ([0-9.e-]+) sec")
    events: list[dict] = []

    class Handler(logging.Handler):
        def emit(self, record):
            m = pattern.search(record.getMessage())
            if m:
                events.append(dict(stage=m.group(1), program=m.group(2),
                                   seconds=float(m.group(3)),
                                   done_at_s=time.perf_counter() - WORKER_START))

    handler = Handler(logging.DEBUG)
    for name in ("jax._src.interpreters.pxla", "jax._src.dispatch", "jax._src.compiler"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    from deepinfer_fn import __main__ as cli
    from deepinfer_fn import program_cache
    import_s = time.perf_counter() - WORKER_START
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(JOB + ["--max-new-tokens", str(max_new_tokens), "--quiet"])
    stats = program_cache.stats
    return dict(rc=rc, import_s=import_s, in_process_s=time.perf_counter() - WORKER_START,
                device=str(jax.devices()[0].device_kind),
                compiles=[e for e in events if e["stage"] == "XLA compilation"],
                tracing_s=sum(e["seconds"] for e in events if e["stage"].startswith("tracing")),
                lowering_s=sum(e["seconds"] for e in events if e["stage"].startswith("jaxpr")),
                program_cache=dict(loaded=stats.loaded, compiled=stats.compiled,
                                   stored=stats.stored, load_s=stats.load_seconds,
                                   store_s=stats.store_seconds),
                text_chars=len(out.getvalue()))


def run_arm(arm: str, cache_dirs: dict, max_new_tokens: int, timeout: float) -> dict:
    env = arm_env(arm, cache_dirs)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           "--max-new-tokens", str(max_new_tokens)]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(arm=arm, error=f"timed out after {timeout:.0f} s")
    row = dict(arm=arm, wall_s=time.perf_counter() - t0, rc=res.returncode)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(MARK)]
    if res.returncode or not lines:
        row["error"] = (res.stderr or res.stdout)[-1500:]
        return row
    row.update(json.loads(lines[-1][len(MARK):]))
    cache = env.get("DEEPINFER_COMPILE_CACHE")
    row["cache_bytes_after"] = dir_bytes(cache if cache != "off" else None)
    return row


def line(row: dict) -> str:
    if "error" in row:
        return f"{row['arm']:18s} ERROR {row['error'][-300:]}"
    progs = ", ".join(f"{c['program']} {c['seconds']:.1f} s (done at {c['done_at_s']:.1f})"
                      for c in row["compiles"] if c["seconds"] >= 0.5)
    pc = row["program_cache"]
    return (f"{row['arm']:18s} wall {row['wall_s']:6.1f} s  in-process {row['in_process_s']:6.1f}"
            f"  store {pc['store_s']:.1f} s  cache {row['cache_bytes_after'] / 2**20:.0f} MiB"
            f"  | {progs}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated of {ARMS}")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds an arm may run")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(MARK + json.dumps(worker(args.max_new_tokens)), flush=True)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {ARMS}")
    if "warm" in arms and "cold" not in arms[:arms.index("warm")]:
        ap.error("the warm arm reuses the cold arm's directory: list cold before warm")
    cache_dirs: dict = {}
    rows = []
    try:
        for arm in arms:
            row = run_arm(arm, cache_dirs, args.max_new_tokens, args.timeout)
            print(line(row), flush=True)
            rows.append(row)
    finally:
        for d in cache_dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    result = dict(command="python benchmarks/mainjob_breakdown.py " + " ".join(argv or sys.argv[1:]),
                  job="python -m deepinfer_fn " + " ".join(JOB[:2]) + ' "import os" '
                  + " ".join(JOB[3:]) + f" --max-new-tokens {args.max_new_tokens}",
                  date=time.strftime("%Y-%m-%d"), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
