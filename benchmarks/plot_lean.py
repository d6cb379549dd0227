"""Plots a benchmarks/lean.py results JSON into a PNG beside it (four panels: compile
seconds, decode step vs the HBM roofline per preset and Engram store, prefill against the
bf16 peak per preset, kernels per decode step by category).

    python benchmarks/plot_lean.py benchmarks/results/lean_h200.json
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _ok(rows):
    return [r for r in rows if "error" not in r]


def _compile_panel(ax, data):
    rows = [r for m in data.get("compile", {}).get("models", {}).values()
            for r in m.get("rows", []) if "error" not in r or "lower_plus_compile_s_at_least" in r]
    labels = [f"{r['model']}\n{r['program']}" for r in rows]
    ok = [i for i, r in enumerate(rows) if "error" not in r]
    late = [i for i, r in enumerate(rows) if "error" in r]
    ax.bar(ok, [rows[i]["lower_s"] for i in ok], label="lower")
    ax.bar(ok, [rows[i]["compile_s"] for i in ok], bottom=[rows[i]["lower_s"] for i in ok],
           label="compile")
    if late:
        ax.bar(late, [rows[i]["lower_plus_compile_s_at_least"] for i in late], hatch="//",
               fill=False, label="timed out (at least)")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("seconds (persistent cache off)")
    ax.set_title("compile: lower + compile per program")
    ax.legend(fontsize=7)


def _series(row) -> str:
    """A decode row's curve: preset (V4.1: and its Engram store) and context."""
    name = row.get("preset", "")
    if row.get("engram"):
        name += f" {row['engram']} tables"
    return f"{name} ctx {row['context']}".strip()


def _decode_panel(ax, data):
    rows = _ok(data.get("decode", {}).get("rows", []))
    rows = [r for r in rows if r.get("kind") == "decode"]
    markers = {}
    for series in sorted({_series(r) for r in rows}):
        rs = sorted((r for r in rows if _series(r) == series), key=lambda r: r["batch"])
        mk = markers.setdefault(rs[0].get("preset"), "os^dv"[len(markers) % 5])
        b = [r["batch"] for r in rs]
        line, = ax.plot(b, [r["step_ms"] for r in rs], mk + "-", label=f"measured, {series}")
        if rs[0].get("engram") != "host":       # the host arm has the device arm's roofline
            ax.plot(b, [r["roofline_ms"] for r in rs], "x--", color=line.get_color(),
                    label=f"HBM roofline, {series}")
        for r in rs:
            ax.annotate(f"{r['roofline_ratio']:.0%}", (r["batch"], r["step_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    peer = [r for r in _ok(data.get("peer", {}).get("rows", [])) if "step_ms" in r]
    if peer:
        ax.plot([r["batch"] for r in peer], [r["step_ms"] for r in peer], "^", color="gray",
                label=f"transformers eager, ctx {peer[0]['context']}")
    bw = [r for r in data.get("decode", {}).get("rows", []) if r.get("kind") == "bandwidth"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode step (ms)")
    title = "decode step vs roofline"
    if bw:
        title += f" (HBM {bw[0]['Bps'] / 1e9:.0f} GB/s measured)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)


def _prefill_panel(ax, data):
    rows = [r for r in _ok(data.get("prefill", {}).get("rows", [])) if r.get("kind") == "prefill"]
    peer = [r for r in _ok(data.get("peer", {}).get("rows", [])) if r.get("name") == "prefill"]
    labels = [f"{r.get('preset', '')}\n{r['batch']}x{r['tokens']}" for r in rows]
    ax.bar(range(len(rows)), [r["peak_ratio"] for r in rows], label="matmul + attention FLOPs")
    ax.bar(range(len(rows)), [r["matmul_peak_ratio"] for r in rows], width=0.4,
           label="matmul FLOPs only")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['tokens_per_s'] / 1e3:.1f}k tok/s", (i, r["peak_ratio"]), fontsize=7,
                    ha="center", textcoords="offset points", xytext=(0, 3))
    dense = [i for i, r in enumerate(rows) if "dense_peak_ratio" in r]
    if dense:
        ax.scatter(dense, [rows[i]["dense_peak_ratio"] for i in dense], marker="_", s=300,
                   color="k", label="V4.1: dense attention as run", zorder=3)
    tops = [r["peak_ratio"] for r in rows] + [rows[i]["dense_peak_ratio"] for i in dense]
    if tops:
        ax.set_ylim(0, 1.35 * max(tops))                  # room for the legend above the bars
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("fraction of the measured bf16 peak")
    pk = [r for r in data.get("prefill", {}).get("rows", []) if r.get("kind") == "peak"]
    title = "prefill / bf16 peak"
    if pk:
        title += f" ({pk[0]['flops_per_s'] / 1e12:.0f} TFLOP/s measured)"
    if peer:
        title += f"\npeer eager 1x{peer[0]['tokens']}: {peer[0]['tokens_per_s'] / 1e3:.1f}k tok/s"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _kernels_panel(ax, data):
    rows = _ok(data.get("kernels", {}).get("rows", []))
    if not rows:
        ax.set_title("kernels: not measured")
        return
    cats = sorted({c for r in rows for c in r["report"]["by_category"]},
                  key=lambda c: -max(r["report"]["by_category"].get(c, 0) for r in rows))[:8]
    bottom = [0] * len(rows)
    for c in cats:
        vals = [r["report"]["by_category"].get(c, 0) for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=c)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['report']['kernels']}" for r in rows],
                  fontsize=7)
    ax.set_ylabel("kernels per decode step")
    ax.set_title("kernels per decode step (by category)", fontsize=9)
    ax.legend(fontsize=6)


def plot(path: str) -> str:
    """Writes the PNG of one results JSON; returns its path."""
    with open(path) as f:
        data = json.load(f)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _compile_panel(axes[0, 0], data)
    _decode_panel(axes[0, 1], data)
    _prefill_panel(axes[1, 0], data)
    _kernels_panel(axes[1, 1], data)
    meta = data.get("meta", {})
    fig.suptitle(f"deepinfer_fn lean benchmark ({meta.get('started', '')}"
                 f"{', quick' if meta.get('quick') else ''})", fontsize=10)
    fig.tight_layout()
    out = path[:-len(".json")] + ".png" if path.endswith(".json") else path + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(plot(sys.argv[1]))
