"""Partial output files: which results a file already holds, and where its valid part ends.

A result line is valid when it is newline-terminated JSON of an object with a string
``custom_id``. Reading stops at the first line that is not (an interrupted write leaves at most
one such line, the last); the file is cut there before a resumed run appends to it.
"""

from __future__ import annotations

import collections
import json
import os


def scan(path: str | os.PathLike) -> tuple[dict[str, int], int]:
    """(custom_id -> number of valid result lines, byte length of the valid prefix) of an
    output file ({}, 0 when it does not exist)."""
    counts: collections.Counter = collections.Counter()
    if not os.path.exists(path):
        return {}, 0
    valid = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                line = json.loads(raw)
            except ValueError:
                break
            cid = line.get("custom_id") if isinstance(line, dict) else None
            if not isinstance(cid, str):
                break
            counts[cid] += 1
            valid += len(raw)
    return dict(counts), valid


def truncate_to(path: str | os.PathLike, size: int) -> None:
    """Cuts the file at `size` bytes (the end of its valid prefix)."""
    with open(path, "r+b") as f:
        f.truncate(size)
