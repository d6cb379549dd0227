"""HF-format checkpoints <-> params, driven by the weight specs (docs/MODEL.md §5).

`load_params(path, dtype)` reads official or transformers-saved safetensors (single file or
sharded with `model.safetensors.index.json`), dequantizes FP8 block-scaled and packed FP4
weights (UE8M0 scales), transposes to the internal [in, out] layout, and checks every
tensor's name, shape and dtype. `save_params` writes the official layout, optionally
quantized with our own FP8/FP4 quantizer.

DeepSeek-V4.1 (docs/MODEL.md §V6): 32x32 FP8 blocks (`weight_block_size`), Engram tables kept
as their FP8 bytes + UE8M0 scales (never dequantized here), DSpark stages under `mtp.0..2`;
`save_params` writes the 48-shard layout of `layout.inventory`; vision tensors present in a
checkpoint are checked against `layout.vision_tensors` and not loaded.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer_fn.checkpoint import quant
from deepinfer_fn.checkpoint.layout import (checkpoint_shape, fp4_scale_shape, fp8_scale_shape,
                                            index_json, inventory, shard_file, tensor_names,
                                            vision_tensors)
from deepinfer_fn.checkpoint.names import is_vision_name, normalize_name, scale_name
from deepinfer_fn.checkpoint.safetensors_io import (NAMES, CheckpointError, SafetensorsFile,
                                                    save_file)
from deepinfer_fn.config import ConfigError, ModelConfig
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.validate import boolean, describe, float_dtype
from deepinfer_fn.params import (BF16, E8M0, FP4, FP8, FP8_CODES, Params, Spec, ckpt_prefixes,
                                 is_spec, leaf_dtype, param_specs, per_layer)

_FLOAT_STORAGE = {"F32", "BF16", "F16", "F64"}
ENGRAM_STORES = ("device", "host")      # load_params(engram_store=...)


# ------------------------------------------------------------------------------- layouts
def to_internal(spec: Spec, arrays: list[np.ndarray]) -> np.ndarray:
    if spec.layout == "linear":
        return arrays[0].T
    if spec.layout == "experts":
        return np.stack([a.T for a in arrays])
    if spec.layout == "grouped":
        g, i, r = spec.shape
        return arrays[0].reshape(g, r, i).transpose(0, 2, 1)
    return arrays[0]


def to_checkpoint(spec: Spec, value: np.ndarray) -> list[np.ndarray]:
    if spec.layout == "linear":
        return [value.T]
    if spec.layout == "experts":
        return [w.T for w in value]
    if spec.layout == "grouped":
        g, i, r = spec.shape
        return [value.transpose(0, 2, 1).reshape(g * r, i)]
    return [value]


# ------------------------------------------------------------------------------- reading
class _Checkpoint:
    """All tensors of a checkpoint directory by official name, with the file each is in."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: corrupt index ({e})") from e
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
            if missing:
                names = [n for n, f in weight_map.items() if f == missing[0]][:3]
                raise CheckpointError(f"missing checkpoint shard {os.path.join(path, missing[0])} "
                                      f"(listed in the index for tensors such as {names}); "
                                      f"{len(missing)} shard(s) missing in all")
        else:
            # Without an index: model.safetensors, else every model*.safetensors (other
            # .safetensors files in the folder, e.g. reference outputs, are not weights).
            files = sorted(f for f in os.listdir(path)
                           if f.startswith("model") and f.endswith(".safetensors"))
            weight_map = None
            if not files:
                raise CheckpointError(f"no model*.safetensors files in {path}")
        self.files = {f: SafetensorsFile(os.path.join(path, f)) for f in files}
        self.where: dict[str, tuple[str, str]] = {}
        for fname, st in self.files.items():
            for raw in st.keys():
                name = normalize_name(raw)
                if name in self.where:
                    raise CheckpointError(f"tensor {name!r} appears twice: {raw!r} in {fname} and "
                                          f"{self.where[name][1]!r} in {self.where[name][0]}")
                if weight_map is not None and weight_map.get(raw) != fname:
                    raise CheckpointError(f"tensor {raw!r} is in {fname} but the index says "
                                          f"{weight_map.get(raw)}")
                self.where[name] = (fname, raw)
        if weight_map is not None:
            absent = [n for n, f in weight_map.items()
                      if normalize_name(n) not in self.where]
            if absent:
                raise CheckpointError(f"tensor {absent[0]!r} is listed in the index for "
                                      f"{os.path.join(path, weight_map[absent[0]])} but that "
                                      f"file does not contain it")
        self.used: set[str] = set()
        self.expected_file: dict[str, str] = {}  # V4.1: where the official layout puts a name

    def has(self, name: str) -> bool:
        return name in self.where

    def describe(self, name: str) -> str:
        fname, raw = self.where[name]
        return f"{raw!r} in {os.path.join(self.path, fname)}"

    def get(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.where:
            hint = (f" (the official layout puts it in "
                    f"{os.path.join(self.path, self.expected_file[name])})"
                    if name in self.expected_file else "")
            raise CheckpointError(f"missing tensor {name!r} in checkpoint {self.path}{hint}")
        self.used.add(name)
        fname, raw = self.where[name]
        st = self.files[fname]
        return st.get(raw), st.dtype_name(raw)


def _read_weight(ck: _Checkpoint, name: str, spec: Spec, cfg: ModelConfig) -> np.ndarray:
    """One checkpoint tensor as float32 (int32 for index tables, uint8 for V4.1 Engram table
    bytes and their scales), dequantized and checked."""
    if spec.fmt in (FP8_CODES, E8M0):
        return _read_bytes(ck, name, spec)
    want = checkpoint_shape(spec)
    arr, kind = ck.get(name)
    if spec.layout == "index":
        if kind not in ("I64", "I32"):
            raise CheckpointError(f"dtype mismatch: {ck.describe(name)} is {kind}, expected I64")
        out = np.asarray(arr).astype(np.int32)
        if out.min() < 0 or out.max() >= cfg.n_routed_experts:
            raise CheckpointError(f"{ck.describe(name)} has expert ids outside "
                                  f"[0, {cfg.n_routed_experts})")
    elif kind == "F8_E4M3":
        if spec.fmt != FP8:
            raise CheckpointError(f"dtype mismatch: {ck.describe(name)} is F8_E4M3 but this "
                                  f"weight is stored as {spec.fmt}")
        _check_shape(ck, name, arr.shape, want)
        scale = _read_scale(ck, name, "FP8", want, fp8_scale_shape(want, cfg.fp8_block),
                            f"blocks {cfg.fp8_block[0]}x{cfg.fp8_block[1]}")
        try:
            out = quant.dequantize_fp8_block(np.asarray(arr), scale, cfg.fp8_block)
        except ValueError as e:
            raise CheckpointError(f"{ck.describe(name)}: {e}") from e
    elif kind in ("I8", "U8"):
        if spec.fmt != FP4:
            raise CheckpointError(f"dtype mismatch: {ck.describe(name)} is {kind} (packed FP4) "
                                  f"but this weight is stored as {spec.fmt}")
        _check_shape(ck, name, arr.shape, (want[0], want[1] // 2))
        scale = _read_scale(ck, name, "packed FP4", want, fp4_scale_shape(want, cfg.fp4_group),
                            f"groups of {cfg.fp4_group}")
        try:
            out = quant.dequantize_fp4(np.asarray(arr), scale, cfg.fp4_group)
        except ValueError as e:
            raise CheckpointError(f"{ck.describe(name)}: {e}") from e
    elif kind in _FLOAT_STORAGE:
        _check_shape(ck, name, arr.shape, want)
        out = np.asarray(arr, dtype=np.float32)
    else:
        raise CheckpointError(f"dtype mismatch: {ck.describe(name)} is {kind}; expected a float "
                              f"type for this weight (format {spec.fmt})")
    if out.dtype != np.int32 and not np.all(np.isfinite(out)):
        raise CheckpointError(f"{ck.describe(name)} contains NaN or infinite values")
    return out


def _read_scale(ck: _Checkpoint, name: str, what: str, shape, want, blocks: str) -> np.ndarray:
    """The `.scale` companion of quantized weight `name` (logical [o, i] `shape`), checked
    against its weight: present, UE8M0 (or F32 multipliers), shape `want`."""
    sname = scale_name(name)
    if not ck.has(sname):
        raise CheckpointError(f"{ck.describe(name)} is {what} but has no scale tensor {sname!r}")
    scale, kind = ck.get(sname)
    if kind not in ("F8_E8M0", "F32"):
        raise CheckpointError(f"dtype mismatch: scale {ck.describe(sname)} is {kind}, expected "
                              f"F8_E8M0 (UE8M0)")
    if tuple(scale.shape) != tuple(want):
        raise CheckpointError(
            f"scale {ck.describe(sname)} has shape {list(scale.shape)}, inconsistent with its "
            f"weight {ck.describe(name)} (logical {list(shape)}, {what} scales over {blocks}): "
            f"expected {list(want)}")
    return np.asarray(scale)


_BYTE_KIND = {FP8_CODES: "F8_E4M3", E8M0: "F8_E8M0"}


def _read_bytes(ck: _Checkpoint, name: str, spec: Spec, index=()) -> np.ndarray:
    """A V4.1 Engram table (F8_E4M3 [rows, W]) or its scales (F8_E8M0 [rows, W/32]) as raw
    uint8 bytes, never dequantized; `index` selects rows without reading the rest."""
    arr, kind = ck.get(name)
    if kind != _BYTE_KIND[spec.fmt]:
        raise CheckpointError(f"dtype mismatch: {ck.describe(name)} is {kind}, expected "
                              f"{_BYTE_KIND[spec.fmt]}")
    if spec.fmt == E8M0 and tuple(arr.shape) != spec.shape:
        weight = name.removesuffix(".scale") + ".weight"
        rows, width = ck.get(weight)[0].shape if ck.has(weight) else ("?", "?")
        raise CheckpointError(
            f"scale {ck.describe(name)} has shape {list(arr.shape)}, inconsistent with its table "
            f"{weight!r} [{rows}, {width}] (one UE8M0 scale per 32 values): expected "
            f"{list(spec.shape)}")
    _check_shape(ck, name, arr.shape, spec.shape)
    out = np.array(arr[tuple(index)]).view(np.uint8)
    if spec.fmt == E8M0 and np.any(out == 255):
        raise CheckpointError(f"{ck.describe(name)} contains NaN scales (byte 0xFF)")
    return out


def _check_shape(ck, name, got, want):
    if tuple(got) != tuple(want):
        raise CheckpointError(f"shape mismatch: {ck.describe(name)} has shape {list(got)}, "
                              f"expected {list(want)}")


def _read_value(ck, spec: Spec, prefix, cfg) -> np.ndarray:
    """A whole weight in the internal layout; stacked weights (scanned layer groups) are
    their layers' checkpoint tensors stacked."""
    values = [to_internal(s, [_read_weight(ck, n, s, cfg) for n in tensor_names(s, p)])
              for s, p in per_layer(spec, prefix)]
    return np.stack(values) if spec.stacked else values[0]


def _read_stacked_shard(ck, spec: Spec, prefix, cfg, out_dtype, index) -> np.ndarray:
    """`_read_shard` of a stacked weight: each selected layer's own slice, stacked."""
    layers = per_layer(spec, prefix)[index[0]]
    return np.stack([_read_shard(ck, tensor_names(s, p), s, cfg, out_dtype, tuple(index[1:]))
                     for s, p in layers])


def _read_shard(ck, names, spec: Spec, cfg, out_dtype, index) -> np.ndarray:
    """The part `index` (a tuple of slices of the internal array) of one weight. Routed
    experts read only the experts of the shard; other weights are read whole (they are
    replicated or tp-split) and sliced."""
    if spec.fmt in (FP8_CODES, E8M0):
        return _read_bytes(ck, names[0], spec, index)
    if spec.layout == "experts":
        experts = range(spec.shape[0])[index[0]]
        value = to_internal(spec, [_read_weight(ck, names[e], spec, cfg) for e in experts])
        value = value[(slice(None),) + tuple(index[1:])]
    else:
        value = to_internal(spec, [_read_weight(ck, n, spec, cfg) for n in names])[tuple(index)]
    return np.asarray(value).astype(jnp.dtype(out_dtype))


def load_params(path: str | os.PathLike | None = None, *, dtype=jnp.float32,
                config: ModelConfig | None = None, include_mtp: bool | None = None,
                progress: bool = False, mesh=None, engram_store: str = "device") -> Params:
    """Params from an HF-format directory (official or transformers-saved names).

    dtype: the activation/weight dtype; mHC params, sinks, ape, norms and router bias stay
    float32 (§2.12). include_mtp: None loads the MTP block iff the checkpoint has it.
    mesh: place every tensor straight onto its sharding (`shardings.RULES`) with
    `make_array_from_callback`; each device reads only its slice (routed experts: only its
    experts), one weight at a time, so the model is never whole in host or device memory.
    Every missing, unknown, mis-shaped or mis-typed tensor, and every scale inconsistent with
    its weight, raises `CheckpointError` naming the tensor and its file (a missing V4.1 tensor:
    the shard the official layout puts it in). V4.1 Engram tables load as uint8 bytes.

    engram_store (V4.1): where the Engram tables live. "device" (default): arrays like every
    other weight (sharded by rows over the mesh's batch axes with `mesh=`); fine while they
    fit (v4.1-mini: ~6.3 GB). "host": nothing of them is read now; the params hold a static
    `engram_store.HostTables` handle to a `HostEngramStore` over memory maps of the
    checkpoint's bytes, and the forward gathers each call's rows on the host (v4.1-flash:
    ~203 GB of tables, more than one accelerator holds). Host tables skip the NaN-scale scan.
    """
    if path is None:
        path = os.environ.get("DEEPINFER_MODEL_PATH")
        if not path:
            raise CheckpointError("no checkpoint path given and DEEPINFER_MODEL_PATH is unset")
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"load_params: path must be a checkpoint directory (str or "
                                f"os.PathLike), got {describe(path)}")
    path = os.fspath(path)
    float_dtype("load_params", "dtype", dtype)
    if config is not None and not isinstance(config, ModelConfig):
        raise ArgumentTypeError(f"load_params: config must be a ModelConfig or None, got "
                                f"{describe(config)}")
    if include_mtp is not None:
        boolean("load_params", "include_mtp", include_mtp)
    boolean("load_params", "progress", progress)
    if engram_store not in ENGRAM_STORES:
        raise ArgumentError(f"load_params: engram_store must be one of {ENGRAM_STORES}, got "
                            f"{engram_store!r}")
    if os.path.isfile(path):
        hint = (f"; pass its directory {os.path.dirname(os.path.abspath(path))!r} instead"
                if os.path.basename(path) in ("config.json", "model.safetensors.index.json")
                or path.endswith(".safetensors") else "")
        raise CheckpointError(f"load_params: {path} is a file, but a checkpoint directory "
                              f"(config.json + model*.safetensors) is expected{hint}")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    try:
        cfg = config or ModelConfig.from_hf(path)
    except ConfigError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from e
    host_tables = engram_store == "host"
    if host_tables and not (cfg.is_v41 and cfg.engram_layer_ids):
        raise ArgumentError(f"load_params: engram_store='host' needs a V4.1 model with Engram "
                            f"layers; {path} has none")
    ck = _Checkpoint(path)
    has_mtp = any(n.startswith("mtp.") for n in ck.where)
    if include_mtp is None:
        include_mtp = has_mtp
    if include_mtp and cfg.num_mtp_layers == 0:
        raise CheckpointError(f"{path}: MTP requested but config has num_nextn_predict_layers=0")
    if cfg.is_v41:
        vision = any(is_vision_name(n) for n in ck.where)
        ck.expected_file = index_json(inventory(cfg, include_mtp, vision=vision))["weight_map"]
    specs = param_specs(cfg, include_mtp=include_mtp)
    prefixes = ckpt_prefixes(cfg, specs)
    flat_specs, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    flat_prefix = jax.tree.leaves(prefixes)
    assert jax.tree.structure(prefixes) == jax.tree.structure(specs, is_leaf=is_spec)

    shardings = None
    if mesh is not None:
        from shardings.mesh import logical_spec
        from jax.sharding import NamedSharding
        shardings = [NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh)) for s in flat_specs]
    iterator = enumerate(zip(flat_specs, flat_prefix))
    if progress:
        from tqdm.auto import tqdm
        iterator = tqdm(iterator, total=len(flat_specs), desc=f"loading {os.path.basename(path)}")
    leaves = []
    for i, (spec, prefix) in iterator:
        out_dtype = leaf_dtype(spec, dtype)
        if host_tables and spec.fmt in (FP8_CODES, E8M0):
            for one, where in per_layer(spec, prefix):    # mapped and checked by the store
                for name in tensor_names(one, where):
                    ck.get(name)
            leaves.append(None)
        elif shardings is None:
            value = _read_value(ck, spec, prefix, cfg)
            assert value.shape == spec.shape, (spec.ckpt, value.shape, spec.shape)
            leaves.append(jnp.asarray(value, dtype=out_dtype))
        elif spec.stacked:
            leaves.append(jax.make_array_from_callback(
                spec.shape, shardings[i],
                functools.partial(_read_stacked_shard, ck, spec, prefix, cfg, out_dtype)))
        else:
            leaves.append(jax.make_array_from_callback(
                spec.shape, shardings[i],
                functools.partial(_read_shard, ck, tensor_names(spec, prefix), spec, cfg,
                                  out_dtype)))

    if cfg.is_v41:
        _check_vision(ck, cfg)
    unused = sorted(set(ck.where) - ck.used)
    if not include_mtp:
        unused = [n for n in unused if not n.startswith("mtp.")]
    if unused:
        model = "DeepSeek-V4.1" if cfg.is_v41 else "DeepSeek-V4"
        hint = ("; V4.1 has no hc_head tensors" if cfg.is_v41 and "hc_head" in unused[0] else "")
        raise CheckpointError(f"unknown tensor {ck.describe(unused[0])} (not part of a "
                              f"{cfg.num_hidden_layers}-layer {model} model{hint}); "
                              f"{len(unused)} unknown in all")
    params = Params(jax.tree.unflatten(treedef, leaves), cfg)
    if host_tables:
        from deepinfer_fn.model.engram_store import open_engram_store, with_host_tables
        store = open_engram_store(path, store="host", config=cfg)
        params = with_host_tables(params, store)
    return params


def _check_vision(ck: _Checkpoint, cfg: ModelConfig) -> None:
    """V4.1 vision tower tensors are not loaded (text only), but those present must be the
    config's (`layout.vision_tensors`: name, shape, a float dtype); others stay unknown."""
    expected = {t.name: t for t in vision_tensors(cfg)}
    for name in ck.where:
        if not is_vision_name(name) or name not in expected:
            continue
        fname, raw = ck.where[name]
        st = ck.files[fname]
        kind, shape = st.dtype_name(raw), st.shape(raw)
        if kind not in _FLOAT_STORAGE:
            raise CheckpointError(f"dtype mismatch: {ck.describe(name)} is {kind}, expected "
                                  f"{expected[name].dtype}")
        _check_shape(ck, name, shape, expected[name].shape)
        ck.used.add(name)


# ------------------------------------------------------------------------------- writing
def save_params(params: Params, path: str | os.PathLike, *, quantize: bool = False,
                max_shard_bytes: int = 2 * 1024 ** 3) -> None:
    """Writes an HF-format directory with official names (§5.2, §V6).

    quantize=False stores float32 (or the params' dtype); quantize=True stores the official
    formats: FP8 e4m3 with UE8M0 block scales (`cfg.fp8_block`: V4 128x128, V4.1 32x32) for
    dense matrices, packed FP4 e2m1 with 1x32 UE8M0 scales for routed experts, bf16 / f32 / i64
    for the rest (§5.3). V4.1 Engram tables are written as the F8_E4M3 bytes and F8_E8M0
    scales they are held as. V4 shards by `max_shard_bytes`; V4.1 writes the official shard
    layout (`layout.inventory`, `max_shard_bytes` unused) and no vision tensors (params have
    none).
    """
    from deepinfer_fn.model.engram_store import with_table_arrays
    params = with_table_arrays(params)          # tables in a host store: written from it
    cfg = params.config
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    include_mtp = bool(params["mtp"])
    specs = param_specs(cfg, include_mtp=include_mtp)
    prefixes = ckpt_prefixes(cfg, specs)
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    flat_prefix = jax.tree.leaves(prefixes)
    values = jax.tree.leaves(params.weights)
    if len(values) != len(flat_specs):
        raise ValueError("params do not match their config's description")

    tensors: dict[str, np.ndarray] = {}
    for spec, prefix, value in zip(flat_specs, flat_prefix, values):
        host = np.asarray(jax.device_get(value))
        parts = per_layer(spec, prefix)
        for r, (s, p) in enumerate(parts):
            layer_value = host[r] if spec.stacked else host
            for name, arr in zip(tensor_names(s, p), to_checkpoint(s, layer_value)):
                tensors.update(_encode(name, s, arr, quantize, cfg))

    if cfg.is_v41:
        weight_map = _write_v41_shards(tensors, path, cfg, include_mtp, quantize)
    else:
        weight_map = _write_shards(tensors, path, max_shard_bytes)
    if weight_map is not None:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(weight_map, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_hf_config(params, quantize), f, indent=2)


def _write_shards(tensors: dict[str, np.ndarray], path: str, max_shard_bytes: int):
    """V4: name-ordered shards of at most `max_shard_bytes`; the index (None for one file)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = (shard_file(i + 1, len(shards)) if len(shards) > 1 else "model.safetensors")
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    if len(shards) == 1:
        return None
    return {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map}


def _write_v41_shards(tensors: dict[str, np.ndarray], path: str, cfg: ModelConfig,
                      include_mtp: bool, quantize: bool) -> dict:
    """V4.1: the tensors of `layout.inventory`, each in its shard; returns the index."""
    expected = inventory(cfg, include_mtp=include_mtp, quantized=quantize, vision=False)
    got = {n: (tuple(a.shape), NAMES[np.dtype(a.dtype)]) for n, a in tensors.items()}
    want = {t.name: (t.shape, t.dtype) for t in expected}
    if got != want:
        bad = sorted(set(got.items()) ^ set(want.items()))[:3]
        raise ValueError(f"encoded tensors differ from the V4.1 inventory, e.g. {bad}")
    index = index_json(expected)
    by_file: dict[str, dict[str, np.ndarray]] = {}
    for name, fname in index["weight_map"].items():
        by_file.setdefault(fname, {})[name] = tensors[name]
    for fname, shard in sorted(by_file.items()):
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    return index


def _hf_config(params: Params, quantize: bool) -> dict:
    """config.json: V4 with top-level `expert_dtype`; V4.1 nested, `quantization_config` only
    when quantized (kept otherwise if the block size is not the one read by default)."""
    cfg = params.config
    hf = cfg.to_hf()
    dtype = "bfloat16" if quantize else (
        "float32" if params.dtype == jnp.float32 else str(params.dtype))
    if cfg.is_v41:
        hf["dtype"] = dtype
        if not quantize:
            bare = {k: v for k, v in hf.items() if k != "quantization_config"}
            if ModelConfig.from_hf(bare) == cfg:
                hf = bare
        return hf
    if quantize:
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                                     "weight_block_size": list(cfg.fp8_block)}
        hf["expert_dtype"] = "fp4"
    hf["torch_dtype"] = dtype
    return hf


def _encode(name: str, spec: Spec, arr: np.ndarray, quantize: bool, cfg: ModelConfig):
    if spec.fmt == FP8_CODES:
        return {name: np.asarray(arr, np.uint8).view(ml_dtypes.float8_e4m3fn)}
    if spec.fmt == E8M0:
        return {name: np.asarray(arr, np.uint8).view(ml_dtypes.float8_e8m0fnu)}
    if spec.layout == "index":
        return {name: arr.astype(np.int64)}
    arr = arr.astype(np.float32)
    if not quantize:
        return {name: arr}
    if spec.fmt == FP8:
        q, s = quant.quantize_fp8_block(arr, cfg.fp8_block)
        return {name: q, scale_name(name): s}
    if spec.fmt == FP4:
        q, s = quant.quantize_fp4(arr, cfg.fp4_group)
        return {name: q, scale_name(name): s}
    if spec.fmt == BF16:
        return {name: arr.astype(ml_dtypes.bfloat16)}
    return {name: arr}
