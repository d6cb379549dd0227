"""Batch lines: what a request line holds and how its result line is wrapped.

Request lines (one JSON object each):

* OpenAI Batch API: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/responses" | "/v1/messages", "body": {...}}``; the url names the format.
* Anthropic Message Batches: ``{"custom_id", "params": {...}}`` (a Messages request).
* A bare request body (chat completions, Responses or Messages); its id is ``line-<n>`` (n: the
  1-based position in the input) and its format is `detect_format`'s unless one is given.

Result lines, one per request line, carry the ``custom_id``:

* OpenAI envelope (Batch API and bare chat / Responses lines): ``{"id", "custom_id",
  "response": {"status_code", "request_id", "body"}, "error"}``; a request the recipe rejects
  gets status 400 and the recipe's error body, an engine failure status 500, a line that is not
  a request object ``response: null`` and ``error: {"code", "message"}``.
* Anthropic envelope (Message Batches and bare Messages lines): ``{"custom_id", "result":
  {"type": "succeeded", "message"}}`` or ``{"type": "errored", "error": {"type": "error",
  "error": {"type", "message"}}}``.

Both add ``"deepinfer": {...}`` when there is something engine-side to say (finish reason of
the engine, constraint status, speculative acceptance).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

FORMAT_NAMES = ("chat", "responses", "messages")
URLS = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}
OPENAI, ANTHROPIC = "openai", "anthropic"

# Keys or shapes only an Anthropic Messages body uses (the rest of it looks like chat).
_ANTHROPIC_KEYS = ("system", "stop_sequences", "anthropic_version", "top_k", "output_config",
                   "anthropic_beta", "container", "mcp_servers")
_ANTHROPIC_BLOCKS = ("tool_use", "tool_result", "thinking", "redacted_thinking", "document")


class LineError(ValueError):
    """A line that is not a request of a known shape (code: a short machine-readable name;
    custom_id: the line's own id when it has a valid one, else None)."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code, self.custom_id = code, custom_id


@dataclasses.dataclass(frozen=True)
class Line:
    """One parsed request line: custom_id, format (FORMAT_NAMES), envelope (OPENAI or
    ANTHROPIC) and the request body (a dict)."""

    custom_id: str
    format: str
    envelope: str
    body: dict


def default_id(position: int) -> str:
    """The id of a line that names none (position: 0-based index in the input)."""
    return f"line-{position + 1}"


def _is_anthropic(body: Mapping) -> bool:
    if any(k in body for k in _ANTHROPIC_KEYS):
        return True
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and "budget_tokens" in thinking:
        return True
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, Mapping) and "input_schema" in t for t in tools):
        return True
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, Mapping) and (block.get("type") in _ANTHROPIC_BLOCKS or (
                    block.get("type") == "image" and "source" in block)):
                return True
    return False


def detect_format(body: Mapping) -> str:
    """The format of a bare body: ``input`` / ``instructions`` -> responses; ``messages`` ->
    messages when Anthropic-only keys or blocks appear (`_is_anthropic`), else chat."""
    if "input" in body or "instructions" in body:
        return "responses"
    if "messages" in body:
        return "messages" if _is_anthropic(body) else "chat"
    raise LineError("unknown_format", "cannot tell the request format: expected a chat "
                    "completions or Messages body (`messages`), a Responses body (`input`), or a "
                    "batch line (`custom_id` with `body` or `params`)")


def _format_of_url(url) -> str:
    if not isinstance(url, str):
        raise LineError("invalid_url", f"url must be a string, got {type(url).__name__}")
    path = url.split("?", 1)[0].rstrip("/")
    for known, fmt in URLS.items():
        if path == known or path == known[len("/v1"):]:
            return fmt
    raise LineError("invalid_url", f"url {url!r} is not one of {sorted(URLS)}")


def parse_line(item, position: int, default_format: str = "auto") -> Line:
    """The `Line` of one input item: a dict, or JSON text (str / bytes) of one.

    Raises LineError (invalid JSON, not an object, an unknown url or format, a custom_id that
    is not a string). default_format: "auto" (`detect_format`) or a FORMAT_NAMES entry, for
    bare bodies."""
    if isinstance(item, (bytes, bytearray)):
        item = item.decode("utf-8", errors="replace")
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as e:
            raise LineError("invalid_json", f"not valid JSON: {e}") from None
    if not isinstance(item, Mapping):
        raise LineError("invalid_request", f"a request line must be a JSON object, got "
                        f"{type(item).__name__}")
    cid = item.get("custom_id", default_id(position))
    if not isinstance(cid, str) or not cid:
        raise LineError("invalid_custom_id", f"custom_id must be a non-empty string, got {cid!r}")
    try:
        return _line(item, cid, default_format)
    except LineError as e:
        raise LineError(e.code, str(e), cid) from None


def _line(item: Mapping, cid: str, default_format: str) -> Line:
    if isinstance(item.get("body"), Mapping) and ("custom_id" in item or "url" in item):
        method = item.get("method", "POST")
        if method != "POST":
            raise LineError("invalid_method", f"method must be POST, got {method!r}")
        url = item.get("url")
        fmt = _format_of_url(url) if url is not None else detect_format(item["body"])
        return Line(cid, fmt, OPENAI, dict(item["body"]))
    if isinstance(item.get("params"), Mapping) and "custom_id" in item:
        return Line(cid, "messages", ANTHROPIC, dict(item["params"]))
    if default_format not in ("auto",) + FORMAT_NAMES:
        raise ValueError(f"default_format must be 'auto' or one of {FORMAT_NAMES}, got "
                         f"{default_format!r}")
    fmt = detect_format(item) if default_format == "auto" else default_format
    body = {k: v for k, v in item.items() if k != "custom_id"}
    return Line(cid, fmt, ANTHROPIC if fmt == "messages" else OPENAI, body)


def _extra(line: dict, extra: Mapping | None) -> dict:
    if extra:
        line["deepinfer"] = dict(extra)
    return line


def success_line(envelope: str, custom_id: str, body: dict, extra: Mapping | None = None) -> dict:
    """The result line of a request that ran."""
    if envelope == ANTHROPIC:
        return _extra({"custom_id": custom_id,
                       "result": {"type": "succeeded", "message": body}}, extra)
    return _extra({"id": f"batch_req_{custom_id}", "custom_id": custom_id,
                   "response": {"status_code": 200, "request_id": body.get("id"), "body": body},
                   "error": None}, extra)


def error_line(envelope: str, custom_id: str, status: int, kind: str, message: str,
               body: Mapping | None = None, extra: Mapping | None = None) -> dict:
    """The result line of a request that did not run or failed (status: HTTP-style code;
    kind: the error type, e.g. "invalid_request_error"; body: an OpenAI error body to use
    as is, such as a recipe ConversionError's)."""
    if envelope == ANTHROPIC:
        return _extra({"custom_id": custom_id, "result": {"type": "errored", "error": {
            "type": "error", "error": {"type": kind, "message": message}}}}, extra)
    body = dict(body) if body is not None else {
        "error": {"message": message, "type": kind, "param": None, "code": kind}}
    return _extra({"id": f"batch_req_{custom_id}", "custom_id": custom_id,
                   "response": {"status_code": status, "request_id": None, "body": body},
                   "error": None}, extra)


def invalid_line(custom_id: str, code: str, message: str) -> dict:
    """The result line of a line that is not a request (no envelope known): OpenAI's shape
    for a request the batch could not process."""
    return {"id": f"batch_req_{custom_id}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
