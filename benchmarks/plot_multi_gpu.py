"""Plots a benchmarks/multi_gpu.py results file: decode tokens/s vs device count (fixed vs
ragged dispatch, per sequences per device) and the MoE layer's step time vs its roofline.

    python benchmarks/plot_multi_gpu.py RESULTS.json [MORE.json ...]   # -> RESULTS.png

Several files (one per command of a split run) are merged, later sections replacing earlier.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def decode_series(points):
    """{(dispatch, seqs per device): [(devices, tokens/s)]} from decode_scaling points; the
    one-device point (no dispatch) starts every series."""
    pts = [p for p in points if "skipped" not in p]
    single = {p["seqs_per_device"]: p for p in pts if p["devices"] == 1}
    out = {}
    for p in pts:
        if p["devices"] == 1:
            continue
        out.setdefault((p["dispatch"], p["seqs_per_device"]), []).append(
            (p["devices"], p["tokens_per_s"]))
    for (d, s), series in out.items():
        if s in single:
            series.append((1, single[s]["tokens_per_s"]))
        series.sort()
    return out


def merged(paths) -> dict:
    """One results dict from several files: top-level keys of later files win."""
    data = {}
    for p in paths:
        with open(p) as f:
            data.update(json.load(f))
    return data


def main(*paths):
    if not paths:
        raise SystemExit(__doc__)
    data = merged(paths)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (dispatch, s), series in sorted(decode_series(
            data.get("decode_scaling", {}).get("points", [])).items()):
        a1.plot([g for g, _ in series], [t for _, t in series],
                "o-" if dispatch == "fixed" else "s--", label=f"{dispatch}, {s} seqs/device")
    a1.set_xlabel("devices")
    a1.set_ylabel("decode tokens/s")
    a1.set_title(f"{data.get('decode_scaling', {}).get('preset', '?')} decode on "
                 f"{data['device_kind']}")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    moe = [p for p in data.get("moe_layer", {}).get("points", []) if "skipped" not in p]
    for dispatch in sorted({p["dispatch"] for p in moe}):
        rs = sorted((p for p in moe if p["dispatch"] == dispatch and p["routing"] == "uniform"),
                    key=lambda p: p["tokens_per_device"])
        n = [p["tokens_per_device"] for p in rs]
        a2.plot(n, [p["step_s"] * 1e3 for p in rs], "o-", label=f"{dispatch} measured")
        a2.plot(n, [p["roofline_s"] * 1e3 for p in rs], "x:", label=f"{dispatch} roofline")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("tokens per device")
    a2.set_ylabel("MoE layer step (ms)")
    layer = data.get("moe_layer", {})
    sh = layer.get("shapes", {})
    a2.set_title(f"MoE layer E={sh.get('experts')} top-{sh.get('k')} D={sh.get('hidden')} "
                 f"I={sh.get('inter')}, EP={layer.get('ep', '?')}, uniform", fontsize=10)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(data["note"], fontsize=9)
    fig.tight_layout()
    out_png = paths[0].replace(".json", ".png")
    fig.savefig(out_png, dpi=120)
    print(f"wrote {out_png}")


if __name__ == "__main__":
    main(*sys.argv[1:])
