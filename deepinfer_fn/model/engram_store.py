"""Where the Engram tables live: in host memory or on the devices, chosen at load time.

The tables of a full-size V4.1 model (two layers of ~384M rows, 256 FP8 bytes + 8 UE8M0 scale
bytes per row) do not fit one accelerator. An `EngramStore` hides where they are behind one
interface over the hash ids of `engram.hash_ids` (int [..., L, C]: L Engram layers, C columns):

* ``gather(ids) -> (codes uint8 [..., L, C, W], scales uint8 [..., L, C, W/32])`` — the raw
  table rows, ready for `engram.dequantize_rows` unchanged (`layer_embedding` does the
  dequantisation and the column concatenation `engram.gate` takes);
* ``submit(ids)`` / ``take()`` — the same gather queued ahead (first in, first out); ``take``
  returns device arrays, so a step function takes them as inputs.

Kinds (`open_engram_store(source, store=...)`):

* ``"host"`` (`HostEngramStore`): the tables stay numpy arrays — memory maps of the
  checkpoint's safetensors bytes (nothing read until a row is gathered), or in-memory arrays.
  Rows are gathered with numpy on a background thread and ``jax.device_put`` there, so
  submitting step t+1's ids while step t runs hides the gather and the transfer. Hash ids
  depend on the token itself: ids are known ahead for prompt chunks and verify blocks, while
  plain decode learns them only when the previous token is sampled.
* ``"device"`` (`DeviceEngramStore`): the tables are device arrays, optionally sharded by rows
  over one mesh axis (rows padded to a multiple of the axis size); rows are gathered with
  ``jnp.take`` under jit.

Inside jit (`host_rows`): a host store's gather runs through one `jax.pure_callback` (the ids
computed on the device go to the host, the rows come back); `HostTables` is the static handle
params hold in place of the table arrays (`with_host_tables`, `load_params(engram_store=
"host")`), `with_table_arrays` goes back.

Ids are range-checked on the host before a gather (a ValueError names the layer, the column
and the offending id); inside jit `take_rows` cannot raise and gives out-of-range ids rows of
byte 255 (a NaN scale once dequantised).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import mmap
import os
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.checkpoint.names import normalize_name
from deepinfer_fn.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from deepinfer_fn.model.engram import SCALE_BLOCK, dequantize_rows

__all__ = ["EngramStore", "HostEngramStore", "DeviceEngramStore", "open_engram_store",
           "checkpoint_tables", "layer_embedding", "take_rows", "advise", "STORES", "HOST",
           "DEVICE", "ADVICE", "host_rows", "HostTables", "HOST_TABLES", "TABLE_KEYS",
           "host_store_of", "params_tables", "with_host_tables", "with_table_arrays"]

HOST, DEVICE = "host", "device"
STORES = (HOST, DEVICE)
_TABLE, _SCALE = "layers.{}.engram.embed.weight", "layers.{}.engram.embed.scale"
_CODE_DTYPES = ("F8_E4M3", "U8")
_SCALE_DTYPES = ("F8_E8M0", "U8")
ADVICE = {"normal": mmap.MADV_NORMAL, "random": mmap.MADV_RANDOM,
          "willneed": mmap.MADV_WILLNEED}


# --------------------------------------------------------------------------------- tables
def _as_byte_table(a, what: str) -> np.ndarray | jax.Array:
    """A 2-D one-byte array viewed as uint8 (numpy views stay memory maps)."""
    if a.ndim != 2:
        raise ValueError(f"{what} must be 2-D [rows, width], got shape {tuple(a.shape)}")
    if np.dtype(a.dtype).itemsize != 1:
        raise ValueError(f"{what} must hold one byte per value (FP8 / UE8M0 / uint8), got "
                         f"{a.dtype}")
    if isinstance(a, jax.Array):
        return a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8)
    a = np.asarray(a) if not isinstance(a, np.ndarray) else a
    return a.view(np.uint8)


def _check_tables(tables, layer_ids) -> tuple[list, tuple[int, ...]]:
    """[(codes uint8 [R_l, W], scales uint8 [R_l, W/32])] of every layer, checked."""
    layer_ids = tuple(int(i) for i in layer_ids)
    if len(tables) != len(layer_ids) or not tables:
        raise ValueError(f"an Engram store needs one (codes, scales) pair per layer: got "
                         f"{len(tables)} pair(s) for layer_ids {layer_ids}")
    out, width = [], None
    for layer, pair in zip(layer_ids, tables):
        if len(pair) != 2:
            raise ValueError(f"layer {layer}: expected a (codes, scales) pair, got {len(pair)} "
                             f"items")
        codes = _as_byte_table(pair[0], f"layer {layer} Engram table")
        scales = _as_byte_table(pair[1], f"layer {layer} Engram table scales")
        rows, w = codes.shape
        width = w if width is None else width
        if w != width:
            raise ValueError(f"layer {layer}: Engram table width {w} differs from the first "
                             f"layer's {width}")
        if scales.shape != (rows, -(-w // SCALE_BLOCK)):
            raise ValueError(f"layer {layer}: scales have shape {tuple(scales.shape)}, expected "
                             f"{(rows, -(-w // SCALE_BLOCK))} (one per {SCALE_BLOCK} values of "
                             f"a [{rows}, {w}] table)")
        out.append((codes, scales))
    return out, layer_ids


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e})") from e
    else:
        names = sorted(f for f in os.listdir(path)
                       if f.startswith("model") and f.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"no model*.safetensors files in {path}")
    return [os.path.join(path, n) for n in names]


def checkpoint_tables(path: str | os.PathLike, layer_ids: Sequence[int] | None = None
                      ) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[int, ...]]:
    """Memory maps of the Engram tables in a checkpoint directory (nothing is read):
    ([(codes uint8 [R, W], scales uint8 [R, W/32]) per layer], layer ids). layer_ids None:
    every layer that has a table, in increasing order."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"Engram tables: {path!r} is not a checkpoint directory")
    found: dict[str, tuple[SafetensorsFile, str]] = {}
    for fname in _checkpoint_files(path):
        st = SafetensorsFile(fname)
        for raw in st.keys():
            name = normalize_name(raw)
            if ".engram.embed." in name:
                found[name] = (st, raw)
    available = sorted(int(n.split(".")[1]) for n in found if n.endswith(".engram.embed.weight"))
    layer_ids = tuple(available) if layer_ids is None else tuple(int(i) for i in layer_ids)
    if not layer_ids:
        raise CheckpointError(f"{path}: no Engram tables (layers.N.engram.embed.weight)")
    tables = []
    for layer in layer_ids:
        pair = []
        for name, kinds in ((_TABLE.format(layer), _CODE_DTYPES),
                            (_SCALE.format(layer), _SCALE_DTYPES)):
            if name not in found:
                raise CheckpointError(f"{path}: missing Engram tensor {name!r} (tables found for "
                                      f"layers {available})")
            st, raw = found[name]
            if st.dtype_name(raw) not in kinds:
                raise CheckpointError(f"{st.path}: {raw!r} is {st.dtype_name(raw)}, expected one "
                                      f"of {kinds}")
            pair.append(st.get(raw).view(np.uint8))
        tables.append(tuple(pair))
    return tables, layer_ids


def _mapping(a) -> mmap.mmap | None:
    """The memory map under a numpy array (np.memmap views end in one), or None."""
    while a is not None and not isinstance(a, mmap.mmap):
        a = getattr(a, "base", None)
    return a


def advise(tables, advice: str) -> int:
    """madvise every memory map under the tables ("normal", "random": no read-ahead around
    a faulting row, "willneed": start reading the whole file in); returns how many maps."""
    if advice not in ADVICE:
        raise ValueError(f"advice must be one of {tuple(ADVICE)}, got {advice!r}")
    maps = {id(m): m for pair in tables for a in pair if (m := _mapping(a)) is not None}
    for m in maps.values():
        m.madvise(ADVICE[advice])
    return len(maps)


# --------------------------------------------------------------------------------- ids
def _check_ids(ids, rows: Sequence[int], layer_ids: Sequence[int]) -> np.ndarray:
    """ids int [..., L, C] with 0 <= ids[..., l, :] < rows[l], as int64; ValueError otherwise."""
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"Engram hash ids must be integers, got {ids.dtype}")
    L = len(rows)
    if ids.ndim < 2 or ids.shape[-2] != L:
        raise ValueError(f"Engram hash ids must have shape [..., {L} layers, columns], got "
                         f"{ids.shape}")
    for l, r in enumerate(rows):
        col = ids[..., l, :]
        if col.size and (col.min() < 0 or col.max() >= r):
            out = (col < 0) | (col >= r)
            where = tuple(int(i) for i in np.argwhere(out)[0])
            raise ValueError(f"Engram hash id {int(col[where])} out of range for layer "
                             f"{layer_ids[l]} (table rows 0..{r - 1}) at position {where[:-1]}, "
                             f"column {where[-1]}; {int(out.sum())} id(s) out of range in all")
    return ids.astype(np.int64, copy=False)


# --------------------------------------------------------------------------------- stores
class EngramStore:
    """Engram table rows by hash id; see the module docstring. Subclasses implement
    `gather` and `_queued` (what `submit` puts in the queue)."""

    kind: str = ""

    def __init__(self, layer_ids: tuple[int, ...], rows: tuple[int, ...], width: int):
        self.layer_ids, self.rows, self.width = layer_ids, rows, width
        self.scale_width = -(-width // SCALE_BLOCK)
        self._queue: collections.deque = collections.deque()

    def __repr__(self):
        return (f"{type(self).__name__}(layers={self.layer_ids}, rows={self.rows}, "
                f"width={self.width})")

    @property
    def row_bytes(self) -> int:
        """Bytes of one row, scales included (264 for V4.1)."""
        return self.width + self.scale_width

    def check_ids(self, ids) -> np.ndarray:
        """ids as int64 numpy [..., L, C], or ValueError / TypeError naming the problem."""
        return _check_ids(ids, self.rows, self.layer_ids)

    def gather(self, ids):
        raise NotImplementedError

    def _queued(self, ids):
        raise NotImplementedError

    def submit(self, ids) -> None:
        """Queue the gather of `ids` (int [..., L, C]); `take` returns it, in submit order."""
        self._queue.append(self._queued(ids))

    def take(self) -> tuple[jax.Array, jax.Array]:
        """The device (codes, scales) of the oldest `submit` (waits for it if needed)."""
        if not self._queue:
            raise RuntimeError("EngramStore.take(): nothing submitted")
        item = self._queue.popleft()
        return item.result() if isinstance(item, concurrent.futures.Future) else item

    @property
    def pending(self) -> int:
        """Submitted gathers not taken yet."""
        return len(self._queue)

    def close(self) -> None:
        self._queue.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _take_part(table, idx, lo: int, hi: int, out, layer: int) -> None:
    """out[m, layer, c] = table[idx[m * C + c]] for the flat positions lo..hi-1."""
    m, c = np.divmod(np.arange(lo, hi), out.shape[2])
    out[m, layer, c] = np.take(table, idx[lo:hi], axis=0)


class HostEngramStore(EngramStore):
    """Tables as host numpy arrays (memory maps or in memory); gathers on a background thread.

    tables: [(codes [R_l, W], scales [R_l, W/32])] one-byte arrays per layer; device: where
    `take` puts the rows (a jax Device or Sharding; default the first device); workers: gather
    threads (results still come back in submit order); read_threads: threads sharing one
    gather (overlaps the page faults of cold memory maps); advice: `advise` of memory-mapped
    tables (default "random": a cold row reads its own pages only; None leaves them)."""

    kind = HOST

    def __init__(self, tables, layer_ids, *, device=None, workers: int = 1,
                 read_threads: int = 1, advice: str | None = "random"):
        tables, layer_ids = _check_tables(tables, layer_ids)
        if any(isinstance(a, jax.Array) for pair in tables for a in pair):
            tables = [tuple(np.asarray(a) for a in pair) for pair in tables]
        for name, v in (("workers", workers), ("read_threads", read_threads)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        super().__init__(layer_ids, tuple(int(c.shape[0]) for c, _ in tables),
                         int(tables[0][0].shape[1]))
        self.tables = tables
        if advice is not None:
            advise(tables, advice)
        self.device = jax.devices()[0] if device is None else device
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="engram-gather")
        self.read_threads = read_threads
        self._readers = None if read_threads == 1 else concurrent.futures.ThreadPoolExecutor(
            max_workers=read_threads, thread_name_prefix="engram-read")
        self._count_lock = threading.Lock()
        self.gathers = 0            # gather calls (direct, prefetched or from a jit callback)
        self.tokens_gathered = 0    # token positions gathered (ids.size / (L * C))

    def _count(self, ids: np.ndarray) -> None:
        with self._count_lock:
            self.gathers += 1
            self.tokens_gathered += ids.size // (ids.shape[-1] * ids.shape[-2] or 1)

    def gather(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """Host (codes uint8 [..., L, C, W], scales uint8 [..., L, C, W/32]) of ids."""
        ids = self.check_ids(ids)
        self._count(ids)
        codes = np.empty(ids.shape + (self.width,), np.uint8)
        scales = np.empty(ids.shape + (self.scale_width,), np.uint8)
        if self._readers is None:
            for l, (c, s) in enumerate(self.tables):
                idx = ids[..., l, :]
                codes[..., l, :, :] = np.take(c, idx, axis=0)
                scales[..., l, :, :] = np.take(s, idx, axis=0)
            return codes, scales
        # Parallel reads (numpy's take releases the GIL): concurrent page faults on a cold
        # memory map overlap their disk reads. Each task fills one slice of the flat outputs.
        flat = ids.reshape(-1, ids.shape[-2], ids.shape[-1])
        out_c = codes.reshape(flat.shape + (self.width,))
        out_s = scales.reshape(flat.shape + (self.scale_width,))
        n, tasks = flat.shape[0] * flat.shape[2], []
        for l, (c, s) in enumerate(self.tables):
            idx = flat[:, l, :].reshape(-1)
            for lo in range(0, n, -(-n // self.read_threads)):
                hi = min(n, lo + -(-n // self.read_threads))
                for table, out in ((c, out_c), (s, out_s)):
                    tasks.append(self._readers.submit(_take_part, table, idx, lo, hi, out, l))
        for t in tasks:
            t.result()
        return codes, scales

    def _gather_to_device(self, ids):
        codes, scales = self.gather(ids)
        return jax.device_put(codes, self.device), jax.device_put(scales, self.device)

    def _queued(self, ids):
        if isinstance(ids, np.ndarray):
            self.check_ids(ids)   # bad host ids fail at submit; device ids fail at take
        return self._pool.submit(self._gather_to_device, ids)

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True)
        if self._readers is not None:
            self._readers.shutdown(wait=True)


def take_rows(tables, ids: jax.Array, rows: Sequence[int] | None = None):
    """Device gather (jit-friendly): tables [(codes [R_l, W], scales [R_l, W/32])], ids int
    [..., L, C] -> (codes [..., L, C, W], scales [..., L, C, W/32]). Unchecked: an id outside
    [0, rows[l]) (rows default: the tables' lengths; smaller for zero-padded tables) gives
    byte 255 rows (a NaN scale once dequantised)."""
    assert ids.shape[-2] == len(tables), (ids.shape, len(tables))
    rows = [c.shape[0] for c, _ in tables] if rows is None else rows
    codes, scales = [], []
    for l, ((c, s), r) in enumerate(zip(tables, rows)):
        i = ids[..., l, :]
        i = jnp.where((i < 0) | (i >= r), c.shape[0], i)        # past the end: filled
        codes.append(jnp.take(c, i, axis=0, mode="fill"))
        scales.append(jnp.take(s, i, axis=0, mode="fill"))
    return jnp.stack(codes, axis=-3), jnp.stack(scales, axis=-3)


_take_rows = jax.jit(take_rows, static_argnums=2)


class DeviceEngramStore(EngramStore):
    """Tables as device arrays; mesh + axis: rows sharded over that mesh axis (each table
    padded with zero rows to a multiple of the axis size), else on the default device."""

    kind = DEVICE

    def __init__(self, tables, layer_ids, *, mesh=None, axis: str | None = None):
        tables, layer_ids = _check_tables(tables, layer_ids)
        rows = tuple(int(c.shape[0]) for c, _ in tables)
        super().__init__(layer_ids, rows, int(tables[0][0].shape[1]))
        if (mesh is None) != (axis is None):
            raise ValueError("DeviceEngramStore: pass both mesh and axis to shard the tables "
                             "by rows, or neither")
        if mesh is not None and axis not in mesh.axis_names:
            raise ValueError(f"DeviceEngramStore: axis {axis!r} is not one of the mesh's axes "
                             f"{mesh.axis_names}")
        self.mesh, self.axis = mesh, axis
        if mesh is None:
            self.tables = [(jnp.asarray(c), jnp.asarray(s)) for c, s in tables]
            return
        n = mesh.shape[axis]
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis, None))
        placed = []
        for c, s in tables:
            pad = -c.shape[0] % n
            pair = []
            for a in (c, s):
                a = np.asarray(a)
                if pad:
                    a = np.concatenate([a, np.zeros((pad, a.shape[1]), np.uint8)])
                pair.append(jax.device_put(a, sharding))
            placed.append(tuple(pair))
        self.tables = placed

    def gather(self, ids) -> tuple[jax.Array, jax.Array]:
        """Device (codes uint8 [..., L, C, W], scales uint8 [..., L, C, W/32]) of ids."""
        ids = self.check_ids(ids).astype(np.int32)
        return _take_rows(self.tables, jnp.asarray(ids), self.rows)

    def _queued(self, ids):
        return self.gather(ids)     # dispatch is asynchronous already


def _check_config(tables, layer_ids, cfg) -> None:
    """The (checked) tables are the config's: same layers, rows per layer and row width."""
    want = (tuple(cfg.engram_layer_ids), tuple(cfg.engram_num_embeddings), cfg.engram_head_dim)
    got = (tuple(layer_ids), tuple(int(c.shape[0]) for c, _ in tables), int(tables[0][0].shape[1]))
    if got != want:
        raise ValueError(f"Engram tables (layers, rows, width) = {got} do not match the model "
                         f"config's {want}")


def open_engram_store(source, *, store: str = HOST, config=None,
                      layer_ids: Sequence[int] | None = None, mesh=None, axis: str | None = None,
                      device=None, workers: int = 1, read_threads: int = 1,
                      advice: str | None = "random") -> EngramStore:
    """An `EngramStore` of kind `store` ("host" | "device") over `source`: a checkpoint
    directory (memory-mapped tables; layer_ids None: the config's Engram layers, else every
    layer with a table) or a sequence of (codes, scales) arrays per layer. config: a V4.1
    `ModelConfig` the tables must match (layers, rows, width). mesh / axis: shard a device
    store by rows; device / workers / read_threads / advice: a host store's transfer target,
    prefetch threads, threads per gather and memory-map advice."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    if layer_ids is None and config is not None:
        layer_ids = tuple(config.engram_layer_ids)
    if isinstance(source, (str, os.PathLike)):
        tables, layer_ids = checkpoint_tables(source, layer_ids)
    else:
        if layer_ids is None:
            raise ValueError("open_engram_store: layer_ids (or config) is required with "
                             "in-memory tables")
        tables = list(source)
    tables, layer_ids = _check_tables(tables, layer_ids)
    if config is not None:                       # before anything is copied to a device
        _check_config(tables, layer_ids, config)
    if store == HOST:
        if mesh is not None or axis is not None:
            raise ValueError("open_engram_store: mesh / axis shard a 'device' store; a 'host' "
                             "store takes device=")
        return HostEngramStore(tables, layer_ids, device=device, workers=workers,
                               read_threads=read_threads, advice=advice)
    if device is not None:
        raise ValueError("open_engram_store: device= is for a 'host' store")
    return DeviceEngramStore(tables, layer_ids, mesh=mesh, axis=axis)


# --------------------------------------------------------------------------------- use
def layer_embedding(codes: jax.Array, scales: jax.Array, layer: int, dtype=jnp.float32):
    """The gathered embedding `engram.gate` takes for Engram layer index `layer`: codes
    [..., L, C, W] and scales [..., L, C, W/32] (a store's gather) -> dtype [..., C * W]."""
    e = dequantize_rows(codes[..., layer, :, :], scales[..., layer, :, :], dtype)
    return e.reshape(e.shape[:-2] + (e.shape[-2] * e.shape[-1],))


# --------------------------------------------------------------------------------- in jit
def host_rows(store: HostEngramStore, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`store.gather` from traced code (jit, scan, while loops): ids int32 [..., L, C] go to
    the host through one `jax.pure_callback`, the rows come back as device arrays (codes
    uint8 [..., L, C, W], scales uint8 [..., L, C, W/32]). The device waits for the gather:
    it cannot start before the ids are computed. An out-of-range id fails the computation
    with the store's ValueError."""
    if not isinstance(store, HostEngramStore):
        raise TypeError(f"host_rows needs a HostEngramStore, got {type(store).__name__}")
    assert ids.ndim >= 2 and ids.shape[-2] == len(store.rows), (ids.shape, store.rows)
    shapes = (jax.ShapeDtypeStruct(ids.shape + (store.width,), jnp.uint8),
              jax.ShapeDtypeStruct(ids.shape + (store.scale_width,), jnp.uint8))
    return jax.pure_callback(store.gather, shapes, ids.astype(jnp.int32))


# --------------------------------------------------------------------------------- params
HOST_TABLES = "host_tables"                   # the Engram params key holding a HostTables
TABLE_KEYS = ("table", "table_scale")         # the keys it replaces


@jax.tree_util.register_pytree_with_keys_class
class HostTables:
    """A static handle to a `HostEngramStore` inside params: a pytree node without leaves
    (jit, scan, eval_shape and tree maps carry it as metadata; equal and hashed by the
    store's identity). An Engram layer's params hold it under "host_tables" in place of
    "table" / "table_scale"."""

    __slots__ = ("store",)

    def __init__(self, store: HostEngramStore):
        if not isinstance(store, HostEngramStore):
            raise TypeError(f"HostTables needs a HostEngramStore, got {type(store).__name__}")
        self.store = store

    def __eq__(self, other):
        return isinstance(other, HostTables) and other.store is self.store

    def __hash__(self):
        return hash(id(self.store))

    def __repr__(self):
        return f"HostTables({self.store!r})"

    def tree_flatten_with_keys(self):
        return (), self

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, handle, children):
        return handle


def _engram_layer_ids(g) -> list[list[int]]:
    """Layer ids per unit position j of a layer group (one per repeat)."""
    return [[g.start + r * g.unit + j for r in range(g.repeats)] for j in range(g.unit)]


def host_store_of(tree) -> HostEngramStore | None:
    """The `HostEngramStore` behind the `HostTables` handles of params (or any tree of them),
    None when the tables are arrays. One store per model (ValueError otherwise)."""
    handles = [h for h in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, HostTables))
               if isinstance(h, HostTables)]
    stores = {id(h.store): h.store for h in handles}
    if len(stores) > 1:
        raise ValueError(f"params refer to {len(stores)} different Engram host stores; one "
                         f"store holds every Engram layer of a model")
    return next(iter(stores.values()), None)


def params_tables(params) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(codes uint8 [R_l, W], scales uint8 [R_l, W/32])] of each Engram layer of params
    whose tables are arrays (FP8 bytes), in config order, as host numpy arrays."""
    cfg = params.config
    out = []
    for layer in cfg.engram_layer_ids:
        w = params["layers"][layer]["engram"]
        if HOST_TABLES in w:
            raise ValueError(f"layer {layer}: the Engram tables are in a host store already")
        table, scale = (np.asarray(jax.device_get(w[k])) for k in TABLE_KEYS)
        if table.dtype.itemsize != 1:
            raise ValueError(f"layer {layer}: a host store holds FP8 table bytes, but the "
                             f"params' table is {table.dtype} (dequantised)")
        out.append((table.view(np.uint8), scale.view(np.uint8)))
    return out


def with_host_tables(params, store: HostEngramStore):
    """params whose Engram layers read their tables from `store` (the config's layers, rows
    and width): "table" / "table_scale" dropped, a `HostTables` handle in their place."""
    from deepinfer_fn.params import Params
    cfg = params.config
    if not isinstance(store, HostEngramStore):
        raise TypeError(f"with_host_tables needs a HostEngramStore, got {type(store).__name__}")
    _check_config(store.tables, store.layer_ids, cfg)
    handle = HostTables(store)

    def swap(scanned, tree):
        if not isinstance(tree, dict) or "engram" not in tree:
            return tree
        e = {k: v for k, v in tree["engram"].items() if k not in TABLE_KEYS and k != HOST_TABLES}
        return {**tree, "engram": {**e, HOST_TABLES: handle}}

    return Params({**params.weights, "layers": params["layers"].map_blocks(swap)}, cfg)


def with_table_arrays(params):
    """The inverse of `with_host_tables`: each Engram layer's "table" / "table_scale" are the
    store's numpy arrays again (memory maps stay maps; a scanned group stacks its layers'
    tables, a copy). For `save_params` or `jax.device_put`; params without a store as is."""
    from deepinfer_fn.layer_groups import LayerStack
    from deepinfer_fn.params import Params
    store = host_store_of(params)
    if store is None:
        return params
    stack = params["layers"]
    by_layer = dict(zip(store.layer_ids, store.tables))
    blocks = []
    for g, blk in zip(stack.groups, stack.blocks):
        new = []
        for tree, layer_ids in zip(blk, _engram_layer_ids(g)):
            if isinstance(tree, dict) and HOST_TABLES in tree.get("engram", {}):
                e = {k: v for k, v in tree["engram"].items() if k != HOST_TABLES}
                pairs = [by_layer[i] for i in layer_ids]
                for k, part in zip(TABLE_KEYS, zip(*pairs)):
                    e[k] = np.stack(part) if g.scanned else part[0]
                tree = {**tree, "engram": e}
            new.append(tree)
        blocks.append(tuple(new))
    return Params({**params.weights, "layers": LayerStack(stack.groups, tuple(blocks))},
                  params.config)
