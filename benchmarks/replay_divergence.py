"""Logit divergence of SWA bounded replay vs exact recompute as a function of R.

On the embedded default model (f32, window 128, CSA ratio 4, HCA ratio 16): for each sequence
(CPython standard-library sources, in-distribution for this model, and uniform random ids),
a prefix-cache hit at `--hit` tokens is rebuilt by `engine.replay.replay_divergence` (cached
rows + replay of the R tokens before the hit, the engine's recipe), and the logits of the
`--len - --hit` following positions (teacher-forced) are compared with an exact full prefill:
max |dlogit| over those positions, at the first one (the hit) and at the last, and top-1
agreement. Also the prefill work per request: R + suffix token-passes instead of hit + suffix.

    python benchmarks/replay_divergence.py --out benchmarks/results/replay_divergence.json
    (also writes the .png next to it: error per position after the hit, one curve per R)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_fn as di
from deepinfer_fn.engine.replay import replay_divergence

STDLIB_FILES = ("json/decoder.py", "textwrap.py", "fractions.py")


def sequences(n_tokens: int, n_random: int):
    from tokenizers import Tokenizer
    import sysconfig
    tok = Tokenizer.from_file(os.path.join(di.default_model_path(), "tokenizer.json"))
    out = {}
    for rel in STDLIB_FILES:
        with open(os.path.join(sysconfig.get_paths()["stdlib"], rel), encoding="utf-8") as f:
            ids = [0] + tok.encode(f.read(), add_special_tokens=False).ids
        out[f"stdlib:{rel}"] = ids[:n_tokens]
    rng = np.random.default_rng(0)
    for i in range(n_random):
        out[f"random:{i}"] = rng.integers(2, 4096, n_tokens).tolist()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hit", type=int, default=512)
    ap.add_argument("--len", type=int, default=640)
    ap.add_argument("--replays", default="16,32,64,128,256")
    ap.add_argument("--random", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/replay_divergence.json")
    args = ap.parse_args()
    params = di.load_params(di.default_model_path(), dtype=jnp.float32)
    seqs = sequences(args.len, args.random)
    replays = [int(r) for r in args.replays.split(",")] + [args.hit]
    rows = []
    print(f"hit {args.hit}, scored positions {args.hit}..{args.len - 1}; R = {args.hit} is exact")
    print(f"{'R':>5} {'max|dl| mean':>13} {'max|dl| worst':>14} {'at hit':>8} {'at end':>9} "
          f"{'top1':>6} {'prefill passes':>15}")
    for R in replays:
        per = {name: replay_divergence(params, ids, args.hit, R) for name, ids in seqs.items()}
        suffix = args.len - args.hit
        row = dict(replay=R, exact=R >= args.hit,
                   max_abs_mean=float(np.mean([r["max_abs"] for r in per.values()])),
                   max_abs_worst=float(np.max([r["max_abs"] for r in per.values()])),
                   first_abs_mean=float(np.mean([r["first_abs"] for r in per.values()])),
                   last_abs_mean=float(np.mean([r["last_abs"] for r in per.values()])),
                   top1_agreement_mean=float(np.mean([r["top1_agreement"] for r in per.values()])),
                   prefill_token_passes=min(R, args.hit) + suffix,
                   prefill_token_passes_no_cache=args.len,
                   per_position_mean=np.mean([r["per_position"] for r in per.values()], 0).tolist(),
                   per_sequence=per)
        rows.append(row)
        print(f"{R:5d} {row['max_abs_mean']:13.4f} {row['max_abs_worst']:14.4f} "
              f"{row['first_abs_mean']:8.4f} {row['last_abs_mean']:9.5f} "
              f"{row['top1_agreement_mean']:6.3f} {row['prefill_token_passes']:8d} / {args.len}",
              flush=True)
    out = dict(model="embedded default model (f32)", device=jax.devices()[0].device_kind,
               hit=args.hit, length=args.len, sequences=list(seqs), results=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)
    plot(rows, args, args.out.rsplit(".", 1)[0] + ".png")


def plot(rows, args, path):
    """Mean over sequences of max |dlogit| at each position after the hit, one curve per R."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        if row["exact"]:
            continue
        y = np.maximum(np.array(row["per_position_mean"]), 1e-7)
        ax.semilogy(np.arange(len(y)), y, label=f"R = {row['replay']}")
    ax.set_xlabel(f"position - hit (hit = {args.hit})")
    ax.set_ylabel("max |dlogit| vs exact (mean over sequences)")
    ax.set_title("SWA bounded replay on the embedded default model (window 128)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
