"""Compiled programs kept on disk whole, so a later process skips tracing and lowering too.

JAX's persistent compilation cache (`compile_cache`) is keyed by the lowered program: every
process still traces the model and lowers it to StableHLO, and lowering a Pallas Mosaic GPU
kernel runs its layout inference in Python (about a second per distinct kernel). `program`
is `jax.jit` plus a cache of whole executables (`jax.experimental.serialize_executable`):
the first call with a new signature lowers and compiles (through JAX's caches), then writes
the executable to `<compile cache dir>/deepinfer_programs/`; a later process with the same
signature loads it and calls it without tracing.

The disk key covers everything the program depends on: the source of the `deepinfer_fn`,
`custom_calls` and `shardings` packages, JAX's version, the devices, `DEEPINFER_*` and
`XLA_FLAGS` environment variables, the kernel registry's choices, the function, its static
arguments and the shapes, dtypes and shardings of the others. Static arguments must be plain
values (numbers, strings, dtypes, tuples, dataclasses of those such as `ModelConfig`,
module-level functions); a call with any other static value, with an array spread over
several devices, under a trace, or with the cache off is plain `jax.jit`.
Programs that cannot be serialized (host callbacks) stay in memory only; `clear_memory()`
drops the executables held in memory (as `jax.clear_caches()` does for jit's).

A `Program` built with `quick_compile` (a predicate over the call's arguments) compiles the
calls it accepts with `QUICK_COMPILE_OPTIONS`: small calls, such as a short prompt's prefill
chunk, whose run time is microseconds while GEMM autotuning costs seconds of compile.
`$DEEPINFER_QUICK_COMPILE` = `off` compiles every call with XLA's defaults.

`$DEEPINFER_PROGRAM_CACHE` = `off` (or `0`, empty) turns it off, as does turning the
persistent compilation cache off: a `Program` is then exactly `jax.jit`.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import inspect
import os
import pathlib
import pickle
import threading
import time
import types
import weakref
from typing import Any, Callable

import jax
import numpy as np
from jax import monitoring
from jax.experimental import serialize_executable

from deepinfer_fn import compile_cache, kernel_registry

ENV_VAR = "DEEPINFER_PROGRAM_CACHE"
SUBDIR = "deepinfer_programs"
_FORMAT = 2
_PACKAGES = ("deepinfer_fn", "custom_calls", "shardings")
_ENV_PREFIXES = ("DEEPINFER_", "XLA_FLAGS", "LIBTPU_INIT_ARGS")
QUICK_COMPILE_ENV = "DEEPINFER_QUICK_COMPILE"
# XLA options of a call whose run time is negligible next to its compile (`quick_compile`):
# dots stay library GEMMs instead of Triton fusions, which skips compiling and timing Triton
# tile configurations (GEMM autotuning).
QUICK_COMPILE_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
_ENV_IGNORED = (compile_cache.ENV_VAR, ENV_VAR, "DEEPINFER_MODEL_PATH", "DEEPINFER_DEBUG")


class Unkeyable(Exception):
    """A static argument whose value has no faithful, process-independent text."""


def quick_compile_enabled() -> bool:
    """`$DEEPINFER_QUICK_COMPILE` = `off` (or `0`, empty) compiles every call with XLA's
    default options."""
    return os.environ.get(QUICK_COMPILE_ENV, "on").strip().lower() not in compile_cache.DISABLED


def cache_dir() -> pathlib.Path | None:
    """Where executables are stored: `deepinfer_programs/` inside JAX's persistent cache
    directory; None when either cache is off."""
    if os.environ.get(ENV_VAR, "on").strip().lower() in compile_cache.DISABLED:
        return None
    root = jax.config.jax_compilation_cache_dir
    return pathlib.Path(root) / SUBDIR if root else None


@functools.cache
def source_digest() -> str:
    """sha256 over the project's Python sources (any edit invalidates every stored program)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def environment_key() -> str:
    """The process-wide part of the disk key (versions, devices, environment, kernels)."""
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED)
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    flags = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
             jax.config.jax_numpy_rank_promotion)
    return repr((_FORMAT, source_digest(), jax.__version__, jax.lib.__version__, devices, env,
                 flags, kernel_registry.selection()))


def static_text(value) -> str:
    """Process-independent text of a static argument (raises `Unkeyable` otherwise)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        inner = ",".join(static_text(v) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        return "dict(" + ",".join(f"{static_text(k)}:{static_text(v)}"
                                  for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))
    if isinstance(value, frozenset):
        return "frozenset(" + ",".join(sorted(static_text(v) for v in value)) + ")"
    if isinstance(value, np.dtype) or (isinstance(value, type) and _is_dtype(value)):
        return f"dtype({np.dtype(value).name})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={static_text(getattr(value, f.name))}"
                          for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, types.FunctionType) and "<" not in value.__qualname__:
        return f"function({value.__module__}.{value.__qualname__})"   # source: in the digest
    raise Unkeyable(type(value).__qualname__)


def _is_dtype(t) -> bool:
    try:
        np.dtype(t)
        return True
    except TypeError:
        return False


@functools.cache
def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def leaf_signature(x):
    """(shape, dtype, weak type, sharding) of a dynamic argument leaf (numpy values and
    unplaced shapes: the default device, where jit puts them); None for a tracer or an array
    spread over several devices (sharded programs stay with jit)."""
    if isinstance(x, jax.Array):
        if isinstance(x, jax.core.Tracer) or not isinstance(
                x.sharding, jax.sharding.SingleDeviceSharding):
            return None
        return (x.shape, x.dtype, x.weak_type, x.sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is not None and not isinstance(x.sharding,
                                                     jax.sharding.SingleDeviceSharding):
            return None
        return (x.shape, x.dtype, bool(x.weak_type), x.sharding or _default_sharding())
    if isinstance(x, (np.ndarray, np.generic)):
        return (x.shape, x.dtype, False, _default_sharding())
    if isinstance(x, (bool, int, float, complex)):
        return ((), type(x), True, _default_sharding())
    if isinstance(x, jax.core.Tracer):
        return None
    raise Unkeyable(type(x).__qualname__)


def signature_text(sig) -> str:
    """Process-independent text of `leaf_signature`s."""
    def one(shape, dtype, weak, sharding):
        if isinstance(sharding, jax.sharding.SingleDeviceSharding):
            place = f"dev{next(iter(sharding.device_set)).id}"
        else:
            place = repr(sharding)
        name = dtype.__name__ if isinstance(dtype, type) else np.dtype(dtype).name
        return f"{shape}:{name}:{int(weak)}:{place}"
    return ";".join(one(*leaf) for leaf in sig)


@dataclasses.dataclass
class Stats:
    """Counts of one process: executables loaded from disk, compiled here, stored (and the
    seconds spent loading, and serializing + writing)."""
    loaded: int = 0
    compiled: int = 0
    stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0


stats = Stats()

# XLA:CPU cannot serialize again an executable it loaded from JAX's persistent cache (the
# copy fails at run time: "Function ... not found"), so such a compile is kept in memory only.
RESERIALIZE_BROKEN = ("cpu",)
_thread = threading.local()


def _on_event(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _thread.hits = getattr(_thread, "hits", 0) + 1


def _thread_hits() -> int:
    return getattr(_thread, "hits", 0)


monitoring.register_event_listener(_on_event)
_write_lock = threading.Lock()
_programs: "weakref.WeakSet[Program]" = weakref.WeakSet()


def clear_memory() -> None:
    """Drops every `Program`'s executables held in memory (the disk entries stay)."""
    for p in list(_programs):
        with p._lock:
            p._memory.clear()


# Release the executables before JAX tears its backends down at exit (atexit runs the
# handlers last registered first): one outliving its client aborts the interpreter.
atexit.register(clear_memory)


class Program:
    """`jax.jit(fun, ...)` whose executables are cached per call signature in memory and on
    disk (module docstring). Calls, `.lower`, `.trace` and `.eval_shape` behave as jit's."""

    def __init__(self, fun: Callable, *, static_argnums=(), static_argnames=(),
                 donate_argnums=(), name: str | None = None,
                 quick_compile: Callable[..., bool] | None = None):
        static_argnums = (static_argnums,) if isinstance(static_argnums, int) else static_argnums
        static_argnames = ((static_argnames,) if isinstance(static_argnames, str)
                           else static_argnames)
        jit = functools.partial(jax.jit, fun, static_argnums=static_argnums,
                                static_argnames=static_argnames, donate_argnums=donate_argnums)
        self.jitted = jit()
        self.quick_compile = quick_compile
        self.quick_jitted = jit(compiler_options=QUICK_COMPILE_OPTIONS) if quick_compile else None
        self.signature = inspect.signature(fun)
        names = list(self.signature.parameters)
        self.static = frozenset(static_argnames) | {names[i] for i in static_argnums}
        self.name = name or f"{fun.__module__}.{fun.__qualname__}"
        self._memory: dict = {}
        self._seen: dict = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, fun)
        _programs.add(self)

    def __getattr__(self, attr):          # lower, trace, eval_shape, clear_cache, ...
        return getattr(self.jitted, attr)

    def jit_for(self, *args, **kwargs):
        """The jitted function this call compiles with: `quick_jitted` where `quick_compile`
        says the call is small (and `$DEEPINFER_QUICK_COMPILE` is not off), else `jitted`
        (which `.lower` and the other jit attributes always use)."""
        if (self.quick_jitted is not None and quick_compile_enabled()
                and self.quick_compile(*args, **kwargs)):
            return self.quick_jitted
        return self.jitted

    def _split(self, args, kwargs):
        """(static values by name, dynamic positional args, dynamic kwargs)."""
        bound = self.signature.bind(*args, **kwargs)
        static, dyn_args, dyn_kwargs = {}, [], {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if name in self.static:
                static[name] = value
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                dyn_args.extend(value)
            elif kind == inspect.Parameter.VAR_KEYWORD:
                dyn_kwargs.update(value)
            elif kind == inspect.Parameter.KEYWORD_ONLY or name in kwargs:
                dyn_kwargs[name] = value
            else:
                dyn_args.append(value)
        return static, tuple(dyn_args), dyn_kwargs

    def key(self, args, kwargs):
        """(memory key, dynamic args, dynamic kwargs), or None where this call must go
        through plain jit (a tracer, or a leaf that is not an array or number)."""
        static, dyn_args, dyn_kwargs = self._split(args, kwargs)
        try:
            parts = tuple(self._arg_signature(a) for a in dyn_args)
            parts += tuple((k, self._arg_signature(v)) for k, v in sorted(dyn_kwargs.items()))
        except Unkeyable:
            return None
        if any(p is None for p in parts):
            return None
        quick = self.jit_for(*args, **kwargs) is self.quick_jitted
        return (tuple(sorted(static.items())), len(dyn_args), parts, quick), dyn_args, dyn_kwargs

    def _arg_signature(self, arg):
        """(treedef, leaf signatures) of one argument, or None; remembered for the last
        object seen at each identity (params are passed again and again)."""
        hit = self._seen.get(id(arg))
        if hit is not None and hit[0]() is arg:
            return hit[1]
        leaves, treedef = jax.tree.flatten(arg)
        sig = tuple(map(leaf_signature, leaves))
        part = None if None in sig else (treedef, sig)
        if len(leaves) > 16:                         # worth remembering; needs a weakref
            try:
                ref = weakref.ref(arg)
            except TypeError:
                return part
            if len(self._seen) > 64:
                self._seen.clear()
            self._seen[id(arg)] = (ref, part)
        return part

    def disk_text(self, memory) -> str:
        """The call-specific part of the disk key (raises `Unkeyable` for a static value
        without a faithful text)."""
        static, n_positional, parts, quick = memory
        text = ",".join(f"{k}={static_text(v)}" for k, v in static) + f";quick={quick}"

        def part_text(part):
            if len(part) == 2 and isinstance(part[0], str):      # a keyword argument
                return f"{part[0]}=" + part_text(part[1])
            treedef, sig = part
            return f"{treedef}|{signature_text(sig)}"
        return repr((self.name, text, n_positional, [part_text(p) for p in parts]))

    def __call__(self, *args, **kwargs):
        keyed = self.key(args, kwargs) if cache_dir() is not None else None
        if keyed is None:
            return self.jit_for(*args, **kwargs)(*args, **kwargs)
        memory, dyn_args, dyn_kwargs = keyed
        compiled = self._memory.get(memory)
        if compiled is None:
            try:
                finish = self._stage(memory, args, kwargs)
            except Unkeyable:
                return self.jit_for(*args, **kwargs)(*args, **kwargs)
            compiled = finish() if finish is not None else self._memory[memory]
        return compiled(*dyn_args, **dyn_kwargs)

    def stage(self, *args, **kwargs) -> Callable[[], Any] | None:
        """Readies the executable for these arguments (arrays or `jax.ShapeDtypeStruct`s)
        without running it: None when it is in memory or was loaded from disk now, else a
        thunk, safe to run in another thread, that compiles the program lowered here (and
        stores it). A call that is not cacheable is lowered for jit's own caches."""
        keyed = self.key(args, kwargs) if cache_dir() is not None else None
        if keyed is not None and keyed[0] in self._memory:
            return None
        try:
            if keyed is not None:
                return self._stage(keyed[0], args, kwargs)
        except Unkeyable:
            pass
        return self.jit_for(*args, **kwargs).lower(*args, **kwargs).compile

    def prepare(self, *args, **kwargs) -> None:
        """`stage` and run its thunk here."""
        finish = self.stage(*args, **kwargs)
        if finish is not None:
            finish()

    def _stage(self, memory, args, kwargs):
        """Loads the stored executable now (None), else lowers here and returns the thunk
        that compiles and stores it."""
        folder = cache_dir()
        digest = hashlib.sha256((environment_key() + self.disk_text(memory)).encode()).hexdigest()
        path = folder / f"{self.name.rsplit('.', 1)[-1]}-{digest[:40]}.bin"
        compiled = _load(path, self.name)
        if compiled is not None:
            with self._lock:
                self._memory.setdefault(memory, compiled)
            return None
        lowered = self.jit_for(*args, **kwargs).lower(*args, **kwargs)

        def finish():
            compiled = _compile(lowered, path)
            with self._lock:
                return self._memory.setdefault(memory, compiled)
        return finish


def program(fun: Callable | None = None, **jit_kwargs):
    """Decorator: `Program(fun, **jit_kwargs)` (jit_kwargs: static_argnums, static_argnames,
    donate_argnums, name, quick_compile)."""
    if fun is None:
        return lambda f: Program(f, **jit_kwargs)
    return Program(fun, **jit_kwargs)


def _compile(lowered, path: pathlib.Path):
    """Compiles (through JAX's caches) and stores the executable where it can be reloaded."""
    hits = _thread_hits()
    compiled = lowered.compile()
    stats.compiled += 1
    if not (_thread_hits() > hits and jax.default_backend() in RESERIALIZE_BROKEN):
        _store(path, compiled)
    return compiled


def _load(path: pathlib.Path, name: str):
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    t0 = time.perf_counter()
    try:
        fmt, serialized, in_tree, out_tree, device_ids = pickle.loads(blob)
        if fmt != _FORMAT:
            return None
        by_id = {d.id: d for d in jax.devices()}
        compiled = serialize_executable.deserialize_and_load(
            serialized, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
    except Exception:                      # a stale or truncated entry: compile instead
        return None
    seconds = time.perf_counter() - t0
    stats.loaded += 1
    stats.load_seconds += seconds
    compile_cache.count_loaded(name, seconds)
    return compiled


def _store(path: pathlib.Path, compiled) -> None:
    t0 = time.perf_counter()
    try:
        _write(path, compiled)
    finally:
        stats.store_seconds += time.perf_counter() - t0


def _write(path: pathlib.Path, compiled) -> None:
    try:
        serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
        device_ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
        blob = pickle.dumps((_FORMAT, serialized, in_tree, out_tree, device_ids))
    except Exception:                      # host callbacks etc.: memory only
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        with _write_lock:
            tmp.write_bytes(blob)
            os.replace(tmp, path)
        stats.stored += 1
    except OSError:
        pass
