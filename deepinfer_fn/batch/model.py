"""What a batch runs on: a model bundle (`di.load_model`) with its chat format and, optionally,
a speculative method.

    model = load_batch_model()                         # the embedded default model, float32
    model = load_batch_model("path/to/hf_dir", dtype=jnp.bfloat16, speculative="dspark")
    model = load_batch_model(di.load_model(...))       # a bundle already loaded

The chat format (`encodings.chat_format`) follows the params' ``config.model_type``; the
recipe reads the same ``tokenizer.json`` as the bundle's tokenizer (the checkpoint's own, or
the real V4 vocabulary's for a V4-size model without one).
"""

from __future__ import annotations

import dataclasses
import os

from deepinfer_fn.batch.encodings import ChatFormat, chat_format, family_of
from deepinfer_fn.errors import ArgumentError

SPECULATIVE = (None, "mtp", "dspark")


@dataclasses.dataclass(frozen=True)
class BatchModel:
    """params: `deepinfer_fn.Params`; tokenizer: `text.Tokenizer`; chat: `ChatFormat`;
    speculative / drafter: the Engine's speculative method and DSpark drafter (or None)."""

    params: object
    tokenizer: object
    chat: ChatFormat
    speculative: str | None = None
    drafter: object = None

    @property
    def name(self) -> str:
        """The API model name echoed in responses to requests that name no model."""
        return self.chat.family.model_name


def _tokenizer_json(bundle) -> str:
    """The tokenizer.json file the bundle's tokenizer was loaded from."""
    from deepinfer_fn import text
    if bundle.tokenizer is None:
        raise ArgumentError(f"{bundle!r} has no tokenizer: a batch needs the model's "
                            "tokenizer.json next to its checkpoint")
    if bundle.path is not None:
        path = os.path.join(bundle.path, "tokenizer.json")
        if os.path.isfile(path):
            return path
    default = text.default_tokenizer_path()         # the bundle's V4-vocabulary fallback
    if bundle.tokenizer.vocab_size != text.load_tokenizer().vocab_size:
        raise ArgumentError(f"{bundle!r}: its tokenizer is not the V4 vocabulary and no "
                            "tokenizer.json is next to its checkpoint (Model.path)")
    return str(default)


def load_batch_model(model=None, *, dtype=None, speculative: str | None = None,
                     drafter=None) -> BatchModel:
    """The `BatchModel` of a `di.Model` bundle, or of what `di.load_model` takes (a checkpoint
    directory, a hub id, None for the default model; loaded with `dtype`, default float32).

    speculative: None, "mtp" (the params' MTP block) or "dspark" (drafter: a loaded
    `speculative.DSpark` or a drafter directory; default the bundle's, i.e. the checkpoint's
    ``dspark/``)."""
    import deepinfer_fn as di
    from deepinfer_fn.speculative import DSpark, load_dspark
    if isinstance(model, BatchModel):
        return model
    if speculative not in SPECULATIVE:
        raise ArgumentError(f"load_batch_model: speculative must be one of {SPECULATIVE}, got "
                            f"{speculative!r}")
    if drafter is not None and speculative != "dspark":
        raise ArgumentError("load_batch_model: drafter= is only used with speculative='dspark'")
    own = isinstance(drafter, DSpark)
    if isinstance(model, di.Model):
        bundle = model
        if dtype is not None:
            raise ArgumentError("load_batch_model: dtype= is for loading; this bundle is loaded")
        if speculative == "dspark" and drafter is not None and not own:
            drafter = load_dspark(drafter, bundle.params, bundle.params.dtype)
    else:      # the bundle loads the drafter: a directory given, else the checkpoint's dspark/
        wanted = drafter if drafter is not None and not own else speculative == "dspark"
        bundle = di.load_model(model, dtype=dtype, drafter=wanted)
    if speculative == "dspark" and not isinstance(drafter, DSpark):
        drafter = bundle.drafter
        if drafter is None:
            raise ArgumentError(f"speculative='dspark': {bundle!r} has no DSpark drafter (no "
                                "dspark/ next to its checkpoint); pass drafter=")
    if speculative == "mtp" and "mtp" not in bundle.speculative:
        raise ArgumentError(f"speculative='mtp': {bundle!r} has no MTP block")
    from deepinfer_fn import text
    path = _tokenizer_json(bundle)
    # the tokenizer's own apply_chat follows the same config as the batch's encoding
    tok = bundle.tokenizer.with_chat_encoding(text.chat_encoding_of(bundle.params.config))
    bos, eos = tok.chat_tokens()[:2]
    fmt = chat_format(family_of(bundle.params.config), path, bos, eos)
    return BatchModel(bundle.params, tok, fmt, speculative, drafter)
