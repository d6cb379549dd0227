"""How far implementations of one prefill op disagree, per call and in a whole prefill's
logits, next to the spread between two XLA formulas of the same op: to tell a kernel fault
(large per-call error) from rounding differences that the network amplifies (per-call errors
at bf16 level, logits far apart for every pair, the XLA pair included).

The default set: the XLA reference, the reference with a relative error of about the
kernel's size in every call (`xla_perturbed`), and the Mosaic GPU kernel. One chunk from an
empty state with random weights (`lean.random_weights`). The op's calls are
captured on the reference implementation (their arguments, through a callback), each call is
replayed on every implementation, and the prefill runs once per implementation.

    python benchmarks/kernel_agreement.py --preset v4.1-mini --tokens 4096 --out FILE.json
    python benchmarks/kernel_agreement.py --preset tiny --tokens 64 --impls xla,xla_dense  # CPU

Implementations that cannot run on this machine (`available()` false: the Mosaic GPU kernel
off an sm_90 GPU) are skipped and listed under "skipped".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import deepinfer_fn as di  # noqa: E402
from benchmarks import lean  # noqa: E402
from benchmarks.prefill_kernels import agreement  # noqa: E402
from deepinfer_fn import kernels  # noqa: E402
from deepinfer_fn.kernel_registry import implementation, register  # noqa: E402

CAPTURE = "capture"
PERTURBED = "xla_perturbed"
OP = "chunk_attention"
_CALLS: list = []
_EPS = {"value": 2.0 ** -8}


@register(OP, CAPTURE)
def captured_chunk_attention(*args, **kwargs):
    """The XLA reference, saving each call's arguments (host copies) in _CALLS."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def save(*values):
        out = list(leaves)
        for i, v in zip(arrays, values):
            out[i] = np.asarray(v)
        _CALLS.append(jax.tree.unflatten(tree, out))
    jax.debug.callback(save, *[leaves[i] for i in arrays])
    return implementation(OP, "xla")(*args, **kwargs)


captured_chunk_attention.opt_in = True


@register(OP, PERTURBED)
def perturbed_chunk_attention(*args, **kwargs):
    """The XLA reference's output times 1 + eps * u (u uniform in [-1, 1], a fixed key): an
    error of a given size in every call, to see how much the network amplifies it."""
    o = implementation(OP, "xla")(*args, **kwargs)
    u = jax.random.uniform(jax.random.key(11), o.shape, minval=-1.0, maxval=1.0)
    return (o.astype(jnp.float32) * (1.0 + _EPS["value"] * u)).astype(o.dtype)


perturbed_chunk_attention.opt_in = True


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def prefill_logits(cfg, params, ids, impl: str):
    """Logits [B, V] of the last token of one prefill chunk with OP on `impl`."""
    token_map = lean.token_map_for(cfg)[1]
    with kernels.use(OP, impl):
        state = di.init_state(cfg, ids.shape[0], ids.shape[1] + 256, dtype=jnp.bfloat16)
        logits, _ = jax.jit(lean.prefill_fn(token_map))(params, state, ids)
    return jax.block_until_ready(logits)


def replay(call, impls: list[str]) -> dict:
    """One captured call on each implementation: errors against the first (the reference),
    over the real tokens (positions < n_new)."""
    args, kwargs = call
    args = jax.tree.map(jnp.asarray, args)
    kwargs = jax.tree.map(jnp.asarray, kwargs)
    n = int(np.min(np.asarray(args[3])))
    outs = {}
    for impl in impls:
        with kernels.use(OP, impl):
            outs[impl] = jax.block_until_ready(kernels.chunk_attention(*args, **kwargs))[:, :n]
    ref = outs[impls[0]]
    extra = kwargs.get("extra_keys")
    return {"tokens": int(args[0].shape[1]), "extra_keys": None if extra is None
            else list(extra.shape), "q_norm": kwargs.get("q_norm_eps") is not None,
            "rel_err": {impl: rel_err(o, ref) for impl, o in outs.items()
                        if impl != impls[0]}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v4.1-mini")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--impls", default=f"xla,{PERTURBED},mosaic_gpu",
                    help="implementations of chunk_attention, the reference first "
                         f"({PERTURBED}: the reference with a relative error of --eps)")
    ap.add_argument("--eps", type=float, default=2.0 ** -8,
                    help=f"{PERTURBED}'s relative perturbation (uniform, this half-width)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    _EPS["value"] = args.eps
    known = kernels.implementations(OP)
    for impl in impls:
        if impl not in known:
            ap.error(f"--impls: {OP} has no implementation {impl!r}; known: {list(known)}")
    skipped = [i for i in impls if not getattr(implementation(OP, i), "available", lambda: True)()]
    impls = [i for i in impls if i not in skipped]
    if not impls:
        ap.error("--impls: none of them can run on this machine")
    cfg = di.ModelConfig.preset(args.preset)
    params = lean.random_weights(cfg, jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (1, args.tokens), 0, cfg.vocab_size, jnp.int32)
    _CALLS.clear()
    prefill_logits(cfg, params, ids, CAPTURE)
    jax.effects_barrier()
    calls = [replay(c, impls) for c in _CALLS]
    _CALLS.clear()
    logits = {impl: prefill_logits(cfg, params, ids, impl) for impl in impls}
    pairs = {f"{a}~{b}": agreement(logits[a], logits[b])
             for i, a in enumerate(impls) for b in impls[i + 1:]}
    result = dict(preset=args.preset, tokens=args.tokens, op=OP, impls=impls, eps=args.eps,
                  device=jax.devices()[0].device_kind, skipped=skipped,
                  calls=calls, logits=pairs)
    worst = {impl: max((c["rel_err"][impl] for c in calls), default=0.0) for impl in impls[1:]}
    result["worst_call_rel_err"] = worst
    print(json.dumps({"worst_call_rel_err": worst, "logits": pairs}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
