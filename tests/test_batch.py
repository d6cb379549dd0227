"""Offline batches through deepseek-recipe (`deepinfer_fn.batch`, `python -m deepinfer_fn batch`).

Oracles: the engine's own RequestOutput tokens decoded by the model's HF tokenizer (not the
recipe's decoder): reasoning / content must equal that text up to the recipe's documented
normalisation (leading newlines of each part dropped); prompt ids against
`text.Tokenizer.apply_chat` (the recipe's Conversation built directly, not through request
conversion); the recipe's own request types parse each response back (its assistant turn as the
history of a follow-up request); jsonschema for JSON-schema outputs; streamed deltas add up to
the final response; a plain engine for the speculative one (greedy: lossless). Every engine run
in this file shares one engine (SHAPES), so the compiled sub-steps are shared; the CLI
subprocess passes the same shapes (persistent-cache hits). Heavy: the constrained (JSON-schema)
run, which compiles the masked forward and sampler, the MTP engine, and the subprocess.
"""

import functools
import json
import os
import subprocess
import sys

import pytest

jsonschema = pytest.importorskip("jsonschema")
dr = pytest.importorskip("deepseek_recipe")

import deepinfer_fn as di  # noqa: E402
from deepinfer_fn import batch  # noqa: E402
from deepinfer_fn.batch import envelopes, formats  # noqa: E402
from deepinfer_fn.batch.encodings import chat_format, family_of  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = dict(max_batch=4, page_size=16, max_len=512, num_pages=96,
              prefill_shapes=((1, 128),), decode_buckets=(4,))
CREATED = 1_700_000_000
MODEL = "DeepSeek-V4-Pro"
TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                          "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "tag"], "additionalProperties": False}
OFF = {"type": "disabled"}


@functools.cache
def model():
    return batch.load_batch_model()


@functools.cache
def engine():
    return batch.make_engine(model(), **SHAPES)


def chat_line(cid, messages, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": messages, **body}}


SYSTEM_USER = [{"role": "system", "content": "You write Python."},
               {"role": "user", "content": "import os"}]
ROUND_TRIP = [
    chat_line("chat-plain", SYSTEM_USER, thinking=OFF, temperature=0, max_tokens=8,
              logprobs=True, top_logprobs=2),
    chat_line("chat-think", [{"role": "user", "content": "def main():"}],
              reasoning_effort="high", seed=5, max_tokens=8),
    chat_line("chat-tools", [{"role": "user", "content": "Show me setup.py"}], tools=[TOOL],
              thinking=OFF, temperature=0, max_tokens=8),
    {"custom_id": "resp-plain", "method": "POST", "url": "/v1/responses",
     "body": {"model": "gpt-4o", "instructions": "Answer with code.", "input": "import json",
              "reasoning": {"effort": "none"}, "temperature": 0, "max_output_tokens": 8,
              "top_logprobs": 1, "include": ["message.output_text.logprobs"]}},
    {"custom_id": "msg-plain", "params": {
        "model": MODEL, "max_tokens": 8, "system": "You write Python.", "thinking": OFF,
        "temperature": 0, "messages": [{"role": "user", "content": "import os"}]}},
    {"custom_id": "msg-think-tools", "params": {
        "model": MODEL, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"effort": "low"},
        "tools": [{"name": "read_file", "input_schema": TOOL["function"]["parameters"]}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "class A:"}]}]}},
    {"model": MODEL, "messages": [{"role": "user", "content": "import sys"}], "thinking": OFF,
     "temperature": 0, "max_tokens": 6},                       # a bare body: id line-7
    chat_line("chat-stop", [{"role": "user", "content": "def f(x):"}], thinking=OFF,
              temperature=0, max_tokens=24, stop=["string"]),
    chat_line("chat-again", [{"role": "user", "content": "Show me setup.py"}], tools=[TOOL],
              thinking=OFF, temperature=0, max_tokens=8),   # chat-tools' prompt: cache hits
]
JSON_LINES = [
    chat_line("chat-json", [{"role": "user", "content": "A tag as JSON"}], thinking=OFF,
              temperature=0, max_tokens=32, response_format={
                  "type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}),
    {"custom_id": "resp-json", "method": "POST", "url": "/v1/responses",
     "body": {"model": MODEL, "input": "A tag as JSON", "reasoning": {"effort": "none"},
              "temperature": 0, "max_output_tokens": 32,
              "text": {"format": {"type": "json_schema", "name": "t", "schema": SCHEMA}}}},
]
BY_ID = {envelopes.parse_line(x, i).custom_id: x for lines in (ROUND_TRIP, JSON_LINES)
         for i, x in enumerate(lines)}


@functools.cache
def round_trip(json_lines=False):
    """One stream_batch run over ROUND_TRIP (or JSON_LINES): ({custom_id: BatchResult},
    {custom_id: events})."""
    results, events = {}, {}
    lines = JSON_LINES if json_lines else ROUND_TRIP
    for ev in batch.stream_batch(lines, model(), engine=engine(), created=CREATED):
        if ev.result is not None:
            results[ev.custom_id] = ev.result
        else:
            events.setdefault(ev.custom_id, []).append(ev.event)
    return results, events


def body_of(line):
    return line["result"]["message"] if "result" in line else line["response"]["body"]


def fmt_of(cid):
    return {"chat": "chat", "resp": "responses", "msg": "messages", "line": "chat"}[
        cid.split("-")[0]]


def parts(fmt, body):
    """(reasoning, content, tool call names) of a response body."""
    if fmt == "chat":
        msg = body["choices"][0]["message"]
        return (msg.get("reasoning_content") or "", msg.get("content") or "",
                [c["function"]["name"] for c in msg.get("tool_calls") or []])
    if fmt == "responses":
        items = body["output"]
        return ("".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"]),
                "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"]),
                [i["name"] for i in items if i["type"] == "function_call"])
    blocks = body["content"]
    return ("".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "".join(b["text"] for b in blocks if b["type"] == "text"),
            [b["name"] for b in blocks if b["type"] == "tool_use"])


def expected_parts(tokens, thinking):
    """(reasoning, content) the engine's tokens spell, by the HF tokenizer: EOS dropped, the
    text split at the first </think> in thinking mode, leading newlines of each part dropped."""
    tok = model().tokenizer
    text = tok.decode([t for t in tokens if t != tok.eos_id])
    if thinking:
        reasoning, _, content = text.partition("</think>")
        return reasoning.lstrip("\n"), content.lstrip("\n")
    assert "</think>" not in text, text
    return "", text.lstrip("\n")


def usage_of(fmt, body):
    """(prompt, completion, cached) tokens of a response's usage."""
    u = body["usage"]
    if fmt == "chat":
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        return u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    if fmt == "responses":
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
        return u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"]
    return (u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"],
            u["cache_read_input_tokens"])


def finish_of(fmt, body):
    if fmt == "chat":
        return body["choices"][0]["finish_reason"]
    if fmt == "responses":
        return body["status"]
    return body["stop_reason"]


FINISH = {"chat": {"length": "length", "stop": "stop"},
          "responses": {"length": "incomplete", "stop": "completed"},
          "messages": {"length": "max_tokens", "stop": "end_turn"}}
THINKING = {"chat-think", "msg-think-tools"}


# ------------------------------------------------------------------ round trips
def check_results(lines, results):
    """Each result: the content the engine's tokens spell, exact usage, the mapped finish."""
    assert set(results) == {envelopes.parse_line(x, i).custom_id for i, x in enumerate(lines)}
    for cid, r in results.items():
        fmt = fmt_of(cid)
        assert r.line["custom_id"] == cid and not batch.batchfile.is_error(r.line), r.line
        body, out = body_of(r.line), r.output
        reasoning, content, calls = parts(fmt, body)
        assert not calls, (cid, calls)          # the tiny model writes no tool-call markup
        if cid == "chat-stop":
            continue
        assert out.finish_reason in ("stop", "length")
        assert (reasoning, content) == expected_parts(out.tokens, cid in THINKING), cid
        assert usage_of(fmt, body) == (len(r.prompt), len(out.tokens), out.metrics.cached_tokens)
        assert finish_of(fmt, body) == FINISH[fmt][out.finish_reason], (cid, body)
        requested = {"chat-json": 32, "resp-json": 32, "line-7": 6}.get(cid, 8)
        assert len(out.tokens) <= requested
        assert (len(out.tokens) == requested) == (out.finish_reason == "length")


def test_round_trip_content_usage_and_finish_match_the_engine():
    results, _ = round_trip()
    check_results(ROUND_TRIP, results)
    assert "line-7" in results
    assert body_of(results["resp-plain"].line)["model"] == "gpt-4o"     # echoed, not checked
    hit = results["chat-again"].output.metrics.cached_tokens
    assert hit > 0 and hit % SHAPES["page_size"] == 0                  # reported as usage above
    assert body_of(results["line-7"].line)["created"] == CREATED


def test_stop_sequence_ends_the_response_and_the_engine_request():
    """The response ends before the first "string" of the engine's text; the engine request
    was cancelled there (fewer than max_tokens tokens) and usage counts the tokens up to the
    one that completes the match."""
    results, _ = round_trip()
    r = results["chat-stop"]
    body = body_of(r.line)
    _, text = expected_parts(r.output.tokens, False)
    assert text.index("string") > 10, text      # greedy: the continuation has one, late
    _, content, _ = parts("chat", body)
    assert content == text[:text.index("string")]
    assert body["choices"][0]["finish_reason"] == "stop"
    tok = model().tokenizer
    upto = next(k for k in range(1, len(r.output.tokens) + 1)
                if "string" in tok.decode(r.output.tokens[:k]))
    assert usage_of("chat", body) == (len(r.prompt), upto, r.output.metrics.cached_tokens)
    assert r.output.finish_reason == "cancelled" and len(r.output.tokens) < 24


@pytest.mark.heavy
def test_prompts_are_the_chat_format_of_the_messages():
    """Request conversion + V4 encoding == apply_chat on the same messages (thinking, effort)."""
    results, _ = round_trip()
    tok = model().tokenizer
    assert results["chat-plain"].prompt == tok.apply_chat(SYSTEM_USER, thinking=False)
    assert results["msg-plain"].prompt == tok.apply_chat(SYSTEM_USER, thinking=False)
    assert results["chat-think"].prompt == tok.apply_chat(
        [{"role": "user", "content": "def main():"}], thinking=True, reasoning_effort="high")
    tools_prompt = tok.decode(results["chat-tools"].prompt)
    assert "read_file" in tools_prompt and '"path"' in tools_prompt     # tool schema rendered
    assert "read_file" in tok.decode(results["msg-think-tools"].prompt)


def _follow_up(cid, request, body):
    """The recipe's conversion of a follow-up request whose history holds the response."""
    fmt = fmt_of(cid)
    req = dict(envelopes.parse_line(request, 0).body)
    nxt = {"role": "user", "content": "more"}
    if fmt == "chat":
        msg = {k: v for k, v in body["choices"][0]["message"].items() if v is not None}
        req["messages"] = req["messages"] + [msg, nxt]
        return dr.ChatCompletionRequest(req).convert(dr.ConversionOptions().with_model_alias(
            req["model"], dr.ModelVersion.DeepseekV4Pro))
    if fmt == "responses":
        req["input"] = [{"role": "user", "content": req["input"]}] + body["output"] + [nxt]
        req["model"] = MODEL
        return dr.ResponsesRequest(req).convert(dr.ConversionOptions())
    req["messages"] = req["messages"] + [{"role": "assistant", "content": body["content"]}, nxt]
    return dr.MessagesRequest(req).convert(dr.ConversionOptions())


def check_parse_back(results):
    for cid, r in results.items():
        request, body = BY_ID[cid], body_of(r.line)
        reasoning, content, _ = parts(fmt_of(cid), body)
        conv = _follow_up(cid, request, body).conversation
        assistant = [m for m in conv.messages if m.role == "assistant"]
        assert len(assistant) == 1, (cid, [m.role for m in conv.messages])
        assert assistant[0].content == content, cid


def test_responses_parse_back_with_the_recipes_request_types():
    check_parse_back(round_trip()[0])


@pytest.mark.heavy
def test_json_schema_round_trip_validates():
    """JSON-schema response formats (chat and Responses): the engine enforces the schema, the
    response's content is the engine's text, valid under the schema, and parses back."""
    results, events = round_trip(json_lines=True)
    check_results(JSON_LINES, results)
    check_parse_back(results)
    assert set(events) == set(results)
    for cid in ("chat-json", "resp-json"):
        r = results[cid]
        _, content, _ = parts(fmt_of(cid), body_of(r.line))
        jsonschema.validate(json.loads(content), SCHEMA)
        assert r.output.finish_reason == "stop" and r.output.tokens[-1] == model().tokenizer.eos_id
        assert r.line["deepinfer"]["constraint"] == {"kind": "json", "status": "complete"}


def test_logprobs_are_the_engines():
    results, _ = round_trip()
    tok = model().tokenizer
    r = results["chat-plain"]
    lps = body_of(r.line)["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in lps] == pytest.approx(r.output.logprobs, abs=1e-6)
    assert "".join(e["token"] for e in lps) == tok.decode(r.output.tokens)
    assert all([t["token"] for t in e["top_logprobs"]] == [e["token"]] for e in lps)
    r = results["resp-plain"]
    msg = [i for i in body_of(r.line)["output"] if i["type"] == "message"]
    lps = [e for i in msg for c in i["content"] for e in c["logprobs"]]
    assert [e["logprob"] for e in lps] == pytest.approx(r.output.logprobs, abs=1e-6)
    assert body_of(results["chat-think"].line)["choices"][0]["logprobs"] is None


def test_streamed_deltas_add_up_to_the_response():
    results, events = round_trip()
    for cid, evs in events.items():
        fmt = fmt_of(cid)
        if fmt == "chat":
            deltas = [c["delta"] for e in evs for c in e["choices"]]
            got = ("".join(d.get("reasoning_content") or "" for d in deltas),
                   "".join(d.get("content") or "" for d in deltas))
        elif fmt == "responses":
            got = ("".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta"),
                   "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta"))
        else:
            ds = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
            got = ("".join(d.get("thinking", "") for d in ds),
                   "".join(d.get("text", "") for d in ds))
        assert got == parts(fmt, body_of(results[cid].line))[:2], cid
    assert set(events) == set(results)


# ------------------------------------------------------------------ no engine
DSML = ('Let me look.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read_file">\n'
        '<｜DSML｜parameter name="path" string="true">setup.py</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


@pytest.mark.parametrize("request_line", [BY_ID["chat-tools"], BY_ID["msg-think-tools"], {
    "custom_id": "rt", "url": "/v1/responses", "body": {
        "model": MODEL, "input": "Show me setup.py", "reasoning": {"effort": "none"},
        "tools": [{"type": "function", **TOOL["function"]}]}}], ids=["chat", "messages", "responses"])
def test_tool_calls_are_parsed_back(request_line):
    """Generated tool-call markup (special DSML tokens, as the model emits them) + EOS become
    the format's tool call, with the arguments as JSON and one completion token per id."""
    m = model()
    line = envelopes.parse_line(request_line, 0)
    p = formats.prepare(line, 0, m, formats.converter(m.chat), 4096)
    tok = m.tokenizer
    thinking = p.converted.conversation.thinking_mode
    ids = tok.encode(("hmm</think>" if thinking else "") + DSML, allow_special=True)
    assert tok.token_to_id("｜DSML｜") in ids
    b = formats.ResponseBuilder(p, m.chat, tok.eos_id, cached_tokens=3, created=CREATED)
    b.push(ids + [tok.eos_id])
    body = b.close("stop")
    reasoning, content, calls = parts(line.format, body)
    assert calls == ["read_file"] and content.strip() == "Let me look."
    assert usage_of(line.format, body) == (len(p.prompt), len(ids) + 1, 3)
    if line.format == "chat":
        call = body["choices"][0]["message"]["tool_calls"][0]["function"]
        assert json.loads(call["arguments"]) == {"path": "setup.py"}
        assert body["choices"][0]["finish_reason"] == "tool_calls"
    elif line.format == "messages":
        assert [b["input"] for b in body["content"] if b["type"] == "tool_use"] == [
            {"path": "setup.py"}]
        assert body["stop_reason"] == "tool_use" and reasoning == "hmm"
    else:
        call = [i for i in body["output"] if i["type"] == "function_call"][0]
        assert json.loads(call["arguments"]) == {"path": "setup.py"}



def test_prepare_maps_sampling_constraint_and_budget():
    m, conv = model(), formats.converter(model().chat)

    def prep(body, cid="x", default_max_tokens=None, limit=512):
        return formats.prepare(envelopes.Line(cid, "chat", "openai", body), 0, m, conv, limit,
                               default_max_tokens)

    msgs = [{"role": "user", "content": "hi"}]
    p = prep({"model": "gpt-4o", "messages": msgs, "thinking": OFF, "temperature": 0.25,
              "top_p": 0.5, "seed": 2**40 + 5, "max_tokens": 7, "stop": ["zz"],
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": SCHEMA}}})
    r = p.request
    assert (r.max_new_tokens, r.stop_tokens) == (7, [m.tokenizer.eos_id])
    assert r.temperature == pytest.approx(0.25) and r.top_p == pytest.approx(0.5)
    assert r.seed == ((2**40 + 5) ^ (2**40 >> 32)) % 2**32 == 5 + 2**8      # folded to 32 bits
    assert r.constraint == di.JsonSchema(SCHEMA, think_first=False)
    assert p.stop_sequences == ("zz",) and p.model_name == "gpt-4o"
    p = prep({"model": MODEL, "messages": msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}, cid="y")
    assert p.request.constraint == di.JsonSchema(SCHEMA, think_first=True)   # thinking mode
    assert p.request.temperature == 1.0                     # the recipe's thinking temperature
    assert p.request.seed == formats.engine_seed(None, "y") != formats.engine_seed(None, "x")
    assert p.request.max_new_tokens == 512 - len(p.prompt)  # up to the context by default
    assert prep({"model": MODEL, "messages": msgs}, default_max_tokens=5).request.max_new_tokens == 5
    p = prep({"model": MODEL, "messages": msgs, "tools": [TOOL], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}, limit=1024)
    assert p.request.constraint is None                     # tool_call: parsed, not enforced
    for body, status in [({"model": MODEL, "messages": msgs, "max_tokens": 600}, 400),
                         ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
                         ({"model": MODEL, "messages": msgs, "n": 2}, 400)]:
        with pytest.raises(formats.RequestError) as e:
            prep(body)
        assert e.value.status == status, body
    image = [{"role": "user", "content": [{"type": "text", "text": "x"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    p = prep({"model": MODEL, "messages": image})       # V4 renders a placeholder text
    assert "[Unsupported Image]" in m.tokenizer.decode(p.prompt)


def test_encoding_follows_the_config():
    v4, v41 = family_of({"model_type": "deepseek_v4"}), family_of({"model_type": "deepseek_v41"})
    assert (v4.encoding, v41.encoding) == ("DeepseekV4Encoding", "DeepseekV41Encoding")
    assert family_of({"architectures": ["DeepseekV41ForCausalLM"]}) is v41
    assert family_of({"text_config": {"model_type": "deepseek_v41_text"}}) is v41
    assert family_of({}) is v4 and family_of(model().params.config) is v4
    assert family_of(di.ModelConfig.preset("v4.1-tiny")) is v41
    with pytest.raises(ValueError, match="llama"):
        family_of({"model_type": "llama"})
    path = os.path.join(di.default_model_path(), "tokenizer.json")
    fmt = chat_format(v41, path, *model().tokenizer.chat_tokens()[:2])
    assert isinstance(fmt.encoding, dr.DeepseekV41Encoding)
    assert fmt.model_version == dr.ModelVersion.DeepseekV41Flash
    # the default model's tokenizer lacks V4.1's <｜System｜>: that request fails alone
    m41 = batch.BatchModel(model().params, model().tokenizer, fmt)
    with pytest.raises(formats.RequestError, match="System"):
        formats.prepare(envelopes.Line("a", "chat", "openai", {"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]}), 0, m41, formats.converter(fmt), 512)
    image = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
    with pytest.raises(formats.RequestError, match="images are not supported"):
        formats.prepare(envelopes.Line("a", "chat", "openai", image), 0, m41,
                        formats.converter(fmt), 512)


def test_line_shapes():
    L = envelopes.parse_line
    assert L({"custom_id": "a", "url": "/v1/responses", "body": {"input": "x"}}, 0).format == "responses"
    assert L({"custom_id": "a", "url": "/chat/completions", "body": {"messages": []}}, 0).format == "chat"
    line = L({"custom_id": "b", "params": {"messages": []}}, 0)
    assert (line.format, line.envelope) == ("messages", "anthropic")
    assert L('{"messages": [], "system": "s"}', 4) == envelopes.Line("line-5", "messages",
                                                                     "anthropic", {"messages": [], "system": "s"})
    assert L({"messages": [], "max_tokens": 3}, 0).format == "chat"
    assert L({"messages": []}, 0, default_format="messages").format == "messages"
    for bad, code in [("{", "invalid_json"), ("[1]", "invalid_request"), ({"x": 1}, "unknown_format"),
                      ({"custom_id": 3, "body": {}}, "invalid_custom_id"),
                      ({"custom_id": "a", "url": "/v1/embeddings", "body": {}}, "invalid_url"),
                      ({"custom_id": "a", "method": "GET", "url": "/v1/responses", "body": {}},
                       "invalid_method")]:
        with pytest.raises(envelopes.LineError) as e:
            L(bad, 0)
        assert e.value.code == code, bad


# ------------------------------------------------------------------ files
def _write(path, items):
    with open(path, "w") as f:
        for x in items:
            f.write((x if isinstance(x, str) else json.dumps(x)) + "\n")


def _read(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def good(cid, content, n=6, **body):
    return chat_line(cid, [{"role": "user", "content": content}], thinking=OFF, temperature=0,
                     max_tokens=n, **body)


def test_mixed_file_bad_lines_fail_alone(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    items = [good("ok-1", "import os"), "not json", "[1, 2]", "",
             {"custom_id": 5, "body": {"messages": msgs}},
             {"custom_id": "url", "url": "/v1/embeddings", "body": {"input": "x"}},
             chat_line("role", [{"role": "wizard", "content": "x"}]),
             chat_line("too-long", msgs, max_tokens=10_000),
             good("ok-1", "again"),                                          # duplicate id
             {"custom_id": "msg-bad", "params": {"model": MODEL, "messages": "nope"}},
             good("ok-2", "def f(x):"), "   "]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, items)
    summary = batch.run_batch_file(src, dst, model(), engine=engine(), progress=False,
                                   created=CREATED)
    lines = _read(dst)
    assert summary["requests"] == summary["written"] == len(lines) == 10
    ids = [x["custom_id"] for x in lines]
    assert ids == ["ok-1", "line-2", "line-3", "line-5", "url", "role", "too-long", "ok-1",
                   "msg-bad", "ok-2"]                                  # input order
    by = dict(zip(range(len(lines)), lines))
    assert [batch.batchfile.is_error(x) for x in lines] == [False] + [True] * 8 + [False]
    assert summary["errors"] == 8
    assert by[1]["error"]["code"] == "invalid_json" and by[2]["error"]["code"] == "invalid_request"
    assert by[3]["error"]["code"] == "invalid_custom_id" and by[4]["error"]["code"] == "invalid_url"
    assert by[5]["response"]["status_code"] == 400 and by[6]["response"]["status_code"] == 400
    assert "context length" in by[6]["response"]["body"]["error"]["message"]
    assert "duplicate" in by[7]["response"]["body"]["error"]["message"]
    assert by[8]["result"]["type"] == "errored"
    assert by[9]["response"]["body"]["usage"]["completion_tokens"] == 6


def test_resume_after_an_interrupted_run_gives_the_same_file(tmp_path):
    items = [good(f"r{i}", p, n=4 + i) for i, p in enumerate(
        ["import os", "def f():", "class A:", "for i in", "x = ["])]
    src, full, part = tmp_path / "in.jsonl", tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    _write(src, items)
    run = functools.partial(batch.run_batch_file, model=model(), engine=engine(),
                            progress=False, created=CREATED)
    run(src, full)
    data = full.read_bytes()
    cut = data.index(b"\n", data.index(b"\n") + 1) + 1        # two whole lines ...
    part.write_bytes(data[:cut + 40])                         # ... and a torn third
    with pytest.raises(ValueError, match="resume"):
        run(src, part)
    summary = run(src, part, resume=True)
    assert (summary["resumed"], summary["written"]) == (2, 3)
    assert part.read_bytes() == data
    assert run(src, part, resume=True)["written"] == 0         # nothing left to do
    assert part.read_bytes() == data


@pytest.mark.heavy
def test_cli_batch_command(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, [good("c1", "import os"), "oops"])
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_DEBUG"}
    env.update({"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
                "JAX_COMPILATION_CACHE_DIR": os.path.join(ROOT, ".jax_cache"),
                "XLA_FLAGS": "--xla_backend_optimization_level=0"})
    shapes = {k: v for k, v in SHAPES.items() if k not in ("max_batch", "max_len")}
    argv = [sys.executable, "-m", "deepinfer_fn", "batch", str(src), "--output", str(dst),
            "--quiet", "--created", str(CREATED), "--max-batch", "4", "--max-len", "512",
            "--engine-options", json.dumps(shapes)]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["written"], summary["errors"]) == (2, 1) and r.stderr == ""
    expected = sorted(batch.run_batch([good("c1", "import os"), "oops"], model(),
                                      engine=engine(), created=CREATED), key=lambda x: x.position)
    assert _read(dst) == [x.line for x in expected]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--resume" in r.stderr and r.stdout == ""


@pytest.mark.heavy
def test_speculative_acceptance_is_reported():
    """An MTP engine: the same greedy tokens as the plain engine (lossless), and each result
    line reports the verify steps and drafts its engine metrics counted."""
    spec_model = batch.load_batch_model(di.Model(model().params, model().tokenizer,
                                                 path=di.default_model_path()),
                                        speculative="mtp")
    spec_engine = batch.make_engine(spec_model, num_draft_tokens=2, **SHAPES)
    lines = [good("s1", "import os", n=12), good("s2", "class A:", n=12)]
    plain = {r.custom_id: r for r in batch.run_batch(lines, model(), engine=engine(),
                                                     created=CREATED)}
    for r in batch.run_batch(lines, spec_model, engine=spec_engine, created=CREATED):
        assert r.output.tokens == plain[r.custom_id].output.tokens
        assert body_of(r.line) == body_of(plain[r.custom_id].line)
        m, rep = r.output.metrics, r.line["deepinfer"]["speculative"]
        assert rep["verify_steps"] == len(m.verified) >= 1
        assert (rep["drafts_verified"], rep["drafts_accepted"]) == (sum(m.verified), sum(m.accepted))
        assert rep["acceptance_rate"] == pytest.approx(sum(m.accepted) / sum(m.verified))
        assert "deepinfer" not in plain[r.custom_id].line


def test_cli_argument_errors_exit_2(tmp_path, capsys, monkeypatch):
    """Checked before any model loads: one `error:` line, exit status 2."""
    from deepinfer_fn.__main__ import main
    monkeypatch.delenv("DEEPINFER_DEBUG", raising=False)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, [good("a", "x")])
    dst.write_text("{}\n")
    for argv, message in [(["nope.jsonl", "--output", str(dst)], "no such file"),
                          ([str(src), "--output", str(dst)], "--resume"),
                          ([str(src), "--output", str(dst), "--resume", "--overwrite"], "not both"),
                          ([str(src), "--output", "-", "--resume"], "stdout"),
                          ([str(src), "--output", str(dst), "--engine-options", "[1]"],
                           "JSON object"),
                          ([str(src), "--output", str(dst), "--overwrite", "--engine-options",
                            '{"drafter": 1}'], "--speculative")]:
        with pytest.raises(SystemExit) as e:
            main(["batch", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)
