"""The batch loop: request lines in, result lines out, through one `Engine`.

    for r in run_batch(lines, model=None):        # the embedded default model
        print(r.custom_id, r.line)                # as each request finishes
    for ev in stream_batch(lines):                # + the recipe's stream chunks / events
        ev.event, ev.sse_event, ev.result

Each item of `requests` (a dict, or JSON text of one) is parsed (`envelopes.parse_line`),
converted and encoded (`formats.prepare`); a line that fails there gets its error line at once
and never reaches the engine. The rest run through `engine.stream` in windows of `window`
requests, each with its own sampling, constraint and token budget; a request whose stop
sequence the recipe matched is cancelled in the engine (its response ends at the match).
Result lines come as requests finish (`BatchResult.position` is the input index). Usage is
exact: prompt = the encoded ids, completion = the ids the response covers (a final EOS
included), cached = the engine's prefix-cache hits for the request.

Streaming (`stream_batch`): chunks / events are produced as the engine reports tokens; the
engine reports a request's prefix-cache hits and logprobs only when it finishes, so streamed
usage counts no cached tokens, and a request asking for logprobs streams all its events when it
finishes. The final `result` line is the same as `run_batch`'s either way.

Resume: `done` maps custom_id -> how many result lines for it already exist; the first that
many occurrences of the id are skipped (a `BatchResult` with skipped=True, no line), as are
blank items (None or whitespace: blank lines of a file).
A custom_id seen again in the input (beyond what `done` covers) is an error line.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping

from deepinfer_fn.batch import envelopes
from deepinfer_fn.batch.formats import RequestError, ResponseBuilder, converter, prepare
from deepinfer_fn.batch.model import BatchModel, load_batch_model
from deepinfer_fn.errors import ArgumentError


@dataclasses.dataclass
class BatchResult:
    """The result of one input item: position (0-based input index), custom_id, line (the
    result line dict; None when skipped), output (the engine's RequestOutput; None when the
    request never reached the engine), prompt (the encoded ids, when converted)."""

    position: int
    custom_id: str
    line: dict | None
    output: object = None
    prompt: list[int] | None = None
    skipped: bool = False


@dataclasses.dataclass
class BatchEvent:
    """One step of `stream_batch`: a recipe stream chunk / event of a request (event: its
    JSON, sse_event: its SSE event name or None), or the request's final `result`."""

    position: int
    custom_id: str
    event: dict | None = None
    sse_event: str | None = None
    result: BatchResult | None = None


def make_engine(model: BatchModel, **engine_options):
    """An `Engine` over the model (its tokenizer for constraints, its speculative drafter;
    no engine progress bar unless asked)."""
    from deepinfer_fn.engine import Engine
    options = dict(progress=False, tokenizer=model.tokenizer)
    if model.speculative is not None:
        options.update(speculative=model.speculative, drafter=model.drafter)
    options.update(engine_options)
    return Engine(model.params, **options)


def _model(model) -> BatchModel:
    if isinstance(model, BatchModel):
        return model
    if model is None or isinstance(model, (str, os.PathLike)):
        return load_batch_model(model)
    raise ArgumentError(f"model must be a checkpoint directory, a BatchModel or None (the "
                        f"embedded default model), got {type(model).__name__}")


def _extra(p, out, speculative: bool) -> dict:
    extra = {}
    if out.finish_reason not in ("stop", "length"):
        extra["engine_finish_reason"] = out.finish_reason
    if p.constraint_kind is not None:
        extra["constraint"] = {"kind": p.constraint_kind, "status": out.constraint_status}
    if speculative and out.metrics.verified:
        ver, acc = sum(out.metrics.verified), sum(out.metrics.accepted)
        extra["speculative"] = {"verify_steps": len(out.metrics.verified),
                                "drafts_verified": ver, "drafts_accepted": acc,
                                "acceptance_rate": acc / ver if ver else None}
    return extra


class _Run:
    """One batch over one engine: the state shared by its windows."""

    def __init__(self, model: BatchModel, engine, default_format: str, default_thinking: bool,
                 default_max_tokens: int | None, created: int | None, done: Mapping | None,
                 events: bool):
        self.model, self.engine, self.events = model, engine, events
        self.default_format, self.default_max_tokens = default_format, default_max_tokens
        self.created = created
        self.conv = converter(model.chat, default_thinking)
        self.seen: collections.Counter = collections.Counter()
        self.done = dict(done or {})
        self.eos = model.tokenizer.eos_id
        self.speculative = getattr(engine, "speculative", None) is not None

    # ---- before the engine
    def admit(self, position: int, item):
        """A Prepared request, or a finished BatchResult (skipped, or an error line). A blank
        item (None or whitespace) is skipped without a result line."""
        if item is None or (isinstance(item, (str, bytes)) and not item.strip()):
            return BatchResult(position, "", None, skipped=True)
        try:
            line = envelopes.parse_line(item, position, self.default_format)
        except envelopes.LineError as e:
            cid = e.custom_id or envelopes.default_id(position)
            if self._skip(cid):
                return BatchResult(position, cid, None, skipped=True)
            return BatchResult(position, cid, envelopes.invalid_line(cid, e.code, str(e)))
        cid = line.custom_id
        if self._skip(cid):
            return BatchResult(position, cid, None, skipped=True)
        if self.seen[cid] > 1:
            return BatchResult(position, cid, envelopes.error_line(
                line.envelope, cid, 400, "invalid_request_error",
                f"duplicate custom_id {cid!r}: an earlier line has it"))
        try:
            return prepare(line, position, self.model, self.conv, self.engine.max_len,
                           self.default_max_tokens)
        except RequestError as e:
            return BatchResult(position, cid, envelopes.error_line(
                line.envelope, cid, e.status, e.kind, e.message, e.body))
        except Exception as e:      # anything else the recipe raises: this line fails alone
            return BatchResult(position, cid, envelopes.error_line(
                line.envelope, cid, 500, "internal_error", f"{type(e).__name__}: {e}"))

    def _skip(self, cid: str) -> bool:
        k = self.seen[cid]
        self.seen[cid] += 1
        return k < self.done.get(cid, 0)

    # ---- after the engine
    def result(self, p, out) -> tuple[BatchResult, ResponseBuilder | None]:
        """The result line of a finished engine request, and the builder that made it."""
        line = p.line
        if out.finish_reason == "error":
            status = 400 if (out.error or "").startswith("constraint:") else 500
            return BatchResult(p.position, line.custom_id, envelopes.error_line(
                line.envelope, line.custom_id, status,
                "invalid_request_error" if status == 400 else "engine_error",
                out.error or "the engine failed this request", extra=_extra(p, out, False)),
                out, p.prompt), None
        try:
            b = ResponseBuilder(p, self.model.chat, self.eos, out.metrics.cached_tokens,
                                self.created, record=self.events)
            b.push(out.tokens, out.logprobs if p.logprobs else None)
            body = b.close(out.finish_reason)
        except RuntimeError as e:           # the recipe's stream processor failed
            return BatchResult(p.position, line.custom_id, envelopes.error_line(
                line.envelope, line.custom_id, 500, "response_error", str(e)),
                out, p.prompt), None
        return BatchResult(p.position, line.custom_id, envelopes.success_line(
            line.envelope, line.custom_id, body, _extra(p, out, self.speculative)),
            out, p.prompt), b

    def run(self, prepared: list) -> Iterator[BatchEvent]:
        """Runs one window's prepared requests; BatchEvents as the engine reports tokens."""
        by_pos = {p.position: p for p in prepared}
        live: dict[int, ResponseBuilder] = {}
        stopped: set[int] = set()       # cancelled in the engine: a stop sequence matched
        failed: set[int] = set()        # the live stream processor failed
        for ev in self.engine.stream([p.request for p in prepared]):
            p = by_pos[ev.request_id]
            streams = self.events and not p.logprobs
            if ev.tokens and (streams or p.stop_sequences) and p.position not in failed:
                try:
                    b = live.get(p.position)
                    if b is None:
                        b = live[p.position] = ResponseBuilder(p, self.model.chat, self.eos, 0,
                                                               self.created, record=streams)
                        if streams:
                            yield from self._events(p, b.events)
                    chunks = b.push(ev.tokens)
                except RuntimeError:    # the final builder reports it as this request's error
                    failed.add(p.position)
                    live.pop(p.position, None)
                    chunks = []
                if streams:
                    yield from self._events(p, chunks)
                b = live.get(p.position)
                if b is not None and b.finished and ev.output is None and p.position not in stopped:
                    stopped.add(p.position)
                    self.engine.cancel(ev.request_id)
            if ev.output is None:
                continue
            result, final = self.result(p, ev.output)
            b = live.pop(p.position, None)
            if self.events and final is not None:
                if streams and b is not None:       # the rest of what was streamed
                    yield from self._events(p, self._close(b, ev.output.finish_reason))
                else:                               # nothing streamed yet: all of it now
                    yield from self._events(p, final.events)
            yield BatchEvent(p.position, p.line.custom_id, result=result)

    @staticmethod
    def _close(b: ResponseBuilder, finish: str):
        n = len(b.events)
        try:
            b.close(finish)
        except RuntimeError:
            return []
        return b.events[n:]

    @staticmethod
    def _events(p, chunks) -> Iterator[BatchEvent]:
        for name, data in chunks:
            yield BatchEvent(p.position, p.line.custom_id, event=data, sse_event=name)


def stream_batch(requests: Iterable, model=None, *, engine=None, engine_options=None,
                 default_format: str = "auto", default_thinking: bool = True,
                 default_max_tokens: int | None = None, created: int | None = None,
                 window: int = 1024, done: Mapping | None = None) -> Iterator[BatchEvent]:
    """Runs request lines through the engine, yielding each request's recipe stream chunks /
    events as its tokens become known and a final `BatchEvent(result=...)` per item.

    model: a checkpoint directory, a `BatchModel` (`load_batch_model`) or None (the embedded
    default model). engine: an `Engine` over model.params built with tokenizer=model.tokenizer
    (default: `make_engine(model, **engine_options)`). default_format: "auto", "chat",
    "responses" or "messages", for bare bodies (`envelopes.detect_format`). default_thinking:
    the thinking mode of requests that do not choose. default_max_tokens: caps the token budget
    of requests that set none (the recipe's default is up to the context limit). created: one
    timestamp for every response (reproducible output). window: requests per engine call.
    done: custom_id -> result lines already written (resume; see the module docstring)."""
    return _stream(requests, model, engine, engine_options, default_format, default_thinking,
                   default_max_tokens, created, window, done, events=True)


def run_batch(requests: Iterable, model=None, *, engine=None, engine_options=None,
              default_format: str = "auto", default_thinking: bool = True,
              default_max_tokens: int | None = None, created: int | None = None,
              window: int = 1024, done: Mapping | None = None) -> Iterator[BatchResult]:
    """`stream_batch` without the stream chunks (same arguments): one `BatchResult` per item,
    as each request finishes (per window, the items that failed before the engine first)."""
    for ev in _stream(requests, model, engine, engine_options, default_format, default_thinking,
                      default_max_tokens, created, window, done, events=False):
        yield ev.result


def _stream(requests, model, engine, engine_options, default_format, default_thinking,
            default_max_tokens, created, window, done, events) -> Iterator[BatchEvent]:
    if isinstance(requests, (str, bytes, Mapping)):
        raise ArgumentError("requests must be an iterable of request lines (dicts or JSON "
                            "strings), not a single " + type(requests).__name__)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ArgumentError(f"window must be a positive int, got {window!r}")
    if default_max_tokens is not None and (isinstance(default_max_tokens, bool) or not
                                           isinstance(default_max_tokens, int)
                                           or default_max_tokens < 1):
        raise ArgumentError(f"default_max_tokens must be a positive int or None, got "
                            f"{default_max_tokens!r}")
    if default_format not in ("auto",) + envelopes.FORMAT_NAMES:
        raise ArgumentError(f"default_format must be 'auto' or one of {envelopes.FORMAT_NAMES},"
                            f" got {default_format!r}")
    model = _model(model)
    if engine is None:
        engine = make_engine(model, **(engine_options or {}))
    elif engine_options:
        raise ArgumentError("engine_options are for the engine run_batch builds; got engine= too")
    run = _Run(model, engine, default_format, default_thinking, default_max_tokens, created,
               done, events)
    items = enumerate(requests)
    while chunk := list(itertools.islice(items, window)):
        prepared = []
        for position, item in chunk:
            got = run.admit(position, item)
            if isinstance(got, BatchResult):
                yield BatchEvent(position, got.custom_id, result=got)
            else:
                prepared.append(got)
        if prepared:
            yield from run.run(prepared)
