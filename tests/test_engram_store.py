"""Engram table stores: host (memory-mapped checkpoint / in-memory) and device (optionally
row-sharded) gathers equal numpy fancy indexing; the prefetch queue returns gathers in order;
bad ids fail with a clear error; the rows feed `engram.dequantize_rows` / `engram.lookup`."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_fn.checkpoint.safetensors_io import CheckpointError, save_file
from deepinfer_fn.model import engram
from deepinfer_fn.model.engram_store import (DeviceEngramStore, HostEngramStore, advise,
                                             checkpoint_tables, layer_embedding,
                                             open_engram_store, take_rows)

LAYERS = (1, 14)
ROWS = (1001, 777)          # not multiples of 8: the sharded store pads
W, C = 256, 24


def _tables(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for r in ROWS:
        codes = rng.integers(0, 256, (r, W), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C          # no E4M3 NaN patterns
        scales = rng.integers(110, 140, (r, W // 32), dtype=np.uint8)
        out.append((codes, scales))
    return out


def _ids(shape, seed=1):
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, r, shape + (C,)) for r in ROWS], axis=-2).astype(np.int32)


def _reference(tables, ids):
    """numpy fancy indexing, layer by layer."""
    codes = np.stack([t[0][ids[..., l, :]] for l, t in enumerate(tables)], axis=-3)
    scales = np.stack([t[1][ids[..., l, :]] for l, t in enumerate(tables)], axis=-3)
    return codes, scales


@pytest.fixture(scope="module")
def tables():
    return _tables()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tables):
    """Two shards + index, as the official layout: the tables in their own shard, one layer
    under the transformers naming (model. prefix)."""
    d = tmp_path_factory.mktemp("engram_ckpt")
    (c1, s1), (c14, s14) = tables
    f8, e8 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
    save_file({"layers.1.attn_norm.weight": np.ones(8, np.float32),
               "layers.1.engram.embed.weight": c1.view(f8),
               "layers.1.engram.embed.scale": s1.view(e8)}, d / "model-00001-of-00002.safetensors")
    save_file({"model.layers.14.engram.embed.weight": c14.view(f8),
               "model.layers.14.engram.embed.scale": s14.view(e8)},
              d / "model-00002-of-00002.safetensors")
    weight_map = {"layers.1.attn_norm.weight": "model-00001-of-00002.safetensors",
                  "layers.1.engram.embed.weight": "model-00001-of-00002.safetensors",
                  "layers.1.engram.embed.scale": "model-00001-of-00002.safetensors",
                  "model.layers.14.engram.embed.weight": "model-00002-of-00002.safetensors",
                  "model.layers.14.engram.embed.scale": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def _np(pair):
    return tuple(np.asarray(a) for a in pair)


def test_host_memmap_gather_equals_numpy_indexing(ckpt, tables):
    mapped, layer_ids = checkpoint_tables(ckpt)
    assert layer_ids == LAYERS
    assert all(isinstance(a, np.memmap) and a.dtype == np.uint8 for pair in mapped for a in pair)
    ids = _ids((3, 5))
    ref = _reference(tables, ids)
    with open_engram_store(ckpt, store="host") as store:
        assert isinstance(store, HostEngramStore) and store.rows == ROWS
        assert store.row_bytes == 264 and store.layer_ids == LAYERS
        codes, scales = store.gather(ids)
        assert codes.shape == (3, 5, 2, C, W) and scales.shape == (3, 5, 2, C, 8)
        assert codes.dtype == scales.dtype == np.uint8
        np.testing.assert_array_equal(codes, ref[0])
        np.testing.assert_array_equal(scales, ref[1])
    with open_engram_store(ckpt, store="host", layer_ids=[14]) as one:
        np.testing.assert_array_equal(one.gather(ids[..., 1:, :])[0], ref[0][..., 1:, :, :])
    # parallel reads (uneven chunks: 3 * 5 * 24 flat rows over 7 threads), other advice
    for advice in ("normal", "willneed", None):
        with open_engram_store(ckpt, store="host", read_threads=7, advice=advice) as par:
            codes, scales = par.gather(ids)
            np.testing.assert_array_equal(codes, ref[0])
            np.testing.assert_array_equal(scales, ref[1])
    assert advise(mapped, "random") == 2 and advise(tables, "random") == 0  # two shard maps
    with pytest.raises(ValueError, match="advice must be one of"):
        advise(mapped, "sequential-ish")
    with pytest.raises(ValueError, match="read_threads must be a positive int"):
        open_engram_store(ckpt, store="host", read_threads=0)


def test_in_memory_host_and_device_gathers_agree(ckpt, tables):
    ids = _ids((2, 7), seed=3)
    ref = _reference(tables, ids)
    host = open_engram_store(tables, store="host", layer_ids=LAYERS)
    dev = open_engram_store(ckpt, store="device")          # memory maps copied to the device
    assert isinstance(dev, DeviceEngramStore)
    for got in (host.gather(ids), dev.gather(ids), dev.gather(jnp.asarray(ids))):
        np.testing.assert_array_equal(_np(got)[0], ref[0])
        np.testing.assert_array_equal(_np(got)[1], ref[1])
    host.close()


@pytest.mark.parametrize("kind", ["host", "device"])
def test_prefetch_returns_direct_gathers_in_order(ckpt, kind):
    steps = [_ids((4, 1), seed=10 + t) for t in range(5)]
    with open_engram_store(ckpt, store=kind, workers=2) if kind == "host" else \
            open_engram_store(ckpt, store=kind) as store:
        direct = [_np(store.gather(ids)) for ids in steps]
        store.submit(steps[0])
        for t in range(len(steps)):
            if t + 1 < len(steps):
                store.submit(steps[t + 1])             # next step's ids while this one runs
            assert store.pending == (2 if t + 1 < len(steps) else 1)
            codes, scales = store.take()
            assert isinstance(codes, jax.Array) and isinstance(scales, jax.Array)
            np.testing.assert_array_equal(np.asarray(codes), direct[t][0])
            np.testing.assert_array_equal(np.asarray(scales), direct[t][1])
        assert store.pending == 0
        with pytest.raises(RuntimeError, match="nothing submitted"):
            store.take()


@pytest.mark.parametrize("kind", ["host", "device"])
def test_bad_ids_raise(tables, kind):
    store = open_engram_store(tables, store=kind, layer_ids=LAYERS)
    ids = _ids((2, 3))
    bad = ids.copy()
    bad[1, 2, 1, 5] = ROWS[1]
    with pytest.raises(ValueError, match=r"hash id 777 out of range for layer 14 .*0\.\.776.*"
                                         r"position \(1, 2\), column 5"):
        store.gather(bad)
    bad = ids.copy()
    bad[0, 0, 0, 0] = -1
    with pytest.raises(ValueError, match="hash id -1 out of range for layer 1 "):
        store.gather(bad)
    with pytest.raises(ValueError, match=r"shape \[\.\.\., 2 layers, columns\]"):
        store.gather(ids[..., :1, :])
    with pytest.raises(TypeError, match="integers"):
        store.gather(ids.astype(np.float32))
    with pytest.raises(ValueError, match="out of range"):
        store.submit(bad)
    if kind == "host":   # device-array ids are checked on the gather thread: the error is at take
        store.submit(jnp.asarray(bad))
        with pytest.raises(ValueError, match="out of range"):
            store.take()
    store.close()


def test_take_rows_in_jit_fills_out_of_range_with_255(tables):
    dev = [(jnp.asarray(c), jnp.asarray(s)) for c, s in tables]
    ids = _ids((1, 2))
    ids[0, 1, 0, 3], ids[0, 0, 1, 0] = ROWS[0], -5
    codes, scales = jax.jit(take_rows)(dev, jnp.asarray(ids))
    codes, scales = np.asarray(codes), np.asarray(scales)
    assert (codes[0, 1, 0, 3] == 255).all() and (scales[0, 0, 1, 0] == 255).all()
    good = _reference(tables, _ids((1, 2)))          # the other ids are gathered as usual
    np.testing.assert_array_equal(codes[0, 0, 0], good[0][0, 0, 0])
    np.testing.assert_array_equal(codes[0, 1, 0, 4:], good[0][0, 1, 0, 4:])
    assert np.isnan(np.asarray(layer_embedding(codes, scales, 1))[0, 0, :W]).all()


def test_rows_feed_engram_dequantization_unchanged(tables):
    ids = _ids((2, 3), seed=5)
    store = open_engram_store(tables, store="host", layer_ids=LAYERS)
    codes, scales = store.gather(ids)
    for l, (c, s) in enumerate(tables):
        want = engram.lookup(jnp.asarray(c), jnp.asarray(s), jnp.asarray(ids[..., l, :]))
        got = layer_embedding(jax.device_put(codes), jax.device_put(scales), l)
        assert got.shape == (2, 3, C * W)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # and against an independent numpy dequantisation of one row
        row = c[ids[1, 2, l, 7]].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        row = row * np.repeat(2.0 ** (s[ids[1, 2, l, 7]].astype(np.float32) - 127), 32)
        np.testing.assert_array_equal(np.asarray(got)[1, 2, 7 * W:8 * W], row)
    store.close()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_sharded_device_store_equals_unsharded(tables):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "rows"))
    sharded = open_engram_store(tables, store="device", layer_ids=LAYERS, mesh=mesh, axis="rows")
    plain = open_engram_store(tables, store="device", layer_ids=LAYERS)
    codes0 = sharded.tables[0][0]
    assert codes0.shape == (1004, W)                        # 1001 padded to a multiple of 4
    assert codes0.sharding.spec == jax.sharding.PartitionSpec("rows", None)
    assert {s.data.shape for s in codes0.addressable_shards} == {(251, W)}
    ids = _ids((3, 4), seed=7)
    ids[0, 0, 0, :] = ROWS[0] - 1                           # the last real row (in the pad shard)
    ref = _reference(tables, ids)
    for got in (sharded.gather(ids), plain.gather(ids)):
        np.testing.assert_array_equal(_np(got)[0], ref[0])
        np.testing.assert_array_equal(_np(got)[1], ref[1])
    with pytest.raises(ValueError, match="out of range"):   # the padding rows are not ids
        bad = ids.copy()
        bad[0, 0, 0, 0] = ROWS[0] + 1
        sharded.gather(bad)


def test_load_time_option_and_table_errors(ckpt, tables, tmp_path):
    with pytest.raises(ValueError, match=r"store must be one of \('host', 'device'\)"):
        open_engram_store(ckpt, store="disk")
    with pytest.raises(ValueError, match=r"layer_ids \(or config\) is required"):
        open_engram_store(tables)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",))
    with pytest.raises(ValueError, match="shard a 'device' store"):
        open_engram_store(ckpt, store="host", mesh=mesh, axis="rows")
    with pytest.raises(ValueError, match="both mesh and axis"):
        open_engram_store(ckpt, store="device", mesh=mesh)
    with pytest.raises(ValueError, match="not one of the mesh's axes"):
        open_engram_store(ckpt, store="device", mesh=mesh, axis="tp")
    with pytest.raises(CheckpointError, match=r"missing Engram tensor 'layers.2.engram"):
        checkpoint_tables(ckpt, [1, 2])
    with pytest.raises(ValueError, match=r"scales have shape \(1001, 4\)"):
        HostEngramStore([(tables[0][0], tables[0][1][:, :4]), tables[1]], LAYERS)
    with pytest.raises(ValueError, match="one byte per value"):
        HostEngramStore([(tables[0][0].astype(np.float32), tables[0][1]), tables[1]], LAYERS)
    with pytest.raises(ValueError, match="one .codes, scales. pair per layer"):
        HostEngramStore(tables, (1,))
    save_file({"layers.1.engram.embed.weight": np.zeros((4, W), np.float32),
               "layers.1.engram.embed.scale": np.zeros((4, 8), np.uint8)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="is F32, expected one of"):
        checkpoint_tables(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoint_tables(tmp_path / "nope")


def test_store_reads_a_saved_v41_checkpoint(tmp_path):
    """The tables `save_params` writes for v4.1-tiny, gathered at real hash ids, equal the
    params' own tables; `engram.lookup` on the params gives the same embedding."""
    import deepinfer_fn as di
    cfg = di.ModelConfig.preset("v4.1-tiny")
    params = di.init_params(cfg, jax.random.key(3), include_mtp=False)
    di.save_params(params, tmp_path / "ckpt", quantize=True)
    consts = engram.HashConstants.from_config(cfg)
    assert cfg.engram_compressed_vocab_size == cfg.vocab_size       # identity token map
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    ids = engram.hash_ids_host(tokens, np.full((2, consts.history), consts.pad_id),
                               np.arange(cfg.vocab_size), consts)   # [2, 9, L, C]
    for kind in ("host", "device"):
        with open_engram_store(tmp_path / "ckpt", store=kind, config=cfg) as store:
            assert store.layer_ids == cfg.engram_layer_ids
            codes, scales = _np(store.gather(ids))
            for l, layer in enumerate(cfg.engram_layer_ids):
                w = params["layers"][layer]["engram"]
                table, scale = np.asarray(w["table"]), np.asarray(w["table_scale"])
                np.testing.assert_array_equal(codes[..., l, :, :], table[ids[..., l, :]])
                np.testing.assert_array_equal(scales[..., l, :, :], scale[ids[..., l, :]])
                np.testing.assert_array_equal(
                    np.asarray(layer_embedding(codes, scales, l)),
                    np.asarray(engram.lookup(w["table"], w["table_scale"], ids[..., l, :])))
    with pytest.raises(ValueError, match=r"do not match the model config's \(\(1, 4\)"):
        open_engram_store(tmp_path / "ckpt", store="device", layer_ids=(1, 2),
                          config=di.ModelConfig.preset("v4.1-mini"))
