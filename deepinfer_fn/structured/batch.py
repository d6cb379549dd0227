"""`ConstrainedBatch`: the host side of constrained generation, one `Matcher` (or None = free
row) per batch row.

Plain decoding: `initial()` gives the first step's packed masks, `step(tokens, active)` consumes
each row's sampled token and packs the next masks. Free and finished rows get all-ones masks (the
sampler's output is unchanged). A token outside the mask it was sampled under (a sampler fault)
ends the row with "error: token t was sampled outside the mask it was sampled under".

Speculative decoding (docs/MODEL.md §D2.2, §2.5): a verify step carries m_0, the packed mask
after the committed tokens. The drafter draws draft j+1 from its logits masked by m_j (so q, the
distribution actually sampled from, is masked and a forbidden draft is never proposed), and
`draft_step` consumes each slot's draft tentatively and returns m_{j+1}. The target logits at
verified position j are masked by m_j, verification is the usual lossless one, and `commit`
rolls each row's matcher back to its accepted drafts (`Matcher.rollback`) and consumes the
correction/bonus token. Slots after a drafted EOS (or a draft after which nothing is allowed)
are not admitted -- dropping slot j+1 because of x_j keeps the law, dropping x_j itself because
of its value would not; an accepted EOS draft ends the row and the bonus token after it is
dropped (`n_keep`). A drafter that drafts without masks (all k at once) calls `draft_tokens`: a
forbidden draft is then verified and rejected by the masked target.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from deepinfer_fn.structured.bitmask import mask_words
from deepinfer_fn.structured.constraints import Grammar, JsonSchema, Regex
from deepinfer_fn.structured.matcher import UNSATISFIABLE, Matcher, fill_masks


class ConstrainedBatch:
    """Host side of constrained generate(): one Matcher (or None = free row) per batch row.

    `initial()` gives the first step's packed masks and the rows already finished (those whose
    constraint failed to compile); `step(tokens, active)` consumes each active row's sampled token
    and returns the next packed masks and the rows the constraint finished (EOS consumed, error).
    Free and finished rows get all-ones masks (no restriction: the sampler output is unchanged).
    """

    def __init__(self, matchers: Sequence[Matcher | None], vocab_size: int):
        self.matchers = list(matchers)
        self.vocab_size = int(vocab_size)
        self.words = mask_words(vocab_size)
        B = len(self.matchers)
        self._masks = np.full((B, self.words), 0xFFFFFFFF, np.uint32)
        self.step_seconds: list[float] = []
        self._reset_drafts(B)
        self.draft_seconds: list[float] = []    # speculative: per draft_step call
        self.commit_seconds: list[float] = []   # speculative: per commit call

    def _reset_drafts(self, rows: int):
        """Per-row speculative bookkeeping of the current verify step."""
        self._drafted = np.zeros((rows,), np.int64)   # drafts consumed (tentatively)
        self._halted = np.zeros((rows,), bool)        # no further draft is consumed this step
        self._dead_end = np.zeros((rows,), np.int64)  # slot whose state allows nothing (0: none)

    @classmethod
    def build(cls, constraint, batch: int, tokenizer, vocab_size: int) -> "ConstrainedBatch":
        """One constraint for all rows, or a sequence of length `batch` (None = free row)."""
        if constraint is None:
            raise ValueError("no constraint")
        if isinstance(constraint, (Regex, JsonSchema, Grammar)):
            specs = [constraint] * batch
        elif isinstance(constraint, Sequence) and not isinstance(constraint, (str, bytes)):
            specs = list(constraint)
            if len(specs) != batch:
                raise ValueError(f"constraint: expected one constraint or a list of {batch} "
                                 f"(None for a free row), got a list of {len(specs)}")
        else:
            raise TypeError(f"constraint must be deepinfer_fn.Regex, JsonSchema, Grammar or a list "
                            f"of them (None for free rows), got {type(constraint).__name__}")
        for s in specs:
            if s is not None and not isinstance(s, (Regex, JsonSchema, Grammar)):
                raise TypeError(f"constraint list entries must be Regex, JsonSchema, Grammar or "
                                f"None, got {type(s).__name__}")
        cache: dict[int, Matcher] = {}
        matchers = []
        for s in specs:
            if s is None:
                matchers.append(None)
            else:  # the same spec object in several rows compiles once, then is copied
                if id(s) not in cache:
                    cache[id(s)] = Matcher(s, tokenizer, vocab_size)
                    matchers.append(cache[id(s)])
                else:
                    matchers.append(cache[id(s)].copy())
        return cls(matchers, vocab_size)

    def pad_rows(self, rows: int):
        """Extends the batch with free rows up to `rows` (mesh padding)."""
        extra = rows - len(self.matchers)
        if extra > 0:
            self.matchers += [None] * extra
            self._masks = np.concatenate(
                [self._masks, np.full((extra, self.words), 0xFFFFFFFF, np.uint32)])
            self._reset_drafts(rows)

    def _fill(self, rows, empty_is_error: bool = True):
        """Next masks of `rows` into self._masks; llguidance rows in one parallel call."""
        fill_masks([self.matchers[b] for b in rows], self._masks, rows,
                   empty_is_error=empty_is_error)

    def initial(self) -> tuple[np.ndarray, np.ndarray]:
        rows = [b for b, m in enumerate(self.matchers) if m is not None]
        self._fill(rows)
        finished = np.array([m is not None and m.is_finished() for m in self.matchers])
        self._masks[finished] = 0xFFFFFFFF
        return self._masks.copy(), finished

    def step(self, tokens, active) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)
        active = np.asarray(active, bool)
        finished = np.zeros((len(self.matchers),), bool)
        live = []
        for b, m in enumerate(self.matchers):
            if m is None or not active[b]:
                continue
            self._consume_sampled(m, b, int(tokens[b]))
            if m.is_finished():
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
            else:
                live.append(b)
        self._fill(live)
        for b in live:
            if self.matchers[b].is_finished():  # the mask step found an error
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
        self.step_seconds.append(time.perf_counter() - t0)
        return self._masks.copy(), finished

    def _consume_sampled(self, m: Matcher, b: int, t: int):
        """Row b consumes the token sampled under its last mask; a token outside that mask (a
        sampler fault: the mask is exact) ends the row with an error saying so."""
        if not m.is_finished() and not (
                0 <= t < self.vocab_size and (int(self._masks[b, t >> 5]) >> (t & 31)) & 1):
            m.error = f"token {t} was sampled outside the mask it was sampled under"
            return
        m.consume(t)

    def statuses(self) -> tuple[str | None, ...]:
        return tuple(None if m is None else m.status() for m in self.matchers)

    def fail(self, message: str, *, halt: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Ends every live constrained row with error `message` (a host failure); returns
        (all-ones packed masks uint32 [B, W], finished bool [B]: the rows it ended). The draft
        bookkeeping is reset; `halt` (inside a verify step) drafts no further this step."""
        B = len(self.matchers)
        masks = np.full((B, self.words), 0xFFFFFFFF, np.uint32)
        finished = np.zeros((B,), bool)
        for b, m in enumerate(self.matchers):
            if m is not None and not m.is_finished():
                m.error = message
                finished[b] = True
        self._reset_drafts(B)
        if halt:
            self._halted[:] = True
        return masks, finished

    # ---- speculative decoding: masks at draft positions, rollback of rejected drafts ----------
    #
    # One verify step of a row whose committed tokens the matcher has consumed (its mask m_0 =
    # the last mask returned): `draft_step` is called once per draft slot j = 1..k with the
    # drafts x_j; it consumes x_j tentatively and returns m_j, the mask after x_1..x_j, which
    # both masks the drafter's q for x_{j+1} and, with m_0..m_{j-1}, the target distributions
    # p~_j of the verification (docs/MODEL.md §D2.2). `commit` then rolls every row back to its
    # accepted drafts and consumes the correction/bonus token. A drafter that proposes all k
    # drafts at once (no per-slot mask for q) uses `draft_tokens` instead of k draft_steps.
    #
    # Lossless rules (§2.5): a draft is never dropped because of its own value. A draft the
    # grammar forbids (possible only with an unmasked q) is not consumed and the row drafts
    # no further this step (`halted`): it is verified like any other and rejected, since the
    # masked p~ gives it probability 0; the later slots' masks are all-ones and unused. A
    # draft after which the constraint is finished (EOS) or allows nothing (a dead end) sets
    # `stop`: the *later* slots are not admitted (ell <= j, decided from x_j, which is
    # allowed); the draft itself is verified, and if it is accepted the row ends there.

    def draft_step(self, tokens, active) -> tuple[np.ndarray, np.ndarray]:
        """Consumes each active row's next draft token (int [B]) tentatively; returns
        (packed masks uint32 [B, W] after it, stop bool [B]: slots after this one must not be
        admitted). Free, finished and halted rows get all-ones masks."""
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)
        active = np.asarray(active, bool)
        stop = np.zeros((len(self.matchers),), bool)
        live = []
        for b, m in enumerate(self.matchers):
            if m is None or not active[b] or m.is_finished() or self._halted[b]:
                if m is not None and active[b] and not m.is_finished():
                    self._masks[b] = 0xFFFFFFFF
                continue
            t = int(tokens[b])
            if not (0 <= t < self.vocab_size
                    and (int(self._masks[b, t >> 5]) >> (t & 31)) & 1):
                self._halted[b] = True          # forbidden draft: verified, rejected
                self._masks[b] = 0xFFFFFFFF
                continue
            if not m.consume(t):  # pragma: no cover - the mask said it was allowed
                self._halted[b] = True           # the row's error is reported at commit
                self._masks[b] = 0xFFFFFFFF
                continue
            self._drafted[b] += 1
            if m.is_finished():                  # EOS drafted: admit nothing after it
                stop[b] = self._halted[b] = True
                self._masks[b] = 0xFFFFFFFF
            else:
                live.append(b)
        self._fill(live, empty_is_error=False)
        for b in live:
            m = self.matchers[b]
            if m.error is not None:              # an llguidance failure: reported at commit
                stop[b] = self._halted[b] = True
                self._masks[b] = 0xFFFFFFFF
            elif not self._masks[b].any():       # dead end after this draft
                self._dead_end[b] = self._drafted[b]
                stop[b] = self._halted[b] = True
                self._masks[b] = 0xFFFFFFFF
        self.draft_seconds.append(time.perf_counter() - t0)
        return self._masks.copy(), stop

    def draft_tokens(self, drafts, active) -> tuple[np.ndarray, np.ndarray]:
        """All k drafts at once (int [B, k]): `draft_step` per slot. Returns (packed masks
        uint32 [B, k+1, W]: m_0 (the current masks) .. m_k, admit int32 [B]: the largest
        verify length allowed by the drafts, k unless a draft finished the constraint)."""
        drafts = np.asarray(drafts)
        B, k = drafts.shape
        masks = [self._masks.copy()]
        admit = np.full((B,), k, np.int32)
        for j in range(k):
            m, stop = self.draft_step(drafts[:, j], active)
            masks.append(m)
            admit = np.where(stop & (admit == k), j + 1, admit).astype(np.int32)
        return np.stack(masks, axis=1), admit

    def commit(self, tokens, accepted, n_emit, active) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
        """End of a verify step. tokens int [B, k+1]: the emitted tokens (accepted drafts, then
        the correction/bonus token); accepted int [B]: g, how many drafts were accepted;
        n_emit int [B]: how many of `tokens` the row commits (g + 1, or fewer when a stop token
        or the budget cut it). Each active constrained row is rolled back to its first
        min(g, n_emit) drafts, then consumes the rest of its committed tokens until the
        constraint finishes. Returns (next packed masks uint32 [B, W], finished bool [B]: rows
        the constraint ended (EOS consumed, error), n_keep int32 [B]: committed tokens that
        stay in the output (fewer than n_emit only after an accepted EOS draft); free and
        inactive rows keep n_emit)."""
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)
        accepted = np.asarray(accepted).astype(np.int64)
        n_emit = np.asarray(n_emit).astype(np.int64)
        active = np.asarray(active, bool)
        B = len(self.matchers)
        finished = np.zeros((B,), bool)
        n_keep = np.where(active, n_emit, 0).astype(np.int32)
        live = []
        for b, m in enumerate(self.matchers):
            if m is None or not active[b]:
                continue
            drafted, dead_end = int(self._drafted[b]), int(self._dead_end[b])
            keep = min(int(accepted[b]), int(n_emit[b]), drafted)
            if m.error is None and drafted > keep and not m.rollback(drafted - keep):
                pass  # rollback failed: m.error is set, the row ends below
            kept = keep
            if m.error is None and dead_end and keep >= dead_end:
                m.error = UNSATISFIABLE
            for t in tokens[b, keep:int(n_emit[b])]:
                if m.is_finished():
                    break
                m.consume(int(t))
                kept += 1
            n_keep[b] = kept
            if m.is_finished():
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
            else:
                live.append(b)
        self._reset_drafts(B)
        self._fill(live)
        for b in live:
            if self.matchers[b].is_finished():  # the mask step found an error
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
        self.commit_seconds.append(time.perf_counter() - t0)
        return self._masks.copy(), finished, n_keep

