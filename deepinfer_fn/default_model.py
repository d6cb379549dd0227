"""The embedded default model: a small DeepSeek-V4 checkpoint shipped inside the package.

A ~12M-parameter model with every V4 part (sliding-window, CSA and HCA attention, hash- and
score-routed MoE, mHC, one MTP block), trained on the CPython standard library's own `.py`
sources by `scripts/train_default_model.py`, with a byte-level BPE tokenizer that carries the
V4 chat special tokens. It writes Python-like text, so examples, tests and the speculative
and structured-output paths can run on real (non-random) weights on any machine, offline:

    import deepinfer_fn as di
    model = di.load_model()            # params, tokenizer and DSpark drafter (deepinfer_fn.bundle)
    params = di.load_params(di.default_model_path())     # the weights alone

The directory holds config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json, training_log.json (losses, baselines, samples) and dspark/, the DSpark
drafter trained for it (`scripts/train_dspark.py`).
"""

from __future__ import annotations

import os

_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_path() -> str:
    """Absolute path of the default model's HF-format directory (`assets/default_model/`).

    Raises FileNotFoundError naming what is missing and how to rebuild it.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default_model")
    missing = [f for f in _FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        where = "does not exist" if not os.path.isdir(path) else f"lacks {missing}"
        raise FileNotFoundError(
            f"the embedded default model directory {path} {where}. It ships with the source "
            f"tree (an install without package data leaves it out); rebuild it with "
            f"`python scripts/train_default_model.py --out {path}`")
    return path
