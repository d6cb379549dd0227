"""Joins the per-process JSONs of benchmarks/speculative_table.sh into one result (the arms of
each concurrency side by side) and plots it:

    python benchmarks/speculative_merge.py OUTDIR --out benchmarks/results/speculative_h200.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.speculative import plot  # noqa: E402


def merge(paths: list[str]) -> dict:
    merged, by_n = None, {}
    for path in sorted(paths):
        with open(path) as f:
            res = json.load(f)
        if merged is None or "dynamic" in json.dumps([e["arms"] for e in res["concurrency"]]):
            base = dict(res, concurrency=[])
            merged = base if merged is None else dict(base, sources=merged.get("sources", []))
        merged.setdefault("sources", []).append(os.path.basename(path))
        for e in res["concurrency"]:
            cur = by_n.setdefault(e["n"], dict(n=e["n"], arms={}, times={}))
            cur["arms"].update(e["arms"])
            cur["times"].update(e["times"])
            for k, v in e.items():
                if k not in ("arms", "times", "n"):
                    cur[k] = v
    for e in by_n.values():
        arms = e["arms"]
        if "plain" in arms:
            for a in ("fixed", "dynamic"):
                if a in arms:
                    e[f"{a}_over_plain"] = arms[a]["real_tok_s"] / arms["plain"]["real_tok_s"]
        if "fixed" in arms and "dynamic" in arms:
            e["dynamic_over_fixed"] = arms["dynamic"]["real_tok_s"] / arms["fixed"]["real_tok_s"]
    merged["concurrency"] = [by_n[n] for n in sorted(by_n)]
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    paths = [p for p in glob.glob(os.path.join(args.outdir, "*.json"))
             if not os.path.basename(p).startswith("verify_cost")]
    res = merge(paths)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'N':>4} {'arm':>8} {'ell':>5} {'acc':>6} {'tau':>5} {'real tok/s':>11} "
          f"{'all-acc tok/s':>13} {'step ms':>8}")
    for e in res["concurrency"]:
        for arm, r in e["arms"].items():
            extra = (f"{r['mean_verify_len']:5.2f} {r['acceptance_rate']:6.3f} {r['tau']:5.2f} "
                     if arm != "plain" else f"{'':5} {'':6} {'':5} ")
            allacc = f"{r['all_accepted_tok_s']:13.1f}" if arm != "plain" else f"{'':13}"
            step = f"{r['step_seconds'] * 1e3:8.3f}" if arm != "plain" else ""
            print(f"{e['n']:>4} {arm:>8} {extra}{r['real_tok_s']:11.1f} {allacc} {step}")
        for k in ("dynamic_over_fixed", "fixed_over_plain", "dynamic_over_plain"):
            if k in e:
                print(f"{e['n']:>4} {k}: {e[k]:.3f}")
    print(f"wrote {args.out}")
    plot(res, args.out.replace(".json", ".png"))


if __name__ == "__main__":
    main()
