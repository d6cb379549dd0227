"""Explicit DP/EP sharding on 8 fake CPU devices: forward and greedy generate on several
meshes equal the single-device results; sharded loading; a 2-process x 4-device run."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import deepinfer_fn as di
import shardings
from conftest import GOLDEN, ROOT, golden_params, no_cache_writes, rel_err

MESHES = [dict(dp=8), dict(dp=2, ep=4), dict(ep=8)]
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _mesh(kw):
    return shardings.make_mesh(**kw)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (3, 40)).astype(np.int32), np.array([40, 17, 29], np.int32)


@pytest.mark.parametrize("kw", MESHES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_forward_on_mesh_equals_single_device(kw, golden):
    ref = golden("cfg_a")
    params = shardings.shard_params(golden_params("cfg_a"), _mesh(kw))
    if kw.get("ep", 1) > 1:
        w1 = params["layers"][1]["ffn"]["w1"]
        assert w1.sharding.spec[0] == "ep" and len(w1.addressable_shards[0].data) == 8 // kw["ep"]
    logits = np.asarray(di.forward(params, ref["input_ids"]))
    assert rel_err(logits, ref["logits"]) <= 1e-5


def _mesh_id(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items())


# Each mesh compiles its own generate program (~1-2 min on 2 cores): dp=2,ep=4 (both axes) runs
# in the default suite, the single-axis meshes are `heavy` (CI runs them too).
@pytest.mark.parametrize("kw", [pytest.param(kw, marks=() if kw == dict(dp=2, ep=4) else pytest.mark.heavy,
                                             id=_mesh_id(kw)) for kw in MESHES])
def test_greedy_generate_on_mesh_equals_single_device(kw, prompts):
    tokens, lengths = prompts
    single = np.asarray(di.generate(golden_params("cfg_a"), tokens, lengths=lengths, max_new_tokens=6).tokens)
    params = shardings.shard_params(golden_params("cfg_a"), _mesh(kw))
    sharded = np.asarray(di.generate(params, tokens, lengths=lengths, max_new_tokens=6).tokens)
    np.testing.assert_array_equal(sharded, single)


def _redundant(params, ep):
    """Replicate the hottest experts of a skewed trace: 8 logical -> 16 physical experts."""
    from shardings.balancer import plan_replicas
    load = np.array([40, 3, 25, 1, 9, 2, 60, 4], np.float64)
    return shardings.replicate_experts(params, plan_replicas(load, n_devices=8, n_redundant=8))


@pytest.mark.parametrize("kw", [pytest.param(dict(dp=2, ep=4), id="dp=2,ep=4", marks=pytest.mark.heavy),
                                pytest.param(dict(ep=8), id="ep=8")])
def test_redundant_experts_on_mesh_equal_single_device(kw, golden, prompts):
    ref = golden("cfg_a")
    replicated = _redundant(golden_params("cfg_a"), kw.get("ep", 1))
    assert replicated["layers"][2]["ffn"]["w1"].shape[0] == 16
    single = np.asarray(di.forward(replicated, ref["input_ids"]))
    assert rel_err(single, ref["logits"]) <= 1e-5
    params = shardings.shard_params(replicated, _mesh(kw))
    assert params["layers"][2]["ffn"]["w1"].sharding.spec[0] == "ep"
    assert rel_err(np.asarray(di.forward(params, ref["input_ids"])), ref["logits"]) <= 1e-5
    tokens, lengths = prompts
    want = np.asarray(di.generate(golden_params("cfg_a"), tokens, lengths=lengths, max_new_tokens=6).tokens)
    got = np.asarray(di.generate(params, tokens, lengths=lengths, max_new_tokens=6).tokens)
    np.testing.assert_array_equal(got, want)


def test_sharded_loading_places_each_tensor_and_matches(golden):
    mesh = _mesh(dict(dp=2, ep=4))
    params = di.load_params(GOLDEN / "cfg_a", mesh=mesh)
    w = params["layers"][2]["ffn"]["w2"]
    assert w.sharding.mesh is mesh and [s.data.shape[0] for s in w.addressable_shards] == [2] * 8
    for a, b in zip(jax.tree.leaves(golden_params("cfg_a").weights), jax.tree.leaves(params.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mesh_errors():
    with pytest.raises(ValueError, match="= 6 devices, but 8"):
        shardings.make_mesh(dp=2, ep=3)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_form_one_mesh(tmp_path, golden):
    """jax.distributed over 2 local processes x 4 CPU devices = one (dp=2, ep=4) mesh."""
    port = _free_port()
    out = tmp_path / "logits.npy"
    env_base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for pid in range(2):
        env = dict(env_base, DEEPINFER_COORDINATOR=f"127.0.0.1:{port}", DEEPINFER_NUM_PROCESSES="2",
                   DEEPINFER_PROCESS_ID=str(pid), DEEPINFER_OUT=str(out))
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "multihost_worker.py")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n".join(l[-3000:] for l in logs)
    logits = np.load(out)
    want = golden("cfg_a")["logits"]
    assert logits.shape == (8,) + want.shape[1:]
    for r in range(4):
        assert rel_err(logits[2 * r:2 * r + 2], want) <= 1e-5


@pytest.mark.heavy
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_speculative_generate_on_mesh_equals_single_device(method, prompts):
    """Speculative decoding on dp=2,ep=4 (3 rows padded to the mesh's 8 batch shards): the same
    tokens, acceptance counts (and DSpark confidences) as on one device; greedy with every
    draft verified, and sampled with a random verify length per row and step (DSpark)."""
    from deepinfer_fn.speculative import dspark
    tokens, lengths = prompts
    base = golden_params("cfg_a_mtp" if method == "mtp" else "cfg_a")
    runs = [dict(temperature=0.0)]
    kw = dict(speculative=method, num_draft_tokens=2)
    if method == "dspark":
        dcfg = dspark.DSparkConfig.for_target(base.config, markov_rank=8, window=16)
        kw = dict(speculative="dspark", drafter=dspark.init_dspark(base.config, dcfg,
                                                                   jax.random.key(4)))
        runs.append(dict(temperature=1.0, seed=[3, 4, 5], verify_len="random"))
    sharded_params = shardings.shard_params(base, _mesh(dict(dp=2, ep=4)))
    plain = np.asarray(di.generate(base, tokens, lengths=lengths, max_new_tokens=10).tokens)
    with no_cache_writes():
        _compare_speculative(base, sharded_params, tokens, lengths, kw, runs, plain, method)


def _compare_speculative(base, sharded_params, tokens, lengths, kw, runs, plain, method):
    for run in runs:
        one = di.generate(base, tokens, lengths=lengths, max_new_tokens=10, **kw, **run)
        mesh = di.generate(sharded_params, tokens, lengths=lengths, max_new_tokens=10, **kw, **run)
        assert mesh.tokens.shape == (3, 10)
        np.testing.assert_array_equal(np.asarray(mesh.tokens), np.asarray(one.tokens))
        np.testing.assert_array_equal(np.asarray(mesh.accepted), np.asarray(one.accepted))
        np.testing.assert_array_equal(np.asarray(mesh.verified), np.asarray(one.verified))
        if method == "dspark":
            np.testing.assert_allclose(np.asarray(mesh.draft_confidence),
                                       np.asarray(one.draft_confidence), atol=1e-4)
        if run["temperature"] == 0.0:
            np.testing.assert_array_equal(np.asarray(mesh.tokens), plain)


@pytest.mark.heavy   # two V4.1 compiles (~2 min on 2 cores)
def test_v41_forward_on_mesh_equals_single_device():
    """V4.1 (lagged mHC, shared latents, Engram) on a dp=2 x ep=4 mesh: logits equal the
    single-device forward; the Engram tables' rows follow the `engram_rows` rule (split over
    every device where the row count divides, as for v4.1-flash, else replicated)."""
    from deepinfer_fn.params import init_params
    from jax.sharding import PartitionSpec as P
    cfg = di.ModelConfig.preset("v4.1-tiny")
    params = init_params(cfg, jax.random.key(0))
    ids = np.random.default_rng(0).integers(3, cfg.image_token_id, (8, 24)).astype(np.int32)
    ref = np.asarray(di.forward(params, ids))
    mesh = _mesh(dict(dp=2, ep=4))
    sharded = shardings.shard_params(params, mesh)
    assert rel_err(np.asarray(di.forward(sharded, ids)), ref) <= 1e-5
    from shardings.mesh import logical_spec
    rows = 384_006_168                 # layer 1's table in v4.1-flash (sum of its 24 primes)
    assert logical_spec(("engram_rows", None), (rows, 256), mesh) == P(("dp", "ep"), None)
    assert logical_spec(("engram_rows", None), (660, 256), mesh) == P(None, None)
