"""Engram tables in host memory inside the V4.1 forward: a checkpoint loaded with
engram_store="host" memory-maps its tables and gives the same logits and greedy tokens as the
same checkpoint with device tables (FP8 bytes in both, so equality is exact); the host
callback runs once per call (a layer given plain ids gathers itself); rows gathered ahead
(`host_row_ids` + submit / take) equal the callback's; device tables row-sharded over a mesh
give the unsharded logits; bad options and out-of-range ids fail clearly."""

import json
import mmap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
import shardings
from deepinfer_fn import api
from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.model import engram_store, transformer_v41
from deepinfer_fn.model.engram_store import (HOST_TABLES, HostEngramStore, HostTables,
                                             host_rows, host_store_of, params_tables,
                                             with_host_tables, with_table_arrays)
from deepinfer_fn.state import init_v41_state

CFG = di.ModelConfig.preset("v4.1-tiny", hc_sinkhorn_iters=4)
T = 12


def tokens(seed, batch=2, length=T):
    return np.random.default_rng(seed).integers(3, CFG.image_token_id, (batch, length))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A v4.1-tiny checkpoint written by the project's own quantizer and saver."""
    path = tmp_path_factory.mktemp("v41_host") / "q"
    di.save_params(di.init_params(CFG, jax.random.key(5), include_mtp=False), path,
                   quantize=True)
    return path


@pytest.fixture(scope="module")
def device_params(ckpt):
    return di.load_params(ckpt, config=CFG)


@pytest.fixture(scope="module")
def host_params(ckpt):
    return di.load_params(ckpt, config=CFG, engram_store="host")


def _base_mmap(a):
    while a is not None and not isinstance(a, mmap.mmap):
        a = getattr(a, "base", None)
    return a


def test_host_load_memory_maps_the_tables(device_params, host_params):
    store = host_store_of(host_params)
    assert isinstance(store, HostEngramStore) and store.gathers == 0
    assert len(jax.tree.leaves(device_params)) - len(jax.tree.leaves(host_params)) == 4
    for l, layer in enumerate(CFG.engram_layer_ids):
        w = host_params["layers"][layer]["engram"]
        assert sorted(w) == sorted(["wkv", "q_weight", "k_weight", HOST_TABLES])
        assert w[HOST_TABLES] == HostTables(store)
        dw = device_params["layers"][layer]["engram"]
        for a, ref in zip(store.tables[l], (dw["table"], dw["table_scale"])):
            assert isinstance(_base_mmap(a), mmap.mmap), type(a)      # a map, not a copy
            np.testing.assert_array_equal(a, np.asarray(ref))
    # tracing (eval_shape) gathers nothing; tree maps keep the handle
    out = jax.eval_shape(lambda p, i: transformer_v41.logits_and_streams(p, i)[0], host_params,
                         jnp.zeros((1, 4), jnp.int32))
    assert out.shape == (1, 4, CFG.vocab_size) and store.gathers == 0
    assert host_store_of(jax.tree.map(lambda x: x, host_params)) is store


def test_forward_with_host_tables_equals_device_tables(device_params, host_params):
    store = host_store_of(host_params)
    ids = tokens(1)
    ids[1, 5] = CFG.image_token_id                      # Engram skips / blocks image tokens
    want = np.asarray(api.forward(device_params, ids))
    before = store.gathers, store.tokens_gathered
    got = np.asarray(api.forward(host_params, ids))
    np.testing.assert_array_equal(got, want)
    # one callback for both Engram layers, every token once
    assert (store.gathers - before[0], store.tokens_gathered - before[1]) == (1, ids.size)


@pytest.mark.heavy
def test_prefetched_rows_equal_the_callback_in_chunks(host_params):
    """Two prompt chunks: the callback path (jit) and rows gathered ahead on the host while
    the previous chunk runs (submit / take, no callback) give identical logits, close to the
    whole forward's."""
    store = host_store_of(host_params)
    ids = tokens(2, batch=2, length=2 * 6)
    S = 6
    step = jax.jit(lambda p, s, i, n: transformer_v41.forward_chunk(
        p, s, i, n, all_logits=True)[:2])
    ahead = jax.jit(lambda p, s, i, n, r: transformer_v41.forward_chunk(
        p, s, i, n, all_logits=True, engram_rows=r)[:2])
    n = jnp.full((2,), S, jnp.int32)
    chunks = [ids[:, :S], ids[:, S:]]
    history = [np.full((2, 3), CFG.engram_pad_token_id), ids[:, S - 3:S]]

    state, out_cb = init_v41_state(CFG, 2, 2 * S), []
    for c in chunks:
        logits, state = step(host_params, state, jnp.asarray(c, jnp.int32), n)
        out_cb.append(np.asarray(logits))
    g0 = store.gathers

    state, out_pf = init_v41_state(CFG, 2, 2 * S), []
    store.submit(transformer_v41.host_row_ids(CFG, chunks[0], history[0]))
    for k, c in enumerate(chunks):
        rows = store.take()
        if k + 1 < len(chunks):                         # the next chunk's gather overlaps
            store.submit(transformer_v41.host_row_ids(CFG, chunks[k + 1], history[k + 1]))
        logits, state = ahead(host_params, state, jnp.asarray(c, jnp.int32), n, rows)
        out_pf.append(np.asarray(logits))
    assert store.gathers - g0 == len(chunks)             # the submits only: no callback ran
    np.testing.assert_array_equal(np.concatenate(out_pf, 1), np.concatenate(out_cb, 1))
    whole = np.asarray(api.forward(host_params, ids))
    np.testing.assert_allclose(np.concatenate(out_cb, 1), whole, rtol=1e-4,
                               atol=1e-4 * np.abs(whole).max())
    # the host ids are the device hash of the same tokens
    dev = transformer_v41.engram_row_ids(CFG, jnp.asarray(chunks[0], jnp.int32))
    np.testing.assert_array_equal(transformer_v41.host_row_ids(CFG, chunks[0], history[0]),
                                  np.asarray(dev))


@pytest.mark.heavy
def test_greedy_generate_with_host_tables_equals_device(device_params, host_params):
    """generate's prefill chunks and its device-side decode loop (a callback per step)."""
    store = host_store_of(host_params)
    ids = tokens(3, batch=1, length=7)
    want = np.asarray(di.generate(device_params, ids, max_new_tokens=5, prefill_chunk=4).tokens)
    g0 = store.gathers
    got = np.asarray(di.generate(host_params, ids, max_new_tokens=5, prefill_chunk=4).tokens)
    np.testing.assert_array_equal(got, want)
    assert store.gathers - g0 >= 2 + 4                  # 2 prefill chunks + the decode steps


@pytest.mark.heavy
def test_row_sharded_device_tables_in_the_forward(device_params, host_params):
    """The `engram_rows` rule shards the tables by rows over dp x ep (4 devices here: both
    tables' row counts divide); the forward equals the single-device one. Host tables with
    the rest of the params on the mesh: one callback for the whole (batch-sharded) step."""
    mesh = shardings.make_mesh(dp=2, ep=2, devices=jax.devices()[:4])
    sharded = shardings.shard_params(device_params, mesh)
    for layer in CFG.engram_layer_ids:
        t = sharded["layers"][layer]["engram"]["table"]
        assert t.sharding.spec[0] == ("dp", "ep"), t.sharding.spec
        assert t.addressable_shards[0].data.shape[-2] == t.shape[-2] // 4
    ids = tokens(4, batch=4)
    want = np.asarray(api.forward(device_params, ids))
    got = np.asarray(api.forward(sharded, ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    store = host_store_of(host_params)
    on_mesh = shardings.shard_params(host_params, mesh)
    assert host_store_of(on_mesh) is store
    g0 = store.gathers
    got = np.asarray(api.forward(on_mesh, ids))
    assert store.gathers == g0 + 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_save_params_writes_host_tables_back(host_params, device_params, tmp_path):
    di.save_params(host_params, tmp_path / "again", quantize=True)
    back = di.load_params(tmp_path / "again", config=CFG)
    for (c, s), (c0, s0) in zip(params_tables(back), params_tables(device_params)):
        np.testing.assert_array_equal(c, c0)
        np.testing.assert_array_equal(s, s0)
    arrays = with_table_arrays(host_params)
    assert jax.tree.structure(arrays) == jax.tree.structure(device_params)


def test_bad_options_and_ids(ckpt, host_params, device_params, tmp_path):
    with pytest.raises(ArgumentError, match="engram_store must be one of"):
        di.load_params(ckpt, config=CFG, engram_store="gpu")
    with pytest.raises(ArgumentError, match="engram_store must be one of"):
        di.load_model(ckpt, engram_store="disk", drafter=False)
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps(di.ModelConfig.preset("tiny").to_hf()))
    with pytest.raises(ArgumentError, match="needs a V4.1 model with Engram"):
        di.load_params(v4, engram_store="host")
    store = host_store_of(host_params)
    bad = np.zeros((1, 2, 2, 6), np.int32)
    bad[0, 1, 1, 3] = CFG.engram_num_embeddings[1]
    with pytest.raises(Exception, match="out of range for layer 2"):
        jax.block_until_ready(jax.jit(lambda i: host_rows(store, i))(jnp.asarray(bad)))
    with pytest.raises(ValueError, match="do not match the model config"):
        with_host_tables(device_params, HostEngramStore(store.tables[::-1], CFG.engram_layer_ids))
    with pytest.raises(ValueError, match="engram_rows must be"):
        transformer_v41.forward_chunk(host_params, init_v41_state(CFG, 1, 8),
                                      jnp.zeros((1, 4), jnp.int32), jnp.full((1,), 4),
                                      engram_rows=store.gather(np.zeros((1, 3, 2, 6), int)))
    w = host_params["layers"][1]["engram"]
    with pytest.raises(ValueError, match="in a host store"):
        transformer_v41.engram_update(w, jnp.zeros((1, 2, CFG.hc_mult, CFG.hidden_size)),
                                      jnp.zeros((1, 2, 6), jnp.int32),
                                      jnp.zeros((1, 2), jnp.int32), CFG)
    with pytest.raises(TypeError, match="HostEngramStore"):
        HostTables(engram_store.DeviceEngramStore(store.tables, store.layer_ids))


def test_layer_given_plain_ids_gathers_itself(device_params, host_params):
    """A caller that passes hash ids (not `engram_inputs`) to a layer with host tables still
    gets the device-table result: the layer gathers through its own callback."""
    store = host_store_of(host_params)
    ids = jnp.asarray(tokens(6, batch=1, length=4), jnp.int32)
    row_ids = transformer_v41.engram_row_ids(CFG, ids)
    streams = jnp.asarray(np.random.default_rng(6).normal(
        0, 1, (1, 4, CFG.hc_mult, CFG.hidden_size)), jnp.float32)
    for layer in CFG.engram_layer_ids:
        kind = CFG.layer_kinds()[layer][0]
        g0 = store.gathers
        got = transformer_v41.maybe_engram(host_params["layers"][layer], streams, layer, kind,
                                           ids, row_ids, CFG)
        want = transformer_v41.maybe_engram(device_params["layers"][layer], streams, layer,
                                            kind, ids, row_ids, CFG)
        assert store.gathers == g0 + 1
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.abs(np.asarray(got) - np.asarray(streams)).max() > 1e-3
