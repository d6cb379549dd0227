"""Checkpoint tensor names: official DeepSeek names and transformers `save_pretrained` names
normalised to the official ones (docs/MODEL.md §5.1)."""

from __future__ import annotations

import re

_EXACT = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_ATTN_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")


def normalize_name(name: str) -> str:
    """Official name of a tensor written under either naming scheme.

    `model.layers.1.attn.norm.weight` -> `layers.1.attn.kv_norm.weight`,
    `model.embed_tokens.weight` -> `embed.weight`, `X.weight_scale_inv` -> `X.scale`, ...
    """
    if name.startswith("model."):
        name = name[len("model."):]
    if name.endswith(".weight_scale_inv"):
        name = name[: -len(".weight_scale_inv")] + ".scale"
    name = _EXACT.get(name, name)
    m = _ATTN_NORM.match(name)
    if m:
        name = f"{m.group(1)}.kv_norm.weight"
    return name


def scale_name(weight_name: str) -> str:
    """`layers.0.attn.wq_a.weight` -> `layers.0.attn.wq_a.scale` (official companion)."""
    assert weight_name.endswith(".weight"), weight_name
    return weight_name[: -len(".weight")] + ".scale"


VISION_PREFIXES = ("vision.", "aligner.", "image_")


def is_vision_name(name: str) -> bool:
    """A V4.1 vision tower / aligner / image_* embedding tensor (official name)."""
    return name.startswith(VISION_PREFIXES)
