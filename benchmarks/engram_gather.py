"""Per-token cost of gathering Engram rows from memory-mapped tables (`HostEngramStore`).

A V4.1 token reads 2 layers x 24 rows of 264 bytes (256 FP8 values + 8 UE8M0 scales) at
hash-random positions of two ~384M-row tables (~101 GB each). This benchmark writes a smaller
two-layer table file of the same row size (a safetensors shard with the checkpoint's tensor
names and dtypes; --gb sets its size), opens it as the host store does (memory maps of the
checkpoint bytes) and times `gather` of uniformly random ids, per step of B tokens:

  cold   the file's pages dropped from the page cache (posix_fadvise DONTNEED) before each
         batch size; few enough steps that most rows are first touches (a page fault + a
         read each: the tables-on-disk case); with the store's default madvise "random" (no
         read-ahead) and with "normal" (kernel read-around on every fault)
  warm   the whole file read once first and every page mapped (resident in the page cache:
         the tables-in-RAM case), and the same tables copied into process memory

Reported per batch size: us/step, us/token, GB/s of gathered row bytes (scales included), and
for warm tables also `jax.device_put` of the gathered rows and the submit/take pipeline
(`--step-ms` of simulated device work per step; the time `take` still waits shows whether the
background gather + transfer is hidden).

    python benchmarks/engram_gather.py                     # 2 GB file in /tmp, a few minutes
    python benchmarks/engram_gather.py --gb 1 --quick      # smoke test
    python benchmarks/engram_gather.py --device-store      # + DeviceEngramStore (jnp.take)
    python benchmarks/engram_gather.py --forward-only --gb 1 --out benchmarks/results/x.json

--forward (or --forward-only: skip the gather sections) times a jitted decode-step-like program
of the v4.1-mini Engram geometry (hidden 2048, 4 streams, 24 columns of 256 values per layer,
two layers; f32 gate weights) per step of B tokens, over the same table file:

  lookup_*    rows -> dequantised embeddings -> a sum (the gather dominates)
  gate_*      rows -> dequantised embeddings -> both Engram gates (the wkv matmuls dominate)
  *_device    rows taken from device copies of the tables (`take_rows`) inside the program
  *_callback  rows gathered on the host inside the program (`host_rows`: one pure_callback)
  *_rows_input  rows already on the device, passed in (no gather in the step)
  gate_prefetch  `take` of rows submitted one step ahead, `submit` of the next, the gates
  gather_only `HostEngramStore.gather` alone (numpy, no device)

*_callback - *_device is what host tables add to a step whose ids are computed on the device
(plain decode); gate_prefetch - gate_rows_input what is left when the ids are known ahead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from deepinfer_fn.model import engram
from deepinfer_fn.model.engram_store import host_rows, layer_embedding, open_engram_store, take_rows

W, NB, C = 256, 8, 24                 # values per row, scales per row, columns per layer
LAYERS = (1, 14)
ROW_BYTES = W + NB
FILE = "model-00001-of-00001.safetensors"


def write_tables(directory: str, rows: int, seed: int = 0, chunk_rows: int = 1 << 20) -> str:
    """A safetensors shard with two Engram layers of `rows` rows (random bytes), streamed to
    disk in chunks; reused when it already exists with the same header."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILE)
    header, offset, order = {}, 0, []
    for layer in LAYERS:
        for suffix, dtype, width in (("weight", "F8_E4M3", W), ("scale", "F8_E8M0", NB)):
            name = f"layers.{layer}.engram.embed.{suffix}"
            header[name] = {"dtype": dtype, "shape": [rows, width],
                            "data_offsets": [offset, offset + rows * width]}
            offset += rows * width
            order.append((name, width))
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    total = 8 + len(blob) + offset
    if os.path.isfile(path) and os.path.getsize(path) == total:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if f.read(n) == blob:
                return path
    rng = np.random.default_rng(seed)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, width in order:
            for start in range(0, rows, chunk_rows):
                n = min(chunk_rows, rows - start)
                if name.endswith("scale"):
                    block = rng.integers(110, 140, (n, width), dtype=np.uint8)
                else:
                    block = rng.integers(0, 256, (n, width), dtype=np.uint8)
                f.write(block.tobytes())
    os.replace(tmp, path)
    return path


def drop_page_cache(path: str) -> None:
    """Ask the kernel to drop the file's clean cached pages (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_whole(path: str, chunk: int = 64 << 20) -> float:
    """Read the file once (fills the page cache); returns GB/s."""
    t = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            n += len(b)
    return n / (time.perf_counter() - t) / 1e9


def random_ids(rng, rows: int, steps: int, batch: int) -> np.ndarray:
    """int32 [steps, batch, 1, 2, C] uniform row ids (hash ids are uniform per column)."""
    return rng.integers(0, rows, (steps, batch, 1, len(LAYERS), C), dtype=np.int64).astype(
        np.int32)


def summarize(times_s: list[float], batch: int) -> dict:
    """Throughput from the mean step time (cold steps are bursty), latency percentiles."""
    t = np.asarray(times_s)
    mean_us = float(t.mean()) * 1e6
    bytes_per_step = batch * len(LAYERS) * C * ROW_BYTES
    return dict(steps=len(t), tokens=len(t) * batch, us_per_token=mean_us / batch,
                gb_per_s=bytes_per_step / (mean_us * 1e-6) / 1e9, us_per_step_mean=mean_us,
                us_per_step_median=float(np.median(t)) * 1e6,
                us_per_step_p90=float(np.percentile(t, 90)) * 1e6,
                us_per_step_max=float(t.max()) * 1e6)


def time_gathers(gather, ids) -> list[float]:
    out = []
    for step in ids:
        t = time.perf_counter()
        gather(step)
        out.append(time.perf_counter() - t)
    return out


def time_device_put(store, ids) -> dict:
    times = []
    for step in ids:
        codes, scales = store.gather(step)
        t = time.perf_counter()
        jax.block_until_ready((jax.device_put(codes), jax.device_put(scales)))
        times.append(time.perf_counter() - t)
    return dict(us_per_step_median=float(np.median(times)) * 1e6)


def time_pipeline(store, ids, step_ms: float) -> dict:
    """submit(t+1) before waiting out step t's simulated device work, then take(t+1)."""
    waits, walls = [], []
    store.submit(ids[0])
    for t in range(len(ids)):
        w0 = time.perf_counter()
        codes, scales = store.take()
        jax.block_until_ready((codes, scales))
        waits.append(time.perf_counter() - w0)
        if t + 1 < len(ids):
            store.submit(ids[t + 1])
        time.sleep(step_ms / 1e3)                         # the step using `codes, scales`
        walls.append(time.perf_counter() - w0)
    return dict(step_ms=step_ms, take_wait_us_median=float(np.median(waits[1:])) * 1e6,
                take_wait_us_max=float(np.max(waits[1:])) * 1e6,
                wall_ms_per_step_median=float(np.median(walls)) * 1e3)


def forward_like(store, dev_tables, batches, steps: int, seed: int, gate: bool = True) -> dict:
    """The --forward programs (module docstring): median ms per step and us per token, the
    programs interleaved step by step (a loaded machine drifts)."""
    import jax.numpy as jnp
    n, D = 4, 2048                                       # v4.1-mini streams and hidden size
    E = C * W
    rng = np.random.default_rng(seed)
    weights = [dict(wkv=jnp.asarray(rng.normal(0, E ** -0.5, (E, (n + 1) * D)), jnp.float32),
                    q_weight=jnp.ones((n, D), jnp.float32), k_weight=jnp.ones((n, D), jnp.float32))
               for _ in LAYERS]

    def gates(x, codes, scales):
        for l, w in enumerate(weights):
            e = layer_embedding(codes, scales, l, jnp.float32)
            x = engram.gate(x, e, w["wkv"], w["q_weight"], w["k_weight"], eps=1e-20)
        return x

    def lookups(codes, scales):
        return sum(layer_embedding(codes, scales, l, jnp.float32).sum() for l in range(len(LAYERS)))

    jit = jax.jit
    gate_dev = jit(lambda x, ids, t: gates(x, *take_rows(t, ids)))
    gate_cb = jit(lambda x, ids: gates(x, *host_rows(store, ids)))
    gate_in = jit(gates)
    look_dev = jit(lambda ids, t: lookups(*take_rows(t, ids)))
    look_cb = jit(lambda ids: lookups(*host_rows(store, ids)))
    look_in = jit(lookups)
    out = {}
    for b in batches:
        ids = random_ids(rng, store.rows[0], steps + 2, b)[:, :, 0]            # [steps, b, 2, C]
        x = jnp.asarray(rng.normal(0, 1, (b, n, D)), jnp.float32)
        dev_ids = [jnp.asarray(i) for i in ids]
        pre = [store.gather(i) for i in ids]
        pre = [tuple(jnp.asarray(a) for a in r) for r in pre]
        runs = {"gather_only": lambda t: store.gather(ids[t]),
                "lookup_device": lambda t: look_dev(dev_ids[t], dev_tables),
                "lookup_callback": lambda t: look_cb(dev_ids[t]),
                "lookup_rows_input": lambda t: look_in(*pre[t]),
                "gate_device": lambda t: gate_dev(x, dev_ids[t], dev_tables),
                "gate_callback": lambda t: gate_cb(x, dev_ids[t]),
                "gate_rows_input": lambda t: gate_in(x, *pre[t])}
        if not gate:
            runs = {k: v for k, v in runs.items() if not k.startswith("gate")}

        def prefetch(t):
            """take step t's rows (submitted one step ahead), submit t+1, run the gates."""
            rows = store.take()
            store.submit(ids[t + 1])
            return gate_in(x, *rows)
        if gate:
            runs["gate_prefetch"] = prefetch
        else:
            store.submit(ids[1])                          # what the last take() drains
        store.submit(ids[0])
        for run in runs.values():
            jax.block_until_ready(run(0))                 # compile (prefetch: submits ids[1])
        times = {k: [] for k in runs}
        for t in range(1, steps + 1):
            for name, run in runs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(run(t))
                times[name].append(time.perf_counter() - t0)
        store.take()
        res = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
        per_token = lambda ms: ms * 1e3 / b
        cost = dict(lookup_vs_device=per_token(res["lookup_callback"] - res["lookup_device"]),
                    lookup_vs_rows_input=per_token(res["lookup_callback"]
                                                   - res["lookup_rows_input"]))
        if gate:
            cost.update(gate_vs_device=per_token(res["gate_callback"] - res["gate_device"]),
                        prefetch_vs_rows_input=per_token(res["gate_prefetch"]
                                                         - res["gate_rows_input"]))
        out[b] = dict(ms_per_step_median=res, us_per_token={k: per_token(v) for k, v in res.items()},
                      callback_cost_us_per_token=cost)
        print(f"forward-like B={b:3d}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items())
              + " ms/step", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="table file size (both layers)")
    ap.add_argument("--dir", default="/tmp/engram_gather_bench")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--cold-tokens", type=int, default=1024,
                    help="tokens gathered per batch size with a cold cache")
    ap.add_argument("--warm-tokens", type=int, default=8192)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=1, help="prefetch threads")
    ap.add_argument("--read-threads", type=int, default=8, help="threads per cold gather")
    ap.add_argument("--device-store", action="store_true",
                    help="also time DeviceEngramStore on the default device (copies the tables)")
    ap.add_argument("--forward", action="store_true",
                    help="also time the forward-like programs (module docstring)")
    ap.add_argument("--forward-only", action="store_true",
                    help="only the forward-like programs (no cold / warm gather sections)")
    ap.add_argument("--forward-batches", default="1,16,64")
    ap.add_argument("--forward-steps", type=int, default=10)
    ap.add_argument("--forward-no-gate", action="store_true",
                    help="only the lookup programs (the gate's matmuls dominate a CPU step)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the table file afterwards")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/engram_gather_cpu.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.cold_tokens, args.warm_tokens = 128, 512
    batches = [int(b) for b in args.batches.split(",")]
    rows = int(args.gb * 1e9) // (len(LAYERS) * ROW_BYTES)

    t = time.perf_counter()
    path = write_tables(args.dir, rows, args.seed)
    write_s = time.perf_counter() - t
    size = os.path.getsize(path)
    print(f"{path}: {size / 1e9:.2f} GB, {rows} rows per layer (written/reused in "
          f"{write_s:.1f} s)", flush=True)
    rng = np.random.default_rng(args.seed + 1)
    result = dict(device=jax.devices()[0].device_kind, platform=platform.platform(),
                  cpus=os.cpu_count(), load_average_at_start=os.getloadavg(),
                  jax=jax.__version__, args=vars(args),
                  file_bytes=size, rows_per_layer=rows, row_bytes=ROW_BYTES,
                  real_model=dict(rows_per_layer=[384006168, 384016682],
                                  bytes_per_token=len(LAYERS) * C * ROW_BYTES),
                  cold={}, warm={}, device_put={}, pipeline={}, device_store={})
    cold_variants = {"random_t1": dict(advice="random"), "normal_t1": dict(advice="normal"),
                     f"random_t{args.read_threads}": dict(advice="random",
                                                          read_threads=args.read_threads)}
    if args.forward_only:
        cold_variants = {}
    for label, kw in cold_variants.items():                # cold: first touches
        result["cold"][label] = {}
        for b in batches:
            # a fresh store each time: pages still mapped by a live memory map are not dropped
            drop_page_cache(path)
            steps = max(3, args.cold_tokens // b)
            ids = random_ids(rng, rows, steps, b)
            with open_engram_store(args.dir, store="host", **kw) as cold:
                r = result["cold"][label][b] = summarize(time_gathers(cold.gather, ids), b)
            del cold
            gc.collect()
            print(f"cold {label:10s} B={b:3d}: {r['us_per_token']:9.1f} us/token "
                  f"{r['gb_per_s']:7.3f} GB/s", flush=True)

    drop_page_cache(path)
    result["sequential_read_gb_per_s"] = read_whole(path)  # warm: the whole file resident
    store = open_engram_store(args.dir, store="host", workers=args.workers, advice="normal")
    assert store.rows == (rows, rows) and store.row_bytes == ROW_BYTES
    t = time.perf_counter()
    touched = sum(int(a[::max(1, 4096 // a.shape[1]), 0].sum()) for p in store.tables for a in p)
    result["premap_s"] = time.perf_counter() - t           # every page mapped: steady state
    del touched
    memory = open_engram_store([tuple(np.array(a) for a in p) for p in store.tables],
                               store="host", layer_ids=store.layer_ids)
    for label, st in (() if args.forward_only else (("memmap", store), ("in_memory", memory))):
        result["warm"][label] = {}
        for b in batches:
            steps = max(5, args.warm_tokens // b)
            ids = random_ids(rng, rows, steps, b)
            st.gather(ids[0])
            r = result["warm"][label][b] = summarize(time_gathers(st.gather, ids), b)
            print(f"warm {label:10s} B={b:3d}: {r['us_per_token']:9.1f} us/token "
                  f"{r['gb_per_s']:7.3f} GB/s", flush=True)
    if args.forward or args.forward_only:
        result["forward_like"] = forward_like(
            store, [tuple(jax.numpy.asarray(a) for a in p) for p in memory.tables],
            [int(b) for b in args.forward_batches.split(",")], args.forward_steps, args.seed,
            gate=not args.forward_no_gate)
        gc.collect()
    memory.close()
    del memory
    gc.collect()
    for b in (() if args.forward_only else batches):
        ids = random_ids(rng, rows, 50, b)
        result["device_put"][b] = time_device_put(store, ids)
        result["pipeline"][b] = time_pipeline(store, ids, args.step_ms)
        print(f"warm memmap     B={b:3d}: device_put "
              f"{result['device_put'][b]['us_per_step_median']:.0f} us/step, take waits "
              f"{result['pipeline'][b]['take_wait_us_median']:.0f} us (max "
              f"{result['pipeline'][b]['take_wait_us_max']:.0f}) with a {args.step_ms} ms step",
              flush=True)
    store.close()

    if args.device_store:
        dev = open_engram_store(args.dir, store="device")
        for b in batches:
            steps = max(5, args.warm_tokens // b)
            ids = random_ids(rng, rows, steps, b)
            jax.block_until_ready(dev.gather(ids[0]))

            def gather(step):
                jax.block_until_ready(dev.gather(step))
            result["device_store"][b] = summarize(time_gathers(gather, ids), b)
            print(f"device B={b:3d}: {result['device_store'][b]['us_per_token']:9.1f} us/token",
                  flush=True)
        del dev

    result["load_average_at_end"] = os.getloadavg()
    if not args.keep:
        os.remove(path)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
