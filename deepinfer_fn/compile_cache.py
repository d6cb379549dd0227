"""Compile once, reuse: the persistent compilation cache, parallel precompilation, and a
counter of the programs a call compiles.

The persistent cache is on by default (`enable_persistent_cache`, run when `deepinfer_fn` is
imported), in a per-user directory: `$DEEPINFER_COMPILE_CACHE` if set (a path; `off`, `0` or
an empty value disables it), else `$XDG_CACHE_HOME/deepinfer_fn/jax` (default
`~/.cache/deepinfer_fn/jax`). A cache directory the user already gave JAX
(`JAX_COMPILATION_CACHE_DIR` or `jax.config.update("jax_compilation_cache_dir", ...)`) wins.
A second process compiling the same program then loads it from disk instead of compiling.

`precompile(jobs)` lowers jitted functions for the shapes they will run with and compiles them
in parallel threads (XLA compiles release the GIL); a later call with the same arguments finds
the compiled program in JAX's in-memory cache. `ProgramCounter` counts the programs compiled
(or loaded from the persistent cache) inside a `with` block.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import threading
import time
from typing import Any, Callable, Sequence

import jax
from jax import monitoring

ENV_VAR = "DEEPINFER_COMPILE_CACHE"
DISABLED = ("", "0", "off", "false", "no", "none")   # values that turn a cache off
# Programs that compile faster than this are not worth a disk entry (JAX's own default is 1 s).
MIN_COMPILE_SECONDS = 0.5


def default_cache_dir() -> pathlib.Path:
    """The per-user cache directory used when neither the environment nor JAX names one."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "deepinfer_fn" / "jax"


def cache_dir_from_env() -> pathlib.Path | None:
    """Where `$DEEPINFER_COMPILE_CACHE` puts the cache: a path, None when it disables it, the
    default directory when it is unset."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return default_cache_dir()
    if value.strip().lower() in DISABLED:
        return None
    return pathlib.Path(value).expanduser()


def enable_persistent_cache(path: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Turns JAX's persistent compilation cache on; returns its directory (None: disabled).

    path None: a directory already configured in JAX is kept, else `$DEEPINFER_COMPILE_CACHE` /
    the per-user default decides. An explicit path always wins.
    """
    if path is None:
        current = jax.config.jax_compilation_cache_dir
        if current:
            return pathlib.Path(current)
        target = cache_dir_from_env()
        if target is None:
            return None
    else:
        target = pathlib.Path(path).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only home etc.: run without a cache rather than fail
        import warnings
        warnings.warn(f"deepinfer_fn: compilation cache disabled, cannot create {target}: {e}")
        return None
    jax.config.update("jax_compilation_cache_dir", str(target))
    if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_SECONDS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return target


# ------------------------------------------------------------------ counting programs
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_active: list["ProgramCounter"] = []
_registered = False


def _on_duration(event: str, duration: float, fun_name: str = "", **_):
    if event == _BACKEND_COMPILE:
        with _lock:
            for c in _active:
                c.programs += 1
                c.seconds += duration
                c.names.append(fun_name)


def _on_event(event: str, **_):
    if event == _CACHE_HIT:
        with _lock:
            for c in _active:
                c.disk_hits += 1


def count_loaded(name: str, seconds: float) -> None:
    """Counts an executable loaded whole from disk (`program_cache`) in the active counters,
    as a program loaded from the persistent cache."""
    with _lock:
        for c in _active:
            c.programs += 1
            c.disk_hits += 1
            c.seconds += seconds
            c.names.append(name)


def _ensure_listeners():
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_on_duration)
            monitoring.register_event_listener(_on_event)
            _registered = True


@dataclasses.dataclass
class ProgramCounter:
    """`with ProgramCounter() as c: ...` -> c.programs: XLA programs obtained inside (each
    compiled or loaded from the persistent cache; JAX's in-memory cache hits are free and not
    counted), c.disk_hits: those loaded from the persistent cache, c.seconds: time in them,
    c.names: the programs' names."""

    programs: int = 0
    disk_hits: int = 0
    seconds: float = 0.0
    names: list = dataclasses.field(default_factory=list)

    def __enter__(self) -> "ProgramCounter":
        _ensure_listeners()
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc):
        with _lock:
            _active.remove(self)
        return False


# ------------------------------------------------------------------ parallel precompilation
@dataclasses.dataclass(frozen=True)
class Job:
    """One program to precompile: `fn` a jitted function, called later as fn(*args, **kwargs)
    (arrays or `jax.ShapeDtypeStruct`s with the shardings the real call will have)."""

    fn: Callable
    args: Sequence[Any] = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    name: str = ""


def precompile(jobs: Sequence[Job], threads: int | None = None) -> list[float]:
    """Lowers the jobs one after another in this thread and compiles each in a worker thread
    as soon as it is lowered (XLA compiles release the GIL, so a compile overlaps the next
    job's lowering and the other compiles); returns each job's compile seconds. A
    `program_cache.Program` whose executable is stored loads it here instead."""
    jobs = list(jobs)
    if not jobs:
        return []

    def stage(job):
        if hasattr(job.fn, "stage"):
            return job.fn.stage(*job.args, **job.kwargs)
        return job.fn.lower(*job.args, **job.kwargs).compile

    def compile_one(thunk):
        t0 = time.perf_counter()
        if thunk is not None:
            thunk()
        return time.perf_counter() - t0

    workers = threads or min(len(jobs), max(1, os.cpu_count() or 1))
    if workers == 1 or len(jobs) == 1:
        return [compile_one(stage(job)) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="precompile") as pool:
        futures = [pool.submit(compile_one, stage(job)) for job in jobs]
        return [f.result() for f in futures]
