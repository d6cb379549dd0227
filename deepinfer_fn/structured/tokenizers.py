"""Tokenizers for structured output: the default DeepSeek-V4 vocabulary and the llguidance
tokenizer of a `deepinfer_fn.text.Tokenizer` (built once per tokenizer object)."""

from __future__ import annotations

import threading
import weakref

from deepinfer_fn.structured import llg
from deepinfer_fn.structured.constraints import ConstraintError

_DEFAULT_TOKENIZER = None


def default_tokenizer():
    """The DeepSeek-V4 vocabulary (`text.load_tokenizer()`), loaded once."""
    global _DEFAULT_TOKENIZER
    if _DEFAULT_TOKENIZER is None:
        from deepinfer_fn import text
        _DEFAULT_TOKENIZER = text.load_tokenizer()
    return _DEFAULT_TOKENIZER


_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of a `deepinfer_fn.text.Tokenizer` (built once per tokenizer
    object). EOS = the tokenizer's eos_id;
    the added vocabulary is special (never matched by grammar text)."""
    with _LL_LOCK:
        lt = _LL_TOKENIZERS.get(tokenizer)
        if lt is None:
            if tokenizer.eos_id is None:
                raise ConstraintError(f"{tokenizer!r} has no EOS token: a constrained request "
                                      f"could never end")
            ll = llg.module()
            lt = ll.LLTokenizer(tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size,
                                eos_token=int(tokenizer.eos_id))
            _LL_TOKENIZERS[tokenizer] = lt
        return lt

