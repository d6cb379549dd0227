"""How far a prefill's logits move when the indexer's scores move by about one bf16 rounding:
the spread that row selections flipping on rounding alone put between two correct
implementations (a kernel and XLA's reference), to read a kernels-vs-XLA difference against.

One chunk from an empty state with random weights (`lean.random_weights`), on XLA, twice: the
indexer scores as computed, then each multiplied by 1 + eps * u, u uniform in [-1, 1] (fixed
key). Prints and writes the logits' relative L2 difference and the share of positions with the
same argmax.

    python benchmarks/selection_sensitivity.py --preset mini --tokens 4096 --out FILE.json
    python benchmarks/selection_sensitivity.py --preset tiny --tokens 64      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import deepinfer_fn as di  # noqa: E402
from benchmarks import lean  # noqa: E402
from benchmarks.prefill_kernels import agreement  # noqa: E402
from deepinfer_fn import kernels, kernels_xla  # noqa: E402
from deepinfer_fn.kernel_registry import register  # noqa: E402

PERTURBED = "xla_perturbed"
_EPS = {"value": 2.0 ** -9}


@register("index_scores", PERTURBED)
def perturbed_index_scores(q_index, head_weights, index_rows):
    """`kernels_xla.index_scores` times 1 + eps * u (u uniform in [-1, 1], a fixed key)."""
    s = kernels_xla.index_scores(q_index, head_weights, index_rows)
    u = jax.random.uniform(jax.random.key(7), s.shape, minval=-1.0, maxval=1.0)
    return s * (1.0 + _EPS["value"] * u)


perturbed_index_scores.opt_in = True


def prefill_logits(cfg, params, tokens: int, impl: str):
    """Logits [1, tokens, V] of one prefill chunk with `index_scores` on `impl`."""
    token_map = lean.token_map_for(cfg)[1]
    ids = jax.random.randint(jax.random.key(2), (1, tokens), 0, cfg.vocab_size, jnp.int32)
    with kernels.use("index_scores", impl):
        state = di.init_state(cfg, 1, tokens + 256, dtype=jnp.bfloat16)
        logits, _ = jax.jit(lean.prefill_fn(token_map))(params, state, ids)
    return logits


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--eps", type=float, default=2.0 ** -9, help="relative score perturbation")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = di.ModelConfig.preset(args.preset)
    params = lean.random_weights(cfg, jnp.bfloat16)
    _EPS["value"] = args.eps
    base = prefill_logits(cfg, params, args.tokens, "xla")
    moved = prefill_logits(cfg, params, args.tokens, PERTURBED)
    row = dict(preset=args.preset, tokens=args.tokens, eps=args.eps,
               device=jax.devices()[0].device_kind, **agreement(moved, base))
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return row


if __name__ == "__main__":
    main()
