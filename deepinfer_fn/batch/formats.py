"""Requests in, responses out, both through deepseek-recipe.

`prepare` turns one parsed line (`envelopes.Line`) into an engine `Request`: the recipe converts
the body (``ChatCompletionRequest`` / ``ResponsesRequest`` / ``MessagesRequest``
``.convert``) into a conversation, the model's encoding (`encodings.ChatFormat`) encodes it to
ids, and the recipe's ``InferenceOptions`` give the sampling: temperature (the recipe resolves
it: 1.0 in thinking mode), top_p, seed (none given: a CRC-32 of the custom_id, so reruns
repeat; a 63-bit seed is folded to the engine's 32 bits), max_tokens
(``resolve_max_tokens`` against the engine's context), logprobs / top_logprobs, and the output
constraint: ``json`` -> ``JsonSchema`` (an empty schema string: any JSON value), ``regex`` ->
``Regex``, both free while thinking (``think_first``) in thinking mode; ``tool_call`` /
``tool_call_required`` are not enforced (the tool-call markup is parsed back, not
constrained). The request stops at the model's EOS. The request's model name is accepted as an
alias of the model's own version (the model decides the encoding, not the name).

`ResponseBuilder` turns the generated ids back into a response: a recipe ``StreamProcessor``
(with the format's chunk generator and the conversion's parsing options: reasoning content,
tool calls, stop sequences) fed ``InferenceChunk``s, and the format's response object
accumulating every stream chunk / event. A final EOS is not text: it is counted as one
completion token (``InferenceChunk.text("", 1)``). Logprobs are the engine's (log p under the
model); the engine reports no alternatives, so a top_logprobs list holds the sampled token
only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import zlib

from deepinfer_fn.batch.envelopes import Line

SEED_BITS = 32


@dataclasses.dataclass(frozen=True)
class Format:
    """A request format: the recipe's request and response class names, the id prefix."""

    name: str
    request: str
    response: str
    id_prefix: str


FORMATS = {f.name: f for f in (
    Format("chat", "ChatCompletionRequest", "ChatCompletionResponse", "chatcmpl-"),
    Format("responses", "ResponsesRequest", "ResponsesResponse", "resp_"),
    Format("messages", "MessagesRequest", "MessagesResponse", "msg_"),
)}


class RequestError(Exception):
    """A request that cannot run: status (HTTP-style), kind (error type), message, and the
    recipe's own OpenAI error body when it gave one."""

    def __init__(self, status: int, kind: str, message: str, body: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.body = status, kind, message, body


@dataclasses.dataclass
class Prepared:
    """One request ready for the engine and for its response.

    position: 0-based index in the input; prompt: the encoded ids; request: the engine
    `Request` (request_id = position); converted: the recipe's ConversationRequest; echo /
    namespace_map: the Responses generator's settings (None / {} otherwise); constraint_kind:
    the recipe's output-constraint kind when the engine enforces it, else None."""

    position: int
    line: Line
    model_name: str
    response_id: str
    converted: object
    prompt: list[int]
    request: object
    logprobs: bool
    top_logprobs: int
    stop_sequences: tuple[str, ...]
    constraint_kind: str | None = None
    echo: object = None
    namespace_map: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Converter:
    """The recipe ConversionOptions of a model's chat format; `for_name` accepts a request's
    model name as an alias of the model's own version."""

    options: object
    version: object
    _aliased: dict = dataclasses.field(default_factory=dict)

    def for_name(self, name: str):
        if name not in self._aliased:
            self._aliased[name] = self.options.with_model_alias(name, self.version)
        return self._aliased[name]


def converter(chat, default_thinking: bool = True) -> Converter:
    """The `Converter` of a `ChatFormat` (default_thinking: the thinking mode of requests that
    do not say)."""
    import deepseek_recipe as dr
    options = (dr.ConversionOptions(default_thinking_mode=bool(default_thinking))
               .with_special_tokens(chat.special_tokens))
    return Converter(options, chat.model_version)


def engine_seed(seed, custom_id: str) -> int:
    """The engine's 32-bit seed: the request's seed folded to 32 bits, or a CRC-32 of the
    custom_id when it names none."""
    if seed is None:
        return zlib.crc32(custom_id.encode("utf-8"))
    seed = int(seed)
    return (seed ^ (seed >> SEED_BITS)) & (2**SEED_BITS - 1)


def response_id(fmt: Format, custom_id: str) -> str:
    """A response id derived from the custom_id (stable across reruns)."""
    return fmt.id_prefix + hashlib.sha1(custom_id.encode("utf-8")).hexdigest()[:24]


def constraint_of(output_constraint, thinking: bool):
    """The engine constraint of a recipe OutputConstraint (None: free, or not enforced)."""
    import deepinfer_fn as di
    if output_constraint is None:
        return None
    kind, text = output_constraint.kind, output_constraint.schema
    if kind == "json":
        return di.JsonSchema(json.loads(text) if text else {}, think_first=thinking)
    if kind == "regex":
        return di.Regex(text, think_first=thinking)
    return None


def _error_body(e) -> dict | None:
    try:
        return json.loads(e.body) if getattr(e, "body", None) else None
    except (TypeError, ValueError):
        return None


def _convert(line: Line, model_name: str, conv: Converter):
    """(ConversationRequest, echo, namespace map) of a line's body, or RequestError."""
    import deepseek_recipe as dr
    fmt = FORMATS[line.format]
    body = dict(line.body)
    body["model"] = model_name
    options = conv.for_name(model_name)
    try:
        req = getattr(dr, fmt.request)(body)
        echo = req.echo() if line.format == "responses" else None
        names = req.namespace_tool_map(options) if line.format == "responses" else {}
        return req.convert(options), echo, names
    except dr.ConversionError as e:
        raise RequestError(int(getattr(e, "status_code", 400) or 400), "invalid_request_error",
                           str(e), _error_body(e)) from None
    except (ValueError, TypeError) as e:     # the body does not deserialize
        raise RequestError(400, "invalid_request_error", str(e)) from None


def prepare(line: Line, position: int, model, conv: Converter, context_limit: int,
            default_max_tokens: int | None = None) -> Prepared:
    """The `Prepared` request of one line for `model` (a `BatchModel`); RequestError when
    the recipe rejects it, it holds images, or it does not fit the context."""
    from deepinfer_fn.engine import Request
    name = line.body.get("model")
    name = name if isinstance(name, str) and name else model.name
    converted, echo, names = _convert(line, name, conv)
    conversation = converted.conversation
    if any(m.image_sources for m in conversation.messages):
        raise RequestError(400, "invalid_request_error", "images are not supported: this "
                           "engine runs text-only models")
    try:
        prompt = list(model.chat.encoding.encode(conversation))
    except RuntimeError as e:
        raise RequestError(500, "encoding_error", f"the model's tokenizer cannot encode this "
                           f"conversation: {e}") from None
    io = converted.inference_options
    try:
        max_new = converted.resolve_max_tokens(len(prompt), context_limit)
    except Exception as e:          # ConversionError: prompt + max_tokens over the context
        raise RequestError(int(getattr(e, "status_code", 400) or 400), "invalid_request_error",
                           str(e), _error_body(e)) from None
    if io.max_tokens is None and default_max_tokens is not None:
        max_new = min(max_new, int(default_max_tokens))
    thinking = conversation.thinking_mode
    try:
        constraint = constraint_of(io.output_constraint, thinking)
    except ValueError as e:         # a schema that is not JSON
        raise RequestError(400, "invalid_request_error", f"response format: {e}") from None
    eos = model.tokenizer.eos_id
    request = Request(prompt, max_new_tokens=int(max_new),
                      temperature=float(1.0 if io.temperature is None else io.temperature),
                      top_p=float(1.0 if io.top_p is None else io.top_p),
                      seed=engine_seed(io.seed, line.custom_id),
                      stop_tokens=[eos] if eos is not None else [], request_id=position,
                      constraint=constraint)
    parsing = converted.parsing_options
    return Prepared(position, line, name, response_id(FORMATS[line.format], line.custom_id),
                    converted, prompt, request, bool(io.logprobs), int(io.top_logprobs or 0),
                    tuple(parsing.stop_sequences),
                    io.output_constraint.kind if constraint is not None else None, echo, names)


class ResponseBuilder:
    """The recipe's stream processor and response accumulator of one prepared request.

    push(tokens, logprobs) -> the new stream chunks / events; finished: the processor completed
    (a stop sequence matched, or close ran); close(engine_finish) -> the response body (a
    dict). created: the response's timestamp (None: now); an explicit one also replaces the
    Responses ``created_at`` / ``completed_at`` (reproducible files). record: keep each chunk
    as JSON in `events` (streaming); otherwise chunks are only accumulated. A request with stop
    sequences is fed one id at a time, so the processor stops (and counts) at the id that
    completes the match."""

    def __init__(self, p: Prepared, chat, eos_id: int | None, cached_tokens: int = 0,
                 created: int | None = None, record: bool = True):
        import deepseek_recipe as dr
        self._dr, self._p, self._eos, self._created = dr, p, eos_id, created
        self._record = record
        fmt = FORMATS[p.line.format]
        gen = getattr(dr, fmt.request).chunk_generator(p.converted, p.response_id, p.model_name)
        if p.line.format == "responses":
            if p.namespace_map:
                gen = gen.with_namespace_tool_map(p.namespace_map)
            gen = gen.with_echo(p.echo)
        parsing = p.converted.parsing_options
        parsing.special_tokens = chat.special_tokens
        self._sp = dr.StreamProcessor(gen, parsing, chat.tokenizer)
        self._resp = getattr(dr, fmt.response)(
            p.response_id, p.model_name, int(time.time()) if created is None else int(created),
            len(p.prompt), int(cached_tokens))
        self._sse = getattr(dr, fmt.response).sse_event_name
        self.events: list[tuple[str | None, dict]] = []
        self._eos_seen = False
        self._emit(self._sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
            prompt_tokens=len(p.prompt), prompt_cache_hit_tokens=int(cached_tokens)))))

    @property
    def finished(self) -> bool:
        return self._sp.finished

    def _emit(self, chunks) -> list[tuple[str | None, dict]]:
        out = []
        for c in chunks:
            if self._record:
                out.append((self._sse(c), json.loads(c.to_json())))
            self._resp.accumulate(c)
        self.events.extend(out)
        return out

    def _push_tokens(self, tokens, lps) -> list:
        dr, out = self._dr, []
        if not self._p.stop_sequences:
            return self._emit(self._sp.push(dr.InferenceChunk.tokens(tokens, lps)))
        for i, t in enumerate(tokens):
            if self._sp.finished:
                break
            out += self._emit(self._sp.push(dr.InferenceChunk.tokens(
                [t], None if lps is None else [lps[i]])))
        return out

    def push(self, tokens, logprobs=None) -> list[tuple[str | None, dict]]:
        """Feeds generated ids (and their logprobs, one per id, or None); returns the new
        (SSE event name, chunk / event JSON) pairs (none unless record). Ids after EOS, or
        after the processor finished, are ignored."""
        dr = self._dr
        tokens = [int(t) for t in tokens]
        if logprobs is not None:
            assert len(logprobs) == len(tokens), (len(logprobs), len(tokens))
        if self._eos_seen or self._sp.finished or not tokens:
            return []
        n, eos = len(tokens), False
        if self._eos is not None and self._eos in tokens:
            n, eos = tokens.index(self._eos), True
        out = []
        if n:
            lps = None
            if self._p.logprobs and logprobs is not None:
                top = self._p.top_logprobs
                lps = [(float(lp), [(t, float(lp))] if top > 0 else [])
                       for t, lp in zip(tokens[:n], logprobs[:n])]
            out += self._push_tokens(tokens[:n], lps)
        if eos and not self._sp.finished:
            self._eos_seen = True
            out += self._emit(self._sp.push(dr.InferenceChunk.text("", 1)))
        return out

    def close(self, engine_finish: str) -> dict:
        """Ends the stream (engine finish "length" -> the recipe's Length, else Stop) and
        returns the accumulated response body."""
        dr = self._dr
        if not self._sp.finished:
            reason = (dr.InferenceFinishReason.Length if engine_finish == "length"
                      else dr.InferenceFinishReason.Stop)
            self._emit(self._sp.push(dr.InferenceChunk.finish(reason)))
        self._emit(self._sp.finish())
        body = json.loads(self._resp.to_json())
        if self._created is not None and self._p.line.format == "responses":
            for key in ("created_at", "completed_at"):
                if body.get(key) is not None:
                    body[key] = int(self._created)
        return body
