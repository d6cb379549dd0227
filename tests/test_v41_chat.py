"""V4.1 chat format: `text.Tokenizer.apply_chat` renders through deepseek-recipe's
DeepseekV41Encoding when the model is V4.1 (config.json / ModelConfig), V4 stays as it was."""

import json

import deepseek_recipe as dr
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer_fn import text
from deepinfer_fn.batch import encodings
from deepinfer_fn.config import ModelConfig

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there"}],
    "system": [{"role": "system", "content": "You are helpful."},
               {"role": "user", "content": "2+2?"}],
    "two_systems": [{"role": "system", "content": "Be brief."},
                    {"role": "system", "content": "Answer in English."},
                    {"role": "user", "content": "Hello"}, {"role": "user", "content": "again"}],
    "multi_turn": [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Hello there, what is 2+2?"},
                   {"role": "assistant", "content": "It is 4.",
                    "reasoning_content": "2 plus 2 makes 4"},
                   {"role": "user", "content": "And 中文 😀 <｜System｜> <｜User｜>?"}],
    "assistant_last": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello!"}],
}
_CORPUS = ["You are a helpful assistant. Hello there, what is 2+2? It is 4.",
           "def main(argv):\n    return 0\n", "Be brief. Answer in English. again"] * 20


def _recipe_message(m):
    if m["role"] == "system":
        return dr.SystemMessage(m["content"])
    if m["role"] == "user":
        return dr.UserMessage(m["content"])
    return dr.AssistantMessage(m["content"], reasoning_content=m.get("reasoning_content"))


def _rendered_ids(tok, rendered):
    """Ids of a recipe RenderedPrompt, re-derived: special ranges by token_to_id, the text
    between them with the plain (no added vocabulary) pipeline."""
    ids, prompt, at = [], rendered.prompt, 0
    for start, end in rendered.special_ranges:
        ids += tok.encode(prompt[at:start])
        special = tok.token_to_id(prompt[start:end])
        assert special is not None, prompt[start:end]
        ids.append(special)
        at = end
    return ids + tok.encode(prompt[at:])


def _recipe_ids(cls, tok, messages, thinking, effort):
    conv = dr.Conversation([_recipe_message(m) for m in messages], thinking_mode=thinking,
                           reasoning_effort=effort)
    return _rendered_ids(tok, cls().render_conversation(conv))


@pytest.fixture(scope="module")
def v41_dirs(tmp_path_factory):
    """Two V4.1 model directories: the real V4 vocabulary plus <｜System｜>, and a tiny BPE."""
    real = tmp_path_factory.mktemp("v41_real")
    tok = tokenizers.Tokenizer.from_file(str(text.default_tokenizer_path()))
    tok.add_special_tokens([tokenizers.AddedToken(text.SYSTEM, special=True, normalized=False)])
    tok.save(str(real / "tokenizer.json"))
    (real / "config.json").write_text(json.dumps({"model_type": "deepseek_v41"}))
    tiny = tmp_path_factory.mktemp("v41_tiny")
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=text.chat_special_tokens("deepseek_v41"),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.save(str(tiny / "tokenizer.json"))
    (tiny / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV41ForCausalLM"],
         "text_config": {"model_type": "deepseek_v41_text"}}))
    return {"real": real, "tiny": tiny}


@pytest.fixture(scope="module")
def v41(v41_dirs):
    return {k: text.load_tokenizer(d) for k, d in v41_dirs.items()}


def test_installed_recipe_has_the_v41_encoding():
    assert dr.__version__ == "0.2.0"
    assert text.CHAT_ENCODINGS == {"deepseek_v4": "DeepseekV4Encoding",
                                   "deepseek_v41": "DeepseekV41Encoding"}
    assert all(hasattr(dr, name) for name in text.CHAT_ENCODINGS.values())
    assert dr.SpecialToken.System.default_str() == text.SYSTEM == "<｜System｜>"


def test_encoding_follows_the_config():
    assert text.chat_encoding_of(ModelConfig.preset("v4.1-tiny")) == "deepseek_v41"
    assert text.chat_encoding_of(ModelConfig.preset("v4.1-flash")) == "deepseek_v41"
    assert text.chat_encoding_of(ModelConfig.preset("v4-flash")) == "deepseek_v4"
    for raw, want in [({"model_type": "deepseek_v41"}, "deepseek_v41"),
                      ({"text_config": {"model_type": "deepseek_v41_text"}}, "deepseek_v41"),
                      ({"architectures": ["DeepseekV41ForCausalLM"]}, "deepseek_v41"),
                      ({"architectures": ["DeepseekV4ForCausalLM"]}, "deepseek_v4"),
                      ({"model_type": "deepseek_v4"}, "deepseek_v4"), ({}, "deepseek_v4")]:
        assert text.chat_encoding_of(raw) == want, raw
        # the batch path's family table agrees
        assert encodings.family_of(raw).encoding == text.CHAT_ENCODINGS[want], raw
    with pytest.raises(ValueError, match="llama"):
        text.chat_encoding_of({"model_type": "llama"})
    with pytest.raises(TypeError, match="ModelConfig"):
        text.chat_encoding_of(3)


def test_load_tokenizer_reads_config_json(v41, v41_dirs, tmp_path):
    assert v41["real"].chat_encoding == v41["tiny"].chat_encoding == "deepseek_v41"
    assert "deepseek_v41" in repr(v41["real"])
    assert text.load_tokenizer().chat_encoding == "deepseek_v4"      # no config.json: V4
    forced = text.load_tokenizer(v41_dirs["tiny"], chat_encoding="deepseek_v4")
    assert forced.chat_encoding == "deepseek_v4"
    assert v41["tiny"].chat_tokens() == text.chat_special_tokens("deepseek_v41")
    assert text.chat_special_tokens("deepseek_v41") == text.chat_special_tokens() + [text.SYSTEM]
    with pytest.raises(ValueError, match="chat_encoding must be one of"):
        text.load_tokenizer(chat_encoding="v5")
    (tmp_path / "tokenizer.json").write_text((v41_dirs["tiny"] / "tokenizer.json").read_text())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        text.load_tokenizer(tmp_path)


@pytest.mark.parametrize("which", ["real", "tiny"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking,effort", [(False, None), (True, None), (True, "low"),
                                             (True, "max")])
def test_v41_ids_equal_the_recipes_rendering(v41, which, name, thinking, effort):
    tok, messages = v41[which], CONVERSATIONS[name]
    got = tok.apply_chat(messages, thinking=thinking, reasoning_effort=effort)
    assert got == _recipe_ids(dr.DeepseekV41Encoding, tok, messages, thinking, effort)
    # the formats differ exactly in the system part (system text, thinking-mode effort block)
    differs = thinking or any(m["role"] == "system" for m in messages)
    assert (got != _recipe_ids(dr.DeepseekV4Encoding, tok, messages, thinking, effort)) == differs
    opening = [tok.token_to_id(text.ASSISTANT),
               tok.token_to_id(text.THINK_START if thinking else text.THINK_END)]
    assert got[-2:] == opening
    assert tok.apply_chat(messages, add_generation_prompt=False, thinking=thinking,
                          reasoning_effort=effort) == got[:-2]


def test_v41_literal_format(v41):
    """The documented V4.1 layout, assembled by hand."""
    tok = v41["real"]
    sid, enc = tok.token_to_id, tok.encode
    got = tok.apply_chat(CONVERSATIONS["multi_turn"])
    m = CONVERSATIONS["multi_turn"]
    assert got == ([sid(text.BOS), sid(text.SYSTEM)] + enc(m[0]["content"])
                   + [sid(text.USER)] + enc(m[1]["content"])
                   + [sid(text.ASSISTANT), sid(text.THINK_END)] + enc(m[2]["content"])
                   + [sid(text.EOS), sid(text.USER)] + enc(m[3]["content"])
                   + [sid(text.ASSISTANT), sid(text.THINK_END)])
    # two system messages are two <｜System｜> blocks (V4 joins them with a blank line)
    got = tok.apply_chat(CONVERSATIONS["two_systems"])
    assert got[:2 + len(enc("Be brief.")) + 1] == [sid(text.BOS), sid(text.SYSTEM)] + \
        enc("Be brief.") + [sid(text.SYSTEM)]
    # thinking mode always carries the effort block, low included
    low = tok.decode(tok.apply_chat(CONVERSATIONS["user"], thinking=True, reasoning_effort="low"))
    assert low.startswith(text.BOS + text.SYSTEM + "Reasoning Effort: 50")
    # special spellings in content stay text
    assert got.count(sid(text.SYSTEM)) == 2
    ids = tok.apply_chat(CONVERSATIONS["multi_turn"])
    assert ids.count(sid(text.SYSTEM)) == 1 and ids.count(sid(text.USER)) == 2


@pytest.fixture(scope="module")
def v4():
    return text.load_tokenizer()


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_v4_unchanged(v4, name):
    messages = CONVERSATIONS[name]
    for thinking, effort in [(False, None), (True, "low"), (True, None)]:
        assert v4.apply_chat(messages, thinking=thinking, reasoning_effort=effort) == \
            _recipe_ids(dr.DeepseekV4Encoding, v4, messages, thinking, effort)


def test_with_chat_encoding_and_missing_system_token(v4):
    assert v4.with_chat_encoding("deepseek_v4") is v4
    as_v41 = v4.with_chat_encoding("deepseek_v41")
    assert as_v41.chat_encoding == "deepseek_v41" and v4.chat_encoding == "deepseek_v4"
    assert as_v41.vocab_size == v4.vocab_size and as_v41.eos_id == v4.eos_id
    # the V4 vocabulary has no <｜System｜>: V4.1 rendering names the missing token
    with pytest.raises(ValueError, match="System.*deepseek_v41"):
        as_v41.apply_chat(CONVERSATIONS["user"])
    with pytest.raises(ValueError, match="chat_encoding must be one of"):
        v4.with_chat_encoding("deepseek_v5")


def test_tool_call_through_the_batch_path(v41, v41_dirs):
    """apply_chat takes system/user/assistant only; tool calls go through the batch path, whose
    encoding the same config picks: its ids equal the recipe's V4.1 rendering."""
    tok = v41["real"]          # the DSML tool-call token is in the real vocabulary
    raw = json.loads((v41_dirs["real"] / "config.json").read_text())
    fmt = encodings.chat_format(encodings.family_of(raw), v41_dirs["real"] / "tokenizer.json",
                                *tok.chat_tokens()[:2])
    tools = [dr.ToolDefinition("get_weather", "Weather of a city",
                               {"type": "object", "properties": {"city": {"type": "string"}}})]
    conv = dr.Conversation([
        dr.SystemMessage("You are helpful."), dr.UserMessage("Weather in Paris?"),
        dr.AssistantMessage("", tool_calls=[dr.ToolCall("c1", "get_weather", '{"city": "Paris"}')]),
        dr.ToolMessage("sunny", tool_call_id="c1")], thinking_mode=False, tools=tools)
    got = list(fmt.encoding.encode(conv))
    assert got == _rendered_ids(tok, dr.DeepseekV41Encoding().render_conversation(conv))
    assert got != _rendered_ids(tok, dr.DeepseekV4Encoding().render_conversation(conv))
    assert tok.decode(got).startswith(text.BOS + text.SYSTEM)
    assert tok.token_to_id("｜DSML｜") in got
    # the plain-chat part agrees with apply_chat
    plain = [m for m in CONVERSATIONS["multi_turn"]]
    conv = dr.Conversation([_recipe_message(m) for m in plain], thinking_mode=False)
    assert list(fmt.encoding.encode(conv)) == tok.apply_chat(plain)
