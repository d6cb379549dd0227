"""Seeded fuzz of the public API's argument checks (`generate`, `stream_generate`, `forward`,
`Request`, `Engine`, `ModelConfig`).

Oracle: the documented contract (docstrings of generate / sampling_params / Request / Engine /
ModelConfig), encoded below as pools of valid values and of invalid values per argument. A
drawn argument set is valid iff every argument came from a valid pool. Invalid sets must raise
a ValueError / TypeError at the call (for stream_generate before the first next()) without
compiling anything; valid sets must return the documented shapes. Valid calls reuse one shape
(tiny preset, f32, tokens [2, 6], max_new_tokens <= 3), so they share compiled programs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.config import ConfigError
from fuzz_util import BUILTIN, PROJECT_ERRORS, TALLY, pick, rejected_at_call

B, T, V = 2, 6, 256      # the tiny preset's vocabulary
SEEDS = (0, 1, 2)


@functools.cache
def params():
    return di.init_params(di.ModelConfig.preset("tiny"), jax.random.key(0), dtype=jnp.float32)


def base_tokens(rng) -> np.ndarray:
    return rng.integers(2, V, (B, T)).astype(np.int32)


# ------------------------------------------------------------------ argument pools
# name -> (valid values, invalid values); a callable value is drawn from the rng.
GEN_ARGS = {
    "tokens": (
        [base_tokens, lambda r: base_tokens(r).astype(np.int64),
         lambda r: base_tokens(r).tolist(), lambda r: jnp.asarray(base_tokens(r))],
        [lambda r: base_tokens(r).astype(np.float32), lambda r: base_tokens(r)[None],
         lambda r: np.zeros((B, 0), np.int32), lambda r: np.int32(3),
         lambda r: np.where(np.arange(T) == 2, V, base_tokens(r)),
         lambda r: np.where(np.arange(T) == 0, -1, base_tokens(r)),
         lambda r: base_tokens(r) > 100, lambda r: [["a"] * T] * B,
         lambda r: [[1, 2, 3], [4, 5]]]),
    "lengths": (
        [None, [T, 3], lambda r: r.integers(1, T + 1, B), np.array([1, T], np.int32)],
        [[T], [T, T, T], [0, T], [T + 1, 1], [-1, 2], [2.5, 3.0], [True, True], "ab"]),
    "max_new_tokens": (
        [1, 2, 3, np.int32(3)],
        [0, -1, 2.0, True, "3", None, 10**9, math.nan]),
    "temperature": (
        [0.0, 0.7, [0.0, 1.0], np.float32(0.5)],
        [-1.0, math.nan, "hot", [0.0, 0.0, 0.0], [math.nan, 0.0], None]),
    "top_k": (
        [None, 0, 5, np.int64(3), [0, 4]],
        [-1, 2.5, True, [1], "5"]),
    "top_p": (
        [None, 1.0, 0.9, [0.5, 1.0]],
        [0.0, 1.5, -0.1, math.nan, [0.9]]),
    "min_p": (
        [None, 0.0, 0.1],
        [1.0, -0.1, math.nan, 2]),
    "seed": (
        [0, 7, 2**32 - 1, [1, 2], np.uint32(9)],
        [-1, 2**32, 1.5, "x", True]),
    "stop_tokens": (
        [(), (5,), [1, 2], np.array([3])],
        [[V], [-1], [1.5], "ab", 3, [True]]),
    "pad_id": (
        [None, 0, V - 1],
        [1.5, "x", -1, V, True]),
    "prefill_chunk": (
        [512, 16],
        [0, -1, 2.5, True]),
    "max_len": (
        [None, 256],
        [0, -1, T, 1.5]),
}
INVALID_CASES = [(name, i) for name, (_, bad) in GEN_ARGS.items() for i in range(len(bad))]

# Cases the current library gets wrong (gaps in the boundary checks, listed in the report):
# "<test>:<case id>" -> reason. Each is xfail(strict=True), so a fix shows up as XPASS.
GAPS = {}
GEN_GAPS = {c for c in INVALID_CASES if f"generate:{c[0]}-{c[1]}" in GAPS}


def cases(test: str, ids: list, values: list) -> list:
    """pytest params with ids; those listed in GAPS under `test` are strict xfails."""
    out = []
    for i, v in zip(ids, values):
        key = f"{test}:{i}"
        marks = [pytest.mark.xfail(strict=True, reason=GAPS[key])] if key in GAPS else []
        out.append(pytest.param(*v, id=i, marks=marks))
    return out


def draw(rng, pool):
    v = pick(rng, pool)
    return v(rng) if callable(v) else v


def valid_args(rng) -> dict:
    return {name: draw(rng, good) for name, (good, _) in GEN_ARGS.items()}


def invalid_value(rng, name, index):
    v = GEN_ARGS[name][1][index]
    return v(rng) if callable(v) else v


def check_output(out, kw):
    n = int(kw["max_new_tokens"])
    toks = np.asarray(out.tokens)
    assert toks.ndim == 2 and toks.shape[0] == B and toks.shape[1] >= n, toks.shape
    lengths = np.asarray(out.lengths)
    assert lengths.shape == (B,) and np.all((1 <= lengths) & (lengths <= n)), lengths
    assert np.asarray(out.stopped).shape == (B,)
    real = np.arange(toks.shape[1])[None] < lengths[:, None]
    assert np.all((toks[real] >= 0) & (toks[real] < V))


def _gen_case(seed, name, index):
    rng = np.random.default_rng([seed, len(name), index])
    kw = valid_args(rng)
    kw[name] = invalid_value(rng, name, index)
    return kw


def _case_id(case):
    name, index = case
    return f"{name}-{index}"


CASE_IDS = [_case_id(c) for c in INVALID_CASES]


@pytest.mark.parametrize("name,index", cases("generate", CASE_IDS, INVALID_CASES))
def test_generate_rejects_each_invalid_argument(name, index):
    """One invalid argument among valid ones: generate raises at the call."""
    for seed in SEEDS[:2]:
        kw = _gen_case(seed, name, index)
        rejected_at_call(di.generate, params(), kw.pop("tokens"), **kw)


@pytest.mark.parametrize("name,index", cases("stream", CASE_IDS, INVALID_CASES))
def test_stream_generate_rejects_at_the_call(name, index):
    """Same, for stream_generate: the call itself raises, before any next()."""
    kw = _gen_case(0, name, index)
    rejected_at_call(di.stream_generate, params(), kw.pop("tokens"), block=2, **kw)


def test_generate_valid_and_mixed_fuzz():
    """Random argument sets, half of them with 1-3 arguments from the invalid pools: the oracle
    says valid iff none is; valid calls succeed with the documented shapes, invalid ones raise at the call
    (also stream_generate, before its first next())."""
    counts = dict(valid=0, invalid=0)
    stream_gaps = {c for c in INVALID_CASES if f"stream:{c[0]}-{c[1]}" in GAPS}
    for seed in SEEDS:
        rng = np.random.default_rng(100 + seed)
        for _ in range(6):
            kw, bad = valid_args(rng), []
            names = list(GEN_ARGS)
            n_bad = 0 if rng.random() < 0.5 else int(rng.integers(1, 4))
            for name in rng.choice(names, size=n_bad, replace=False):
                choices = [i for i in range(len(GEN_ARGS[name][1])) if (name, i) not in GEN_GAPS]
                if choices:
                    i = pick(rng, choices)
                    kw[name] = invalid_value(rng, name, i)
                    bad.append((name, i))
            tokens = kw.pop("tokens")
            if bad:
                counts["invalid"] += 1
                rejected_at_call(di.generate, params(), tokens, **kw)
                if not stream_gaps.intersection(bad):
                    rejected_at_call(di.stream_generate, params(), tokens, block=2, **kw)
                continue
            counts["valid"] += 1
            check_output(di.generate(params(), tokens, **kw), kw)
            if counts["valid"] % 4 == 1:         # a few streams (same programs, block 2)
                pieces = list(di.stream_generate(params(), tokens, block=2, **kw))
                assert sum(np.asarray(p.lengths) for p in pieces).max() <= kw["max_new_tokens"]
    print(f"\nFUZZ generate: {counts}, rejections {dict(TALLY)}")
    assert counts["valid"] >= 4 and counts["invalid"] >= 4


# ------------------------------------------------------------------ forward
FORWARD_INVALID = [
    lambda r: base_tokens(r).astype(np.float32), lambda r: base_tokens(r)[0],
    lambda r: base_tokens(r)[None], lambda r: np.zeros((B, 0), np.int32),
    lambda r: np.where(np.arange(T) == 1, V, base_tokens(r)),
    lambda r: np.where(np.arange(T) == 1, -5, base_tokens(r)),
    lambda r: np.zeros((1, 1025), np.int32), lambda r: "abc", lambda r: None,
    lambda r: base_tokens(r) > 9,
]


@pytest.mark.parametrize("index", cases("forward", [str(i) for i in range(len(FORWARD_INVALID))],
                                        [(i,) for i in range(len(FORWARD_INVALID))]))
def test_forward_rejects(index):
    rng = np.random.default_rng(index)
    rejected_at_call(di.forward, params(), FORWARD_INVALID[index](rng))


def test_forward_valid_and_bad_params():
    rng = np.random.default_rng(5)
    for make in (base_tokens, lambda r: jnp.asarray(base_tokens(r))):
        logits = di.forward(params(), make(rng))
        assert logits.shape == (B, T, V) and logits.dtype == jnp.float32
    rejected_at_call(di.forward, {"not": "params"}, base_tokens(rng))
    rejected_at_call(di.generate, None, base_tokens(rng), max_new_tokens=1)


# ------------------------------------------------------------------ Request / Engine
REQUEST_INVALID = {
    "tokens": [[], [[1, 2], [3]], [1.5, 2.0], ["a", "b"], [1, V + 5], [-1, 3], 7],
    "max_new_tokens": [0, -3, 2.5, True, "4", None],
    "temperature": [-0.5, math.nan, "warm"],
    "top_k": [-2, 1.5, True],
    "top_p": [0.0, 1.01, math.nan],
    "min_p": [1.0, -0.2],
    "seed": [-1, 2**32, 0.5],
    "stop_tokens": [[V], [-2], ["x"], 5],
}
REQUEST_CASES = [(n, i) for n, vs in REQUEST_INVALID.items() for i in range(len(vs))]


@functools.cache
def tiny_engine():
    return di.Engine(params(), max_batch=2, max_tokens_per_step=16, max_len=64, progress=False,
                     prefill_shapes=((1, 16),), decode_buckets=(2,))


@pytest.mark.parametrize("name,index", cases("request", [_case_id(c) for c in REQUEST_CASES],
                                              REQUEST_CASES))
def test_request_rejects(name, index):
    """A bad Request raises at construction or ends with finish_reason "error" and a message
    naming the argument, compiling nothing."""
    kw = dict(tokens=[3, 4, 5], max_new_tokens=2)
    kw[name] = REQUEST_INVALID[name][index]
    eng = tiny_engine()
    with di.ProgramCounter() as counter:
        try:
            req = di.Request(**kw)
        except (ValueError, TypeError) as e:
            TALLY["project" if isinstance(e, PROJECT_ERRORS) else "builtin"] += 1
            assert name in str(e) or name.rstrip("s") in str(e), str(e)
            return
        out = eng.generate([req])[0]
    assert counter.programs == 0, counter.names
    assert out.finish_reason == "error" and out.tokens == [], out
    word = {"tokens": ("token", "prompt", "vocabulary")}.get(name, (name,))
    assert any(w in out.error for w in word), out.error


ENGINE_VALID = dict(max_batch=2, max_tokens_per_step=16, max_len=64, progress=False,
                    prefill_shapes=((1, 16),), decode_buckets=(2,))
ENGINE_INVALID = [
    ("max_batch", 0), ("max_batch", -1), ("max_batch", True), ("max_batch", 2.5),
    ("max_tokens_per_step", 0), ("max_tokens_per_step", "16"), ("page_size", 3),
    ("page_size", 0), ("max_len", 2048), ("max_len", -16), ("max_len", 0), ("num_pages", -1),
    ("num_pages", 1.5), ("prefill_shapes", ((0, 16),)), ("prefill_shapes", ((3, 16),)),
    ("decode_buckets", (1,)), ("replay_tokens", 1), ("speculative", "eagle"),
    ("verify_len", "sometimes"), ("num_draft_tokens", 3), ("window_slots", -4),
    ("prefix_cache", "yes"), ("max_batch", None),
]


@pytest.mark.parametrize("index", cases("engine", [f"{n}={v!r}" for n, v in ENGINE_INVALID],
                                        [(i,) for i in range(len(ENGINE_INVALID))]))
def test_engine_constructor_rejects(index):
    name, value = ENGINE_INVALID[index]
    err = rejected_at_call(di.Engine, params(), **{**ENGINE_VALID, name: value})
    assert name in str(err), str(err)


def test_engine_constructor_valid():
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        kw = dict(ENGINE_VALID, max_len=int(pick(rng, [32, 64, 128])),
                  num_pages=pick(rng, [None, 9, 20]), prefix_cache=bool(rng.integers(2)),
                  async_scheduling=bool(rng.integers(2)), replay_tokens=pick(rng, [None, 8, 128]))
        eng = di.Engine(params(), **kw)
        assert eng.max_batch == 2 and eng.max_len >= kw["max_len"]


# ------------------------------------------------------------------ ModelConfig
CONFIG_INVALID = [
    ("vocab_size", 0), ("vocab_size", -1), ("vocab_size", 2.5), ("vocab_size", True),
    ("vocab_size", "256"), ("vocab_size", None), ("hidden_size", 0), ("num_hidden_layers", 3),
    ("o_groups", 3), ("qk_rope_head_dim", 7), ("numerics", "fast"), ("scoring_func", "softmax"),
    ("num_experts_per_tok", 9), ("rms_norm_eps", -1.0), ("rms_norm_eps", math.nan),
    ("rope_theta", 0.0), ("rope_theta", "1e4"), ("hc_eps", None), ("bos_token_id", -1),
    ("eos_token_id", 256), ("eos_token_id", 1.5), ("num_mtp_layers", -1),
    ("n_shared_experts", 2), ("yarn_factor", 0.5), ("layer_types", ("swa", "csa", "hca", "xxx")),
    ("fp8_block", (128,)), ("scan_layers", "yes"), ("hc_sinkhorn_iters", 0),
]
CONFIG_VALID = [("vocab_size", 512), ("rms_norm_eps", 1e-5), ("eos_token_id", 2),
                ("numerics", "serving"), ("hc_sinkhorn_iters", 5), ("scan_layers", False),
                ("rope_theta", 5e4), ("bos_token_id", 255)]


@pytest.mark.parametrize("index", cases("config", [f"{n}={v!r}" for n, v in CONFIG_INVALID],
                                        [(i,) for i in range(len(CONFIG_INVALID))]))
def test_config_rejects(index):
    """preset().replace(field=bad) and from_hf(dict with the bad field) raise ConfigError-like
    errors naming the field."""
    name, value = CONFIG_INVALID[index]
    tiny = di.ModelConfig.preset("tiny")
    err = rejected_at_call(tiny.replace, **{name: value})
    assert isinstance(err, (ConfigError, ValueError, TypeError))
    hf = tiny.to_hf()
    if name in hf and name not in ("layer_types",):
        hf[name] = value
        rejected_at_call(di.ModelConfig.from_hf, hf)


def test_config_valid_and_from_hf_round_trip():
    tiny = di.ModelConfig.preset("tiny")
    assert di.ModelConfig.from_hf(tiny.to_hf()) == tiny
    rng = np.random.default_rng(0)
    for _ in range(6):
        changes = dict(pick(rng, CONFIG_VALID) for _ in range(2))
        cfg = tiny.replace(**changes)
        assert all(getattr(cfg, k) == v for k, v in changes.items())
        if "scan_layers" not in changes:
            assert di.ModelConfig.from_hf(cfg.to_hf()) == cfg
    for bad in ([1, 2], "not a dir/nor a preset", 42, {"vocab_size": 10}, {**tiny.to_hf(), "bogus": 1}):
        rejected_at_call(di.ModelConfig.from_hf, bad)
    rejected_at_call(di.ModelConfig.preset, "tiny-ish")


# ------------------------------------------------------------------ random scalars vs an oracle
def random_scalar(rng):
    """A value of a random kind: ints (small, negative, huge), floats (integral, fractional,
    nan, inf), bools, numpy scalars, strings, None."""
    kind = int(rng.integers(10))
    if kind == 0:
        return int(rng.integers(-3, 12))
    if kind == 1:
        return int(rng.choice([2**31 - 1, 2**31, 2**32 - 1, 2**32, -2**31, 10**12]))
    if kind == 2:
        return float(rng.uniform(-0.5, 1.5))
    if kind == 3:
        return float(rng.choice([math.nan, math.inf, -math.inf, 0.0, 1.0, 2.0]))
    if kind == 4:
        return bool(rng.integers(2))
    if kind == 5:
        return np.int32(rng.integers(0, 9))
    if kind == 6:
        return np.float32(rng.uniform(0, 1))
    if kind == 7:
        return pick(rng, ["1", "0.5", "", "greedy"])
    if kind == 8:
        return None
    return np.bool_(rng.integers(2))


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def scalar_oracle(name: str, x):
    """True: valid by the documented contract; False: invalid; None: unspecified (an integral
    float where an int is meant: accepting or rejecting it are both within the contract)."""
    if name in ("top_k", "seed", "max_new_tokens") and _real(x) and not _int(x):
        if math.isfinite(float(x)) and float(x) == int(float(x)):
            return None
        return False
    if name in ("top_k", "top_p", "min_p") and x is None:
        return True                           # None disables the filter
    if name == "temperature":
        return _real(x) and math.isfinite(float(x)) and float(x) >= 0
    if name == "top_k":
        return _int(x) and 0 <= int(x) < 2**31
    if name == "top_p":
        return _real(x) and 0 < float(x) <= 1
    if name == "min_p":
        return _real(x) and 0 <= float(x) < 1
    if name == "seed":
        return _int(x) and 0 <= int(x) < 2**32
    if name == "max_new_tokens":
        return _int(x) and 1 <= int(x) and T + int(x) <= 1024
    raise KeyError(name)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_scalars_against_the_oracle(seed):
    """Random values of random kinds for each scalar argument of generate: valid by the oracle
    -> succeeds (max_new_tokens capped at 3 to reuse the programs), invalid -> rejected at the
    call."""
    rng = np.random.default_rng(1000 + seed)
    tokens = base_tokens(rng)
    tally = dict(valid=0, invalid=0, unspecified=0)
    for _ in range(30):
        name = pick(rng, ["temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens"])
        x = random_scalar(rng)
        if name == "max_new_tokens" and _int(x) and 3 < int(x) and T + int(x) <= 1024:
            x = 3                             # valid, but keep the compiled decode width
        verdict = scalar_oracle(name, x)
        kw = {"max_new_tokens": 2, name: x}
        if verdict is None:
            tally["unspecified"] += 1
            try:
                di.generate(params(), tokens, **kw)
            except (ValueError, TypeError):
                pass
        elif verdict:
            tally["valid"] += 1
            check_output(di.generate(params(), tokens, **kw), kw)
        else:
            tally["invalid"] += 1
            err = rejected_at_call(di.generate, params(), tokens, **kw)
            assert name in str(err), f"{name}={x!r}: {err}"
    print(f"\nSCALAR FUZZ seed={seed}: {tally}")
    assert tally["valid"] and tally["invalid"]


@pytest.mark.heavy
@pytest.mark.parametrize("seed", range(3, 23))
def test_random_scalars_heavy(seed):
    test_random_scalars_against_the_oracle(seed)


def test_report_error_types():
    """Runs last in this file: how many rejections raised the project's own types."""
    if not TALLY:
        pytest.skip("no rejection ran before this test (a -k selection)")
    print(f"\nREJECTIONS: {dict(TALLY)}; not the project's types: {BUILTIN}")
    assert TALLY["project"] > 0
