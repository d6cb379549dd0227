"""Plots benchmarks/results/decode_*.json: achieved decode step time vs the roofline.

    python benchmarks/plot_decode.py benchmarks/results/decode_mini_h200.json
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path):
    data = json.load(open(path))
    rows = [r for r in data["results"] if r["kernels"]["grouped_matmul"] != "xla" or r["batch"] == 1]
    fig, ax = plt.subplots(figsize=(7, 4))
    for ctx in sorted({r["context"] for r in rows}):
        rs = sorted((r for r in rows if r["context"] == ctx), key=lambda r: r["batch"])
        b = [r["batch"] for r in rs]
        ax.plot(b, [r["step_ms"] for r in rs], "o-", label=f"measured, context {ctx}")
        ax.plot(b, [r["roofline_ms"] for r in rs], "x--", label=f"HBM roofline, context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"{data['preset']} decode on {data['device']} "
                 f"(HBM {data['hbm_bandwidth_Bps'] / 1e12:.2f} TB/s measured)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    out = path.replace(".json", ".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
