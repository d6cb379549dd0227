"""Host cost of structured output on the real 129,280-token DeepSeek-V4 vocabulary (CPU only).

For a JSON schema, a regex and an EBNF arithmetic grammar: the llguidance compile time of one
request, then a walk through a valid answer (the V4 tokenization of a reference string) timing at
every step the packed allowed-token mask (`Matcher.fill_mask`: 4,040 uint32 words) and the token
consume. Then the batched host step of generate()'s decode loop (`ConstrainedBatch.step`: consume B
tokens + B masks through llguidance's parallel executor) for B = 1, 8, 32 rows of the same schema,
the on-device unpack of B packed masks (jitted, CPU), and the end-to-end per-step overhead of the
io_callback in the decode loop (tiny random model with the V4 vocabulary, constrained vs free).

    python benchmarks/structured_mask.py [--out benchmarks/results/structured_mask.json] [--quick]
    python benchmarks/structured_mask.py --loop-only --batches 4,32 --out loop_gpu.json  # on a GPU

Speculative decoding (generate(..., constraint=..., speculative="mtp")): the host work of one
verify step with k drafts -- k `ConstrainedBatch.draft_step` calls (consume draft j, mask after
it) and one `commit` (roll back the rejected drafts, consume the correction/bonus token, next
mask) -- for each constraint and B = 1, 8, 32 rows, walking the reference answers with the
drafts = the true continuation and the accepted count g drawn uniformly from 0..k (so rollbacks
of 0..k drafts all occur). `--speculative-loop` adds the decode-loop overhead of the
speculative path (tiny random model, V4 vocabulary; constrained speculative vs free
speculative, per verify step):

    python benchmarks/structured_mask.py --spec-only [--k 3] --out structured_mask_spec.json
    python benchmarks/structured_mask.py --loop-only --speculative-loop --batches 4,32 --out loop_spec_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--loop-only" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_fn as di
from deepinfer_fn import structured
from deepinfer_fn.structured import ConstrainedBatch, Grammar, JsonSchema, Matcher, Regex

VOCAB = 129280

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "email", "address"], "additionalProperties": False,
}
SCHEMA_EXAMPLE = json.dumps(
    {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada.king@analytical.org",
     "tags": ["admin", "user"], "address": {"city": "London, Marylebone", "zip": "10115"},
     "score": 0.9375}, separators=(",", ":"))

REGEX = (r"(Mr|Ms|Dr)\. [A-Z][a-z]{1,20} [A-Z][a-z]{1,20}, born \d{4}-\d{2}-\d{2}, "
         r"email [a-z0-9.]{1,30}@[a-z]{2,12}\.(com|org|net)")
REGEX_EXAMPLE = "Dr. Grace Hopper, born 1906-12-09, email grace.hopper@navy.net"

ARITHMETIC = r"""
start: expr
expr: term (ADDOP term)*
term: factor (MULOP factor)*
factor: NUMBER | "(" expr ")" | "-" factor
ADDOP: "+" | "-"
MULOP: "*" | "/"
NUMBER: /[0-9]{1,3}(\.[0-9]{1,2})?/
"""
ARITHMETIC_EXAMPLE = "(12+34.5)*-(6-7/(8+9.25))+100*(3-(2+1))/-4.75-((1+2)*(3+4))"

CASES = [("json_schema", JsonSchema(SCHEMA), SCHEMA_EXAMPLE),
         ("regex", Regex(REGEX), REGEX_EXAMPLE),
         ("arithmetic_grammar", Grammar(ARITHMETIC), ARITHMETIC_EXAMPLE)]


def stats(xs) -> dict:
    a = np.asarray(xs) * 1e3
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)),
            "p90_ms": float(np.percentile(a, 90)), "max_ms": float(a.max()), "n": int(a.size)}


def walk(constraint, tok, ids):
    """Time compile, then mask + consume at every step of a valid answer (then EOS)."""
    t0 = time.perf_counter()
    m = Matcher(constraint, tok, VOCAB)
    compile_s = time.perf_counter() - t0
    assert m.error is None, m.error
    out = np.zeros((m.words,), np.uint32)
    mask_s, consume_s, allowed = [], [], []
    for t in list(ids) + [tok.eos_id]:
        t0 = time.perf_counter()
        m.fill_mask(out)
        mask_s.append(time.perf_counter() - t0)
        allowed.append(int(np.unpackbits(out.view(np.uint8)).sum()))
        assert structured.unpack_mask(out, VOCAB)[t], (t, tok.decode([t]))
        t0 = time.perf_counter()
        assert m.consume(t), m.error
        consume_s.append(time.perf_counter() - t0)
    assert m.status() == "complete"
    return compile_s, mask_s, consume_s, allowed


def batch_step(constraint, tok, ids, rows, repeats):
    """ConstrainedBatch.step time per decode step for `rows` identical constrained rows."""
    times = []
    for _ in range(repeats):
        batch = ConstrainedBatch.build(constraint, rows, tok, VOCAB)
        batch.initial()
        active = np.ones((rows,), bool)
        for t in ids:
            batch.step(np.full((rows,), t, np.int32), active)
        times += batch.step_seconds
    return times


def spec_verify_steps(constraint, tok, ids, rows, k, repeats, seed=0):
    """Host time of speculative verify steps (k draft_steps + 1 commit) for `rows` identical
    rows walking `ids` (then EOS): per step (draft_s [k], commit_s, accepted g)."""
    rng = np.random.default_rng(seed)
    walk_ids = list(ids) + [tok.eos_id]
    steps = []
    for _ in range(repeats):
        batch = ConstrainedBatch.build(constraint, rows, tok, VOCAB)
        batch.initial()
        active = np.ones((rows,), bool)
        i = 0                                  # committed tokens (the first is consumed plainly)
        batch.step(np.full((rows,), walk_ids[0], np.int32), active)
        i = 1
        while i < len(walk_ids):
            ell = min(k, len(walk_ids) - i - 1)   # the last token must be a correction/bonus
            drafts = walk_ids[i:i + k] + [walk_ids[-1]] * (k - len(walk_ids[i:i + k]))
            n_d0, n_c0 = len(batch.draft_seconds), len(batch.commit_seconds)
            for j in range(k):
                batch.draft_step(np.full((rows,), drafts[j], np.int32), active)
            g = int(rng.integers(0, ell + 1))
            tokens = np.zeros((rows, k + 1), np.int32)
            tokens[:, :g + 1] = walk_ids[i:i + g + 1]
            _, finished, n_keep = batch.commit(tokens, np.full((rows,), g), np.full((rows,), g + 1),
                                               active)
            assert (n_keep == g + 1).all()
            for m in batch.matchers:
                assert m.error is None, m.error
            steps.append((batch.draft_seconds[n_d0:], batch.commit_seconds[n_c0], g))
            i += g + 1
        assert all(m.status() == "complete" for m in batch.matchers)
    return steps


def spec_summary(steps, k) -> dict:
    total = [sum(d) + c for d, c, _ in steps]
    drafts = [x for d, _, _ in steps for x in d]
    commits = [c for _, c, _ in steps]
    return {"k": k, "verify_step": stats(total), "draft_step": stats(drafts),
            "commit": stats(commits), "mean_accepted": float(np.mean([g for *_, g in steps])),
            "host_ms_per_committed_token": float(np.sum(total) * 1e3
                                                 / np.sum([g + 1 for *_, g in steps]))}


def spec_section(tok, k, repeats, results):
    print(f"\nspeculative decoding, host work per verify step (k={k}: {k} draft steps + 1 commit; "
          f"drafts = the true continuation, g ~ U{{0..{k}}}; {os.cpu_count()} CPUs):")
    results["speculative"] = {"k": k, "cases": {}}
    for name, c, example in CASES:
        ids = tok.encode(example)
        per_rows = {}
        for rows in (1, 8, 32):
            sm = spec_summary(spec_verify_steps(c, tok, ids, rows, k, repeats), k)
            # the plain host step (one token per row) in the same conditions, for reference
            sm["plain_step"] = stats(batch_step(c, tok, ids, rows, repeats))
            per_rows[str(rows)] = sm
            v = sm["verify_step"]
            print(f"  {name:<20} B={rows:<3} verify step mean {v['mean_ms']:.3f} ms  median "
                  f"{v['median_ms']:.3f}  p90 {v['p90_ms']:.3f}  (draft step "
                  f"{sm['draft_step']['mean_ms']:.3f}, commit {sm['commit']['mean_ms']:.3f}); "
                  f"{sm['host_ms_per_committed_token']:.3f} ms per committed token (mean g "
                  f"{sm['mean_accepted']:.2f}) vs plain {sm['plain_step']['mean_ms']:.3f} ms")
        results["speculative"]["cases"][name] = per_rows


def device_unpack(rows, repeats=20):
    f = jax.jit(structured.unpack_bitmask, static_argnums=1)
    packed = jnp.asarray(np.random.default_rng(0).integers(0, 2**32, (rows, 4040), np.uint32))
    f(packed, VOCAB).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        f(packed, VOCAB).block_until_ready()
    return (time.perf_counter() - t0) / repeats


def loop_overhead(tok, steps, batch=4, repeats=3, speculative=None, k=3):
    """Per decode step, tiny random model with the V4 vocabulary: generate() with a
    constraint that allows every plain token (free text of exactly `steps` chars is too strict:
    Regex('(?s).{1,4000}') lets the model write) vs the same call unconstrained."""
    cfg = di.ModelConfig.preset("tiny", vocab_size=VOCAB)
    params = di.init_params(cfg, jax.random.key(0))
    prompts = np.asarray([tok.encode("Hello, how are you today? I am")[:8]] * batch, np.int32)
    kw = dict(max_new_tokens=steps, temperature=1.0, seed=list(range(1, batch + 1)))
    if speculative:
        kw.update(speculative=speculative, num_draft_tokens=k)
    built = []  # keep the ConstrainedBatch generate() builds, for its host step times
    build = ConstrainedBatch.__dict__["build"].__func__
    ConstrainedBatch.build = classmethod(lambda cls, *a, **k: built.append(build(cls, *a, **k))
                                         or built[-1])
    arms = {"free": kw, "constrained": dict(kw, constraint=Regex(r"(?s).{1,4000}"),
                                            tokenizer=tok)}
    outs = {}
    for name, ckw in arms.items():  # compile
        outs[name] = di.generate(params, prompts, **ckw)
        outs[name].tokens.block_until_ready()
    best = {name: [] for name in arms}
    for _ in range(repeats):  # the arms interleaved, so a shared machine's load hits both
        for name, ckw in arms.items():
            t0 = time.perf_counter()
            outs[name] = di.generate(params, prompts, **ckw)
            outs[name].tokens.block_until_ready()
            best[name].append(time.perf_counter() - t0)
    res, verify_steps = {}, {}
    for name, out in outs.items():
        # per decode step (plain) or per verify step (speculative: the loop's iterations)
        iters = steps if not speculative else int(np.asarray(out.accepted >= 0).sum(1).max())
        verify_steps[name] = iters
        res[name] = min(best[name]) / iters
    assert all(s == "incomplete" or s == "complete" for s in outs["constrained"].constraint_status)
    ConstrainedBatch.build = classmethod(build)
    if speculative:
        b = built[-1]
        host = (float(np.sum(b.draft_seconds)) + float(np.sum(b.commit_seconds))) * 1e3 \
            / max(1, len(b.commit_seconds))
    else:
        host = float(np.mean(built[-1].step_seconds)) * 1e3
    return {"speculative": speculative, "k": k if speculative else None,
            "loop_iterations": verify_steps,
            "free_ms_per_step": res["free"] * 1e3,
            "constrained_ms_per_step": res["constrained"] * 1e3,
            "overhead_ms_per_step": (res["constrained"] - res["free"]) * 1e3,
            "host_step_ms": host, "batch": batch, "steps": steps,
            "device": str(jax.devices()[0].device_kind)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "structured_mask.json"))
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no decode-loop run")
    ap.add_argument("--loop-only", action="store_true",
                    help="only the decode-loop overhead, on the default JAX backend (e.g. a GPU)")
    ap.add_argument("--batches", default="4", help="batch sizes of the decode-loop run")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per verify step (speculative)")
    ap.add_argument("--spec-only", action="store_true",
                    help="only the speculative host step per verify step (CPU)")
    ap.add_argument("--speculative-loop", action="store_true",
                    help="decode-loop overhead of the speculative (MTP) path instead of plain")
    args = ap.parse_args()
    repeats = 1 if args.quick else 3

    import llguidance
    t0 = time.perf_counter()
    tok = structured.default_tokenizer()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    structured.ll_tokenizer(tok)
    ll_s = time.perf_counter() - t0
    assert tok.vocab_size == VOCAB
    print(f"V4 tokenizer: load {load_s:.2f} s, llguidance tokenizer build {ll_s:.2f} s "
          f"(once per process); mask = {structured.mask_words(VOCAB)} uint32 words")

    results = {"vocab_size": VOCAB, "tokenizer_load_s": load_s, "ll_tokenizer_build_s": ll_s,
               "cases": {}, "batch_step": {}, "device_unpack_ms": {},
               "env": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                       "llguidance": getattr(llguidance, "__version__", "?"),
                       "jax": jax.__version__, "python": platform.python_version()}}
    hdr = (f"{'constraint':<20}{'compile ms':>11}{'steps':>6}{'mask mean':>10}{'median':>8}"
           f"{'p90':>8}{'max':>8}{'consume':>9}{'allowed/step':>14}   (ms; first walk / later walks)")
    spec = "mtp" if args.speculative_loop else None
    unit = f"verify step (k={args.k})" if spec else "step"
    if args.loop_only:
        results["decode_loop"] = [loop_overhead(tok, 64, int(b), speculative=spec, k=args.k)
                                  for b in args.batches.split(",")]
        for lo in results["decode_loop"]:
            print(f"decode loop on {lo['device']}, tiny random model, V={VOCAB}, B={lo['batch']}"
                  f"{', speculative MTP' if spec else ''}: free {lo['free_ms_per_step']:.2f} "
                  f"ms/{unit}, constrained {lo['constrained_ms_per_step']:.2f} ms/{unit}, "
                  f"overhead {lo['overhead_ms_per_step']:.2f} (host {lo['host_step_ms']:.2f})")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        return
    if args.spec_only:
        spec_section(tok, args.k, repeats, results)
        if args.speculative_loop:
            lo = loop_overhead(tok, 32, speculative=spec, k=args.k, repeats=repeats)
            results["decode_loop"] = [lo]
            print(f"\ndecode loop, speculative MTP k={args.k}, tiny random model, V={VOCAB}, B=4 "
                  f"(CPU): free {lo['free_ms_per_step']:.2f} ms/{unit}, constrained "
                  f"{lo['constrained_ms_per_step']:.2f}: overhead {lo['overhead_ms_per_step']:.2f}"
                  f" ms per verify step, of which host {lo['host_step_ms']:.2f} ms")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.out}")
        return
    print(hdr)
    for name, c, example in CASES:
        ids = tok.encode(example)
        walks = [walk(c, tok, ids) for _ in range(repeats)]
        comp, mask, cons, allowed = walks[0]
        later = [x for w in walks[1:] for x in w[1]] or mask
        first, rest = stats(mask), stats(later)
        results["cases"][name] = {
            "example": example, "tokens": len(ids) + 1, "compile_ms": comp * 1e3,
            "mask_first_walk": first, "mask_later_walks": rest, "consume": stats(cons),
            "allowed_tokens_per_step_mean": float(np.mean(allowed))}
        print(f"{name:<20}{comp * 1e3:>11.2f}{len(ids) + 1:>6}"
              f"{first['mean_ms']:>10.3f}{first['median_ms']:>8.3f}{first['p90_ms']:>8.3f}"
              f"{first['max_ms']:>8.3f}{stats(cons)['mean_ms']:>9.3f}{np.mean(allowed):>14.0f}")
        print(f"{'  (later walks)':<20}{'':>11}{'':>6}{rest['mean_ms']:>10.3f}"
              f"{rest['median_ms']:>8.3f}{rest['p90_ms']:>8.3f}{rest['max_ms']:>8.3f}")

    print(f"\nbatched host step (consume + mask for every row; llguidance executor, "
          f"{os.cpu_count()} CPUs), JSON schema:")
    ids = tok.encode(SCHEMA_EXAMPLE)
    for rows in (1, 8, 32):
        s = stats(batch_step(JsonSchema(SCHEMA), tok, ids, rows, repeats))
        results["batch_step"][str(rows)] = s
        dev = device_unpack(rows)
        results["device_unpack_ms"][str(rows)] = dev * 1e3
        print(f"  B={rows:<3} host step mean {s['mean_ms']:.3f} ms  median {s['median_ms']:.3f}"
              f"  p90 {s['p90_ms']:.3f}  ({s['mean_ms'] / rows:.3f} ms/row);  device unpack "
              f"[{rows},4040]->[{rows},{VOCAB}] {dev * 1e3:.3f} ms (CPU, jitted)")

    spec_section(tok, args.k, repeats, results)

    if not args.quick:
        lo = loop_overhead(tok, steps=32)
        results["decode_loop"] = [lo]
        print(f"\ndecode loop, tiny random model, V={VOCAB}, B=4 (CPU): free "
              f"{lo['free_ms_per_step']:.2f} ms/step, constrained {lo['constrained_ms_per_step']:.2f}"
              f" ms/step: overhead {lo['overhead_ms_per_step']:.2f} ms/step, of which the host "
              f"step (4 consumes + 4 masks) {lo['host_step_ms']:.2f} ms; the rest is the callback "
              f"round trip, the unpack and the masked sampling")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
