"""`Matcher`: one request's constraint state over the model's vocabulary, walked token by token.

    m = Matcher(JsonSchema({...}), tokenizer, vocab_size=cfg.vocab_size)
    packed = m.allowed_mask()      # uint32 [ceil(vocab_size / 32)]: bit t of word t // 32 = token t
    m.consume(token)               # False (and m.error set) if the token was not allowed
    m.rollback(n)                  # undo the last n consumed tokens (rejected speculative drafts)
    m.is_accepting(), m.is_finished(), m.error, m.status()

Token ids, special tokens, vocabulary size:
  * plain tokens are allowed exactly when their bytes extend a string the grammar can still match;
  * special tokens (the tokenizer's added vocabulary: BOS, chat markers, `</think>`, ...) are never
    allowed, except EOS (the tokenizer's `eos_id`), which is allowed exactly when the grammar
    accepts what was generated; once the grammar can extend no further, EOS is the only allowed
    token, and consuming EOS finishes the matcher;
  * the model's `vocab_size` may exceed the tokenizer's (padded embedding rows): the extra ids are
    never allowed.

`think_first=True`: while thinking (before `tokenizer.end_of_thinking_id`) every tokenizer id but
EOS is allowed (the answer must still come); rollback may cross back into the thinking part.

An invalid regex, schema or grammar does not raise: the matcher carries `error` (a one-line
message). A mask never allows a token that `consume` refuses (tests/test_structured_masks.py
checks this by brute force over the vocabulary). When llguidance cannot compute a mask (a parser
or lexer limit, an internal error) the matcher's error is "grammar engine could not compute a
mask: ..." and its mask all-zero, never a permissive one. `fill_masks` computes the masks of many
matchers in one parallel llguidance call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from deepinfer_fn.structured import llg
from deepinfer_fn.structured.llg import short_message
from deepinfer_fn.structured.bitmask import mask_words
from deepinfer_fn.structured.constraints import (Constraint, ConstraintError, JsonSchema,
                                                 grammar_text, json_schema)
from deepinfer_fn.structured.schema import approximate_schema, approximation_name, validation_error
from deepinfer_fn.structured.tokenizers import ll_tokenizer

UNSATISFIABLE = "the constraint allows no token here (unsatisfiable)"
MASK_FAILED = "grammar engine could not compute a mask"


def _compile_error(constraint, message: str) -> str:
    """The error of a constraint llguidance refused; unsupported JSON Schema keywords named."""
    kind = type(constraint).__name__
    if isinstance(constraint, JsonSchema) and message.startswith("Unimplemented keys:"):
        keys = message.split(":", 1)[1].strip()
        return (f"invalid {kind}: unsupported JSON Schema keyword(s) {keys} (JsonSchema(..., "
                f"options={{'lenient': True}}) ignores them while generating and checks the "
                f"output against the full schema)")
    return f"invalid {kind}: {message}"



class Matcher:
    """One request's constraint state over the model's vocabulary (module docstring).

    `vocab_size` is the model's (default: the tokenizer's); it must be >= the tokenizer's.
    `limits`: llguidance parser limits (`llguidance.LLParserLimits` keyword names, e.g.
    `step_max_items`); a mask step that exceeds one ends the request with an error.
    Never raises for a bad constraint: check `error` (a one-line message) instead.
    `approximations` names how a JsonSchema's grammar departs from the schema (empty: exact);
    when it is not empty, `status()` checks a complete output against the original schema.
    """

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int | None = None, *,
                 limits: Mapping | None = None):
        V_tok = int(tokenizer.vocab_size)
        self.vocab_size = V_tok if vocab_size is None else int(vocab_size)
        if self.vocab_size < V_tok:
            raise ValueError(f"model vocab_size {self.vocab_size} is smaller than the tokenizer's "
                             f"{V_tok}: the tokenizer does not belong to this model")
        self.constraint = constraint
        self.eos_id = int(tokenizer.eos_id) if tokenizer.eos_id is not None else None
        self.words = mask_words(self.vocab_size)
        self.think_first = bool(getattr(constraint, "think_first", False))
        self.end_of_thinking_id = tokenizer.end_of_thinking_id
        self.error: str | None = None
        self.approximations: tuple[str, ...] = ()
        self._schema = None           # the original JSON schema (validated when approximated)
        self._answer_ids: list[int] = []   # grammar tokens consumed, EOS excluded
        self._checked: tuple[int, str | None] | None = None  # (len(_answer_ids), mismatch)
        self._thinking = self.think_first
        self._think_tokens = 0      # tokens consumed while thinking, </think> included
        self._answer_tokens = 0     # tokens consumed by the grammar, EOS included
        self._eos_consumed = False
        self._ll = None
        if self.think_first and self.end_of_thinking_id is None:
            self.error = f"think_first: {tokenizer!r} has no {'</think>'!r} token"
            return
        try:
            lt = ll_tokenizer(tokenizer)
            self._lt = lt
            self._ll_words = mask_words(lt.vocab_size)
            self._tok_vocab = lt.vocab_size
            grammar = grammar_text(constraint)
            ll = llg.module()
            self._ll = ll.LLMatcher(lt, grammar, log_level=0,
                                    limits=None if limits is None else ll.LLParserLimits(**limits))
        except ConstraintError as e:
            self.error = str(e)
            return
        self._scratch = np.zeros((self._ll_words,), np.uint32)
        if self._ll.is_error():
            self.error = _compile_error(constraint, short_message(self._ll.get_error()))
        elif isinstance(constraint, JsonSchema):
            self._schema = json_schema(constraint)
            notes = set(approximate_schema(self._schema)[1])
            notes.update(approximation_name(short_message(w))
                         for w in self._ll.get_grammar_warnings())
            self.approximations = tuple(sorted(notes))

    # ---- state ------------------------------------------------------------------------------

    @property
    def thinking(self) -> bool:
        """True while a think_first request is still before its `</think>`."""
        return self._thinking

    def is_accepting(self) -> bool:
        """The answer so far is a complete match (EOS would be allowed now)."""
        if self.error is not None or self._thinking:
            return False
        return self._eos_consumed or self._ll.is_accepting()

    def is_finished(self) -> bool:
        """Nothing more can be generated: EOS consumed, or an error."""
        return self.error is not None or self._eos_consumed

    def is_complete(self) -> bool:
        """The grammar can extend no further (EOS is the only allowed token) or EOS was consumed."""
        if self.error is not None or self._thinking:
            return False
        return self._eos_consumed or self._ll.is_stopped()

    def status(self) -> str:
        """'complete' (a full match), 'incomplete' (the text so far is only a prefix of one),
        or 'error: <message>' -- also for a complete output of an approximated JSON schema
        that the original schema rejects."""
        if self.error is not None:
            return f"error: {self.error}"
        if not self.is_accepting():
            return "incomplete"
        mismatch = self.schema_mismatch()
        if mismatch is not None:
            return (f"error: the output does not satisfy the schema (generated under the "
                    f"approximation {', '.join(self.approximations)}): {mismatch}")
        return "complete"

    def answer_text(self) -> str:
        """The constrained text consumed so far (after `</think>`, EOS excluded)."""
        return self._lt.decode_bytes(self._answer_ids).decode("utf-8", errors="replace")

    def schema_mismatch(self) -> str | None:
        """For an approximated JSON schema: why the text so far fails the original schema
        (None: it passes, or nothing to check). Checked once per text length."""
        if not self.approximations or self._schema is None:
            return None
        n = len(self._answer_ids)
        if self._checked is None or self._checked[0] != n:
            self._checked = (n, validation_error(self._schema, self.answer_text()))
        return self._checked[1]

    # ---- masks ------------------------------------------------------------------------------

    def _think_mask(self, out: np.ndarray):
        out[:] = 0
        full, rest = divmod(self._tok_vocab, 32)
        out[:full] = 0xFFFFFFFF
        if rest:
            out[full] = (1 << rest) - 1
        if self.eos_id is not None:
            out[self.eos_id // 32] &= ~np.uint32(1 << (self.eos_id % 32))

    def fill_mask(self, out: np.ndarray, ll_mask: np.ndarray | None = None, *,
                  empty_is_error: bool = True):
        """Writes the packed allowed-token mask (uint32 [words]) into `out`. `ll_mask` is the
        llguidance mask when already computed (batched by ConstrainedBatch). An error or an
        empty mask sets `error`, and the mask is all-zero. `empty_is_error=False` (a state
        reached by a speculative draft, which may still be rejected) leaves an empty mask
        all-zero without setting `error`: the caller decides once the draft is committed."""
        if self.error is not None or self._eos_consumed:
            out[:] = 0
            return
        if self._thinking:
            self._think_mask(out)
            return
        if ll_mask is None:
            ll_mask = self._scratch
            self._ll.unsafe_compute_mask_ptr(ll_mask.ctypes.data, ll_mask.nbytes)
        if self._ll.is_error():  # never a permissive mask: llguidance writes EOS-only ones
            self.mask_failed()
            out[:] = 0
            return
        n = self._ll_words
        out[:n] = ll_mask
        out[n:] = 0
        rest = self._tok_vocab % 32
        if rest:
            out[n - 1] &= np.uint32((1 << rest) - 1)
        if empty_is_error and not out.any():
            self.error = UNSATISFIABLE

    def mask_failed(self):
        """Records llguidance's failure to compute the next mask (a limit, an internal error)."""
        if self.error is None:
            self.error = f"{MASK_FAILED}: {short_message(self._ll.get_error())}"

    def allowed_mask(self) -> np.ndarray:
        """Packed mask of the tokens allowed next: uint32 [ceil(vocab_size / 32)]."""
        out = np.zeros((self.words,), np.uint32)
        self.fill_mask(out)
        return out

    # ---- tokens -----------------------------------------------------------------------------

    def consume(self, token: int) -> bool:
        """Advances by one sampled token; False (and `error` set) if it was not allowed."""
        if self.error is not None:
            return False
        token = int(token)
        if self._thinking:
            if token == self.eos_id or not 0 <= token < self._tok_vocab:
                self.error = f"token {token} is not allowed while thinking"
                return False
            self._think_tokens += 1
            if token == self.end_of_thinking_id:
                self._thinking = False
            return True
        if self._eos_consumed:
            self.error = f"token {token} after EOS"
            return False
        if token == self.eos_id:  # kept out of llguidance (whose history may skip it)
            if not self._ll.is_accepting():
                self.error = f"EOS (token {token}) before the constraint is complete"
                return False
            self._answer_tokens += 1
            self._eos_consumed = True
            return True
        if not 0 <= token < self._tok_vocab or not self._ll.consume_token(token):
            self.error = (f"token {token} does not satisfy the constraint"
                          + (f": {short_message(self._ll.get_error())}"
                             if self._ll.is_error() else ""))
            return False
        self._answer_tokens += 1
        self._answer_ids.append(token)
        return True

    def copy(self) -> "Matcher":
        """A fresh matcher of the same compiled constraint (llguidance deep copy, state
        included)."""
        new = object.__new__(Matcher)
        new.__dict__.update(self.__dict__)
        if self._ll is not None:
            new._ll = self._ll.deep_copy()
            new._scratch = np.zeros_like(self._scratch)
        new._answer_ids = list(self._answer_ids)
        return new

    def consume_many(self, tokens: Sequence[int]) -> int:
        """Consumes tokens until one is rejected; returns how many were consumed."""
        for n, t in enumerate(tokens):
            if not self.consume(t):
                return n
        return len(tokens)

    def rollback(self, n: int) -> bool:
        """Undoes the last `n` consumed tokens (e.g. rejected speculative drafts). False if n
        exceeds what was consumed; an error state is never rolled back."""
        n = int(n)
        if self.error is not None or n < 0 or n > self._think_tokens + self._answer_tokens:
            return False
        k = min(n, self._answer_tokens)
        if k:
            ll_k = k - int(self._eos_consumed)
            if ll_k and not self._ll.rollback(ll_k):
                self.error = f"rollback failed: {short_message(self._ll.get_error())}"
                return False
            if ll_k:
                del self._answer_ids[-ll_k:]
            self._answer_tokens -= k
            self._eos_consumed = False
        if n > k:  # back into the thinking part: </think> itself is undone
            self._think_tokens -= n - k
            self._thinking = True
        return True


def fill_masks(matchers: Sequence[Matcher], out: np.ndarray, rows: Sequence[int], *,
               empty_is_error: bool = True) -> None:
    """Writes each matcher's packed mask into its row of `out` (uint32 [N, words]): matchers[k]
    -> out[rows[k]], as `Matcher.fill_mask` (same errors). The llguidance masks of two or more
    grammar rows (not thinking, no error, one tokenizer) are computed in one parallel call."""
    if len(matchers) != len(rows):
        raise ValueError(f"fill_masks: {len(matchers)} matchers for {len(rows)} rows")
    ll = [k for k, m in enumerate(matchers)
          if m.error is None and m._ll is not None and not m.thinking]
    computed: dict[int, np.ndarray] = {}
    if len(ll) > 1 and len({matchers[k]._ll_words for k in ll}) == 1:
        scratch = np.zeros((len(ll), matchers[ll[0]]._ll_words), np.uint32)
        llg.executor().unsafe_compute_mask_ptr(
            [(matchers[k]._ll, i) for i, k in enumerate(ll)], scratch.ctypes.data,
            scratch.shape[1] * 4, scratch.shape[0])
        computed = {k: scratch[i] for i, k in enumerate(ll)}
    for k, (m, row) in enumerate(zip(matchers, rows)):
        m.fill_mask(out[row], computed.get(k), empty_is_error=empty_is_error)
