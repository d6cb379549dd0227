"""The embedded default model (deepinfer_fn/assets/default_model): it loads, it is a V4 with
every attention and MoE type, its tokenizer round-trips and carries the V4 chat tokens, and
its weights are trained: on Python code it never saw it beats a uniform model by far and
beats even the best unigram model of that very text, and its MTP block predicts token i+2
far better than chance."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.config import CSA, HASH_MOE, HCA, SCORE_MOE, SWA
from deepinfer_fn.default_model import default_model_path
from deepinfer_fn.model import transformer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
CHAT = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

# Held-out text: written for this test (not from the standard library the model was trained
# on), ordinary Python in the stdlib's style.
HELDOUT = '''\
import os
import sys
from collections import defaultdict


class InventoryError(Exception):
    """Raised when an item cannot be found in the inventory."""


class Inventory:
    """A small in-memory inventory of named items and their counts."""

    def __init__(self, items=None):
        self._counts = defaultdict(int)
        if items is not None:
            for name, count in items.items():
                self.add(name, count)

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must be non-negative")
        self._counts[name] += count
        return self._counts[name]

    def remove(self, name, count=1):
        if name not in self._counts:
            raise InventoryError("no such item: %r" % (name,))
        if self._counts[name] < count:
            raise ValueError("not enough %s left" % name)
        self._counts[name] -= count
        if not self._counts[name]:
            del self._counts[name]

    def __len__(self):
        return len(self._counts)

    def __contains__(self, name):
        return name in self._counts

    def items(self):
        return sorted(self._counts.items())


def read_inventory(path):
    """Return an Inventory built from a file of 'name count' lines."""
    inventory = Inventory()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                name, count = line.split()
                inventory.add(name, int(count))
            except ValueError:
                raise ValueError("%s:%d: bad line %r" % (path, lineno, line)) from None
    return inventory


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if not argv:
        print("usage: inventory.py FILE", file=sys.stderr)
        return 2
    path = os.path.abspath(argv[0])
    for name, count in read_inventory(path).items():
        print("%-20s %5d" % (name, count))
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


@pytest.fixture(scope="module")
def model():
    path = default_model_path()
    params = di.load_params(path)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return path, params, tok


@pytest.fixture(scope="module")
def heldout(model):
    """Backbone NLL per token, MTP hits, and the ids, for HELDOUT."""
    _, params, tok = model
    ids = [params.config.bos_token_id] + tok.encode(HELDOUT, add_special_tokens=False).ids
    tokens = jnp.asarray([ids], jnp.int32)

    @jax.jit
    def run(params, tokens):
        logits, streams = transformer.logits_and_streams(params, tokens)
        T = tokens.shape[1]
        positions = jnp.arange(T - 2, dtype=jnp.int32)[None]
        mtp_logits, _ = transformer.mtp_block(params, streams[:, :-2], tokens[:, 1:-1], positions)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[0, :-1]), tokens[0, 1:, None], -1)
        mtp_hit = jnp.argmax(mtp_logits[0], -1) == tokens[0, 2:]
        return nll[:, 0], mtp_hit

    nll, mtp_hit = run(params, tokens)
    return np.asarray(nll), np.asarray(mtp_hit), np.asarray(ids)


def test_path_and_files():
    path = default_model_path()
    assert os.path.isdir(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "training_log.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert total <= 30 * 1024 ** 2, f"default model is {total / 1024 ** 2:.1f} MiB"


def test_config_is_v4_with_every_block_type(model):
    path, params, tok = model
    cfg = params.config
    assert cfg == di.ModelConfig.from_hf(path)
    assert set(cfg.layer_types) == {SWA, CSA, HCA}
    assert set(cfg.mlp_layer_types) == {HASH_MOE, SCORE_MOE}
    assert cfg.num_mtp_layers == 1 and params["mtp"], "MTP block missing"
    assert cfg.vocab_size == tok.get_vocab_size()
    assert cfg.bos_token_id == tok.token_to_id(BOS) == 0
    assert cfg.eos_token_id == tok.token_to_id(EOS) == 1
    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
        tc = json.load(f)
    assert (tc["bos_token"], tc["eos_token"]) == (BOS, EOS)
    # tid2eid of the hash layers: valid expert ids, k distinct experts per token
    for lp, mt in zip(params["layers"], cfg.mlp_layer_types):
        if mt == HASH_MOE:
            table = np.asarray(lp["ffn"]["tid2eid"])
            assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
            assert (np.sort(table, -1)[:, 1:] != np.sort(table, -1)[:, :-1]).all()


def test_tokenizer_round_trip_and_chat_tokens(model):
    _, _, tok = model
    for text in (HELDOUT, "x = {'a': [1, 2.5e-3]}\n\tif x:\n\t\tpass  # ünïcode ✓\r\n"):
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids,
                          skip_special_tokens=False) == text
    for s in [BOS, EOS] + CHAT:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert len(ids) == 1 and ids[0] == tok.token_to_id(s), s


def test_text_adapter_loads_it(model):
    text = pytest.importorskip("deepinfer_fn.text")
    path, params, _ = model
    t = text.load_tokenizer(path)
    assert (t.bos_id, t.eos_id) == (params.config.bos_token_id, params.config.eos_token_id)
    missing = [s for s in t.chat_tokens() if t.token_to_id(s) is None]
    assert not missing


def test_heldout_nll_beats_uniform_and_unigram(model, heldout):
    """Mean NLL on unseen code below log(V) - 2 nats, and below the entropy of the text's own
    unigram distribution (the best any unigram model could do on it, fitted on the answer)."""
    _, params, _ = model
    nll, _, ids = heldout
    targets = ids[1:]
    counts = np.bincount(targets)
    p = counts[counts > 0] / len(targets)
    unigram_entropy = float(-(p * np.log(p)).sum())
    mean = float(nll.mean())
    print(f"held-out NLL {mean:.3f} nats/token; oracle unigram {unigram_entropy:.3f}; "
          f"uniform {math.log(params.config.vocab_size):.3f}")
    assert mean < math.log(params.config.vocab_size) - 2.0
    assert mean < unigram_entropy - 1.0


def test_mtp_block_beats_chance(heldout):
    """MTP (token i+2) top-1 accuracy on unseen code far above the best constant guess."""
    _, mtp_hit, ids = heldout
    targets = ids[2:]
    best_constant = np.bincount(targets).max() / len(targets)
    acc = float(mtp_hit.mean())
    print(f"MTP top-1 {acc:.3f}; most frequent token {best_constant:.3f}")
    assert acc > max(0.2, 1.5 * best_constant)
