"""A JSONL file of requests in, a JSONL file of results out (`python -m deepinfer_fn batch`).

    summary = run_batch_file("requests.jsonl", "responses.jsonl", resume=True)

One result line per request line (blank lines are skipped), each flushed as it is written.
order "input" writes a result as soon as every earlier line's is written (so a partial file is
a prefix of the full one, and a resumed run appends exactly the rest); order "finish" writes
each as its request finishes. An existing output file needs resume=True (keep its valid
lines, `resume.scan`, cut anything after them, run only the missing requests) or
overwrite=True. With deterministic sampling (greedy or seeded) and a fixed `created`, a
resumed run in input order yields the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import sys
import time

from deepinfer_fn.batch import resume as partial
from deepinfer_fn.batch.runner import run_batch
from deepinfer_fn.errors import ArgumentError

ORDERS = ("input", "finish")


def is_error(line: dict) -> bool:
    """Whether a result line reports an error (either envelope)."""
    if line.get("error") is not None:
        return True
    response = line.get("response")
    if isinstance(response, dict):
        return response.get("status_code") != 200
    result = line.get("result")
    return isinstance(result, dict) and result.get("type") != "succeeded"


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def _dump(line: dict) -> str:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"


class _Writer:
    """Writes result lines in input order or as they come; flushes each."""

    def __init__(self, out, order: str):
        self.out, self.order = out, order
        self.pending: dict[int, dict | None] = {}
        self.next = 0
        self.written = 0

    def add(self, position: int, line: dict | None) -> None:
        if self.order == "finish":
            self._write(line)
            return
        self.pending[position] = line
        while self.next in self.pending:
            self._write(self.pending.pop(self.next))
            self.next += 1

    def _write(self, line):
        if line is not None:
            self.out.write(_dump(line))
            self.out.flush()
            self.written += 1


def run_batch_file(input_path: str | os.PathLike, output_path: str | os.PathLike, model=None, *,
                   resume: bool = False, overwrite: bool = False, order: str = "input",
                   progress: bool = True, **kwargs) -> dict:
    """Runs every request line of `input_path`, writing result lines to `output_path`
    ("-": stdout). kwargs go to `run_batch` (engine, engine_options, default_format,
    default_thinking, default_max_tokens, created, window). Returns a summary dict: requests
    (non-blank lines), written, resumed (lines kept from the partial file), errors (among the
    written), generated_tokens, seconds."""
    input_path, output_path = os.fspath(input_path), os.fspath(output_path)
    if order not in ORDERS:
        raise ArgumentError(f"order must be one of {ORDERS}, got {order!r}")
    if not os.path.isfile(input_path):
        raise ArgumentError(f"input {input_path!r} is not a file")
    to_stdout = output_path == "-"
    if to_stdout and resume:
        raise ArgumentError("resume needs an output file, not stdout")
    if resume and overwrite:
        raise ArgumentError("pass resume or overwrite, not both")
    done, keep = {}, 0
    if not to_stdout and os.path.exists(output_path) and os.path.getsize(output_path) > 0:
        if resume:
            done, keep = partial.scan(output_path)
        elif not overwrite:
            raise ArgumentError(f"output {output_path!r} exists: resume it (--resume) or "
                                "replace it (--overwrite)")
    total = _count_lines(input_path)
    resumed = sum(done.values())
    t0 = time.perf_counter()
    errors = generated = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, initial=min(resumed, total), unit="req", desc="batch",
                   file=sys.stderr, dynamic_ncols=True)
    if not to_stdout:
        if resume and os.path.exists(output_path):
            partial.truncate_to(output_path, keep)
        out = open(output_path, "a" if resume else "w", encoding="utf-8")
    else:
        out = sys.stdout
    try:
        writer = _Writer(out, order)
        with open(input_path, encoding="utf-8", errors="replace") as lines:
            for r in run_batch(lines, model, done=done, **kwargs):
                writer.add(r.position, r.line)
                if r.line is None:
                    continue
                errors += is_error(r.line)
                generated += len(r.output.tokens) if r.output is not None else 0
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(errors=errors, tokens=generated, refresh=False)
        assert not writer.pending, sorted(writer.pending)[:5]
    finally:
        if bar is not None:
            bar.close()
        if not to_stdout:
            out.close()
    return {"input": input_path, "output": output_path, "requests": total,
            "written": writer.written, "resumed": resumed, "errors": errors,
            "generated_tokens": generated, "seconds": round(time.perf_counter() - t0, 3)}
