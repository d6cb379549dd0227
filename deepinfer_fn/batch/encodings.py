"""The recipe's prompt encoding for a model: which one (from its config) and set up how.

A model's family decides the chat format: a DeepSeek-V4 config (``model_type`` ``deepseek_v4``)
renders with ``deepseek_recipe.DeepseekV4Encoding`` and converts requests as
``ModelVersion.DeepseekV4Pro``; a V4.1 config (``model_type`` ``deepseek_v41`` /
``deepseek_v41_text``, or a ``DeepseekV41*`` architecture) with ``DeepseekV41Encoding`` /
``ModelVersion.DeepseekV41Flash``. ``FAMILIES`` is that table; a family whose encoding the
installed recipe lacks fails with a message naming it.

The encoding gets the model's own ``tokenizer.json`` (``deepseek_recipe.Tokenizer``) and the
BOS / EOS spellings of its ``text.Tokenizer`` (``tokenizer_config.json`` may rename them), as
``deepinfer_fn.text`` does for ``apply_chat``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from deepinfer_fn.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the dispatch table: the recipe class names of a model family."""

    name: str
    encoding: str            # deepseek_recipe class, e.g. "DeepseekV4Encoding"
    model_version: str       # deepseek_recipe.ModelVersion member
    model_name: str          # the recipe's API model name, echoed when a request names none
    model_types: tuple[str, ...]
    architecture_prefix: str


FAMILIES = (
    Family("v4.1", "DeepseekV41Encoding", "DeepseekV41Flash", "DeepSeek-V4.1-Flash",
           ("deepseek_v41", "deepseek_v41_text"), "DeepseekV41"),
    Family("v4", "DeepseekV4Encoding", "DeepseekV4Pro", "DeepSeek-V4-Pro",
           ("deepseek_v4",), "DeepseekV4"),
)


def family_of(config) -> Family:
    """The family of a `ModelConfig` (its ``model_type``) or a raw config.json dict (its
    ``text_config`` too, for V4.1's wrapper).

    ``model_type`` decides; without one, the first ``architectures`` entry; a config with
    neither is V4."""
    if not isinstance(config, Mapping):
        if not hasattr(config, "model_type") and not hasattr(config, "vocab_size"):
            raise ArgumentError(f"family_of: config must be a ModelConfig or a config.json "
                                f"dict, got {type(config).__name__}")
        config = {"model_type": getattr(config, "model_type", None)}
    types = [config.get("model_type")]
    if isinstance(config.get("text_config"), Mapping):
        types.append(config["text_config"].get("model_type"))
    for t in types:
        for fam in FAMILIES:
            if t in fam.model_types:
                return fam
    archs = config.get("architectures") or []
    for fam in FAMILIES:             # V4.1 first: "DeepseekV41..." also starts with "DeepseekV4"
        if archs and isinstance(archs[0], str) and archs[0].startswith(fam.architecture_prefix):
            return fam
    if types[0] is None and not archs:
        return FAMILIES[-1]
    raise ArgumentError(f"no DeepSeek chat format for model_type={types[0]!r}, architectures="
                        f"{archs!r}: expected one of "
                        f"{[t for f in FAMILIES for t in f.model_types]}")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A family's encoding with the model's tokenizer attached.

    encoding: the recipe encoding (``encode(conversation) -> ids``); tokenizer: the recipe's
    ``Tokenizer`` over the same tokenizer.json (the stream processors decode with it);
    special_tokens: the recipe ``SpecialTokens`` (BOS / EOS as the model spells them)."""

    family: Family
    encoding: object
    model_version: object
    tokenizer: object
    special_tokens: object


def chat_format(family: Family, tokenizer_json: str | os.PathLike, bos: str, eos: str) -> ChatFormat:
    """The recipe encoding of `family` over the tokenizer.json at `tokenizer_json`."""
    import deepseek_recipe as dr
    cls = getattr(dr, family.encoding, None)
    version = getattr(dr.ModelVersion, family.model_version, None)
    if cls is None or version is None:
        raise ArgumentError(f"the installed deepseek-recipe {getattr(dr, '__version__', '?')} has "
                            f"no {family.encoding} / ModelVersion.{family.model_version} for a "
                            f"{family.name} model; upgrade deepseek-recipe")
    tok = dr.Tokenizer.from_file(os.fspath(tokenizer_json))
    special = dr.SpecialTokens(bos=bos, eos=eos)
    encoding = cls().with_tokenizer(tok).with_special_tokens(special)
    return ChatFormat(family, encoding, version, tok, special)
