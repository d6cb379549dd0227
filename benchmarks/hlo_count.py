"""Kernels one execution of a compiled XLA program launches, counted from its optimized HLO.

    compiled = jax.jit(f).lower(*args).compile()
    report = hlo_count.count_compiled(compiled, layers=cfg.num_hidden_layers)

Model (works on the XLA:CPU and the XLA:GPU texts alike): the executed computations are the
entry, the bodies and conditions of `while` loops, the branches of `conditional`s and the
targets of `call`s (command buffers included). In those, every instruction is one kernel
launch except bookkeeping (parameter, constant, tuple, get-tuple-element, bitcast, the
control ops themselves, the `-done` half of an async pair). Fused computations are not
entered: a fusion is one kernel. A while body counts `trip count` times (the
`known_trip_count` XLA writes in its backend_config; unknown: once, flagged per-iteration),
its condition `trip count + 1` times; a conditional counts its largest branch.

Bytes: `bytes_written` sums the result arrays of every launch (an async start's result, not
its operands), by source as well: what the kernels write, a device-free lower bound of the
traffic that points at the passes worth fusing.

Categories: fusion kinds (loop/input/output), gemm (cuBLAS custom calls, Triton and
XLA:CPU/oneDNN/YNN gemm fusions, unfused `dot`), mosaic (Mosaic GPU/TPU and Pallas Triton
custom calls), other custom calls, and the unfused opcode for everything else (copy, sort,
scatter, gather, dynamic-update-slice, concatenate, reduce, ...).

Per layer: with a scanned layer stack (a while loop whose trip count is the number of layer
groups) the loop body per iteration divided by the layers per group; for an unrolled stack
the total divided by the layers (`layers`), and a breakdown by the source file of each
kernel's root op (stack-frame metadata), which separates mHC, attention, compressor,
indexer and MoE kernels without any layer scope in the program.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from typing import Any

NON_KERNEL = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional",
    "call", "after-all", "opt-barrier", "add-dependency", "partition-id", "replica-id",
    "domain", "get-dimension-size", "set-dimension-size",
})
GEMM_CUSTOM_CALLS = ("__cublas", "__cudnn$matmul", "__onednn$matmul", "__onednn$fusedmatmul")
MOSAIC_CUSTOM_CALLS = ("mosaic_gpu", "tpu_custom_call", "__gpu$xla.gpu.triton",
                       "triton_kernel_call")
GEMM_FUSION_KINDS = ("__triton_gemm", "__ynn_fusion", "__onednn", "__cublas", "__cudnn",
                     "__triton_nested_gemm_fusion", "__triton_scaled_dot_fusion")

# A kernel is attributed to the innermost model file of its root op's call stack (under these
# prefixes), skipping helpers whose kernels belong to their caller.
COMPONENT_PREFIXES = ("deepinfer_fn/model/", "custom_calls/", "deepinfer_fn/engine/",
                      "deepinfer_fn/speculative/")
HELPER_FILES = ("deepinfer_fn/model/common.py", "deepinfer_fn/model/rope.py",
                "deepinfer_fn/kernels.py")

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-$]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-$]+)\s*=\s*(.*)$")
_FRAME = re.compile(r"^(\d+)\s*\{(.*)\}\s*$")


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    text: str

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=(%?[\w.\-$]+)", self.text)
        return m.group(1).lstrip("%") if m else None

    def attr_list(self, key: str) -> list[str]:
        m = re.search(rf"\b{re.escape(key)}=\{{([^}}]*)\}}", self.text)
        return [s.strip().lstrip("%") for s in m.group(1).split(",")] if m else []


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    frames: dict[int, tuple[str, ...]]   # stack_frame_id -> files of its call stack, innermost first
    frame_lines: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # the same stacks as "file:line"
    roots: dict[str, str] = dataclasses.field(default_factory=dict)   # computation -> ROOT name


def _opcode(rhs: str) -> str:
    """The opcode of an instruction's right-hand side `shape opcode(operands), attrs`."""
    rest = rhs.lstrip()
    if rest.startswith("("):            # tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    return m.group(1) if m else "?"


def parse(text: str) -> Module:
    """Computations (name -> instructions), the entry's name, and the stack-frame files."""
    comps: dict[str, list[Instr]] = {}
    roots: dict[str, str] = {}
    entry = None
    current = None
    section = None
    files: dict[int, str] = {}
    locations: dict[int, int] = {}
    line_of: dict[int, int] = {}
    frames_raw: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = stripped
                continue
            m = _COMP_HEADER.match(stripped)
            if m and not stripped.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
                section = None
                continue
            fm = _FRAME.match(stripped)
            if section == "FileNames":
                m2 = re.match(r'^(\d+)\s+"(.*)"$', stripped)
                if m2:
                    files[int(m2.group(1))] = m2.group(2)
            elif section == "FileLocations" and fm:
                f = re.search(r"file_name_id=(\d+)", fm.group(2))
                ln = re.search(r"\bline=(\d+)", fm.group(2))
                locations[int(fm.group(1))] = int(f.group(1)) if f else 0
                line_of[int(fm.group(1))] = int(ln.group(1)) if ln else 0
            elif section == "StackFrames" and fm:
                loc = re.search(r"file_location_id=(\d+)", fm.group(2))
                par = re.search(r"parent_frame_id=(\d+)", fm.group(2))
                frames_raw[int(fm.group(1))] = (int(loc.group(1)) if loc else 0,
                                                int(par.group(1)) if par else 0)
            continue
        if stripped == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(Instr(m.group(2), _opcode(m.group(3)), m.group(3)))
            if m.group(1):
                roots[current] = m.group(2)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    frames, frame_lines = {}, {}
    for fid in frames_raw:       # printed parent_frame_id p names frame p - 1 (0: none)
        chain, lines, f = [], [], fid
        while f in frames_raw and len(chain) < 64:
            loc, parent = frames_raw[f]
            chain.append(files.get(locations.get(loc, 0), ""))
            lines.append(f"{_short(chain[-1])}:{line_of.get(loc, 0)}" if chain[-1] else "")
            f = parent - 1 if 0 < parent - 1 < f else 0
        frames[fid] = tuple(chain)
        frame_lines[fid] = tuple(lines)
    return Module(comps, entry, frames, frame_lines, roots)


def _backend_config(ins: Instr) -> dict:
    i = ins.text.find("backend_config=")
    if i < 0:
        return {}
    s = ins.text[i + len("backend_config="):]
    if s.startswith("{"):
        depth = 0
        for j, ch in enumerate(s):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                try:
                    return json.loads(s[:j + 1])
                except json.JSONDecodeError:
                    return {}
    return {}


def trip_count(ins: Instr) -> int | None:
    """The while loop's trip count XLA proved (backend_config known_trip_count), else None."""
    n = _backend_config(ins).get("known_trip_count", {}).get("n")
    if n is None:
        m = re.search(r'known_trip_count[^0-9]*"?n"?\s*[:=]\s*"?(\d+)', ins.text)
        n = m.group(1) if m else None
    return int(n) if n is not None else None


def category(ins: Instr) -> str:
    """The kernel category of one launching instruction."""
    op = ins.opcode
    if op == "fusion":
        cfg = _backend_config(ins)
        kind = (cfg.get("fusion_backend_config") or cfg.get("fusion_config") or {}).get("kind", "")
        if any(kind.startswith(k) for k in GEMM_FUSION_KINDS) or "gemm" in kind:
            return "gemm"
        if kind:
            return f"fusion:{kind.lstrip('_')}"
        return f"fusion:{(ins.attr('kind') or 'k?')[1:].lower()}"
    if op == "custom-call":
        target = (ins.attr("custom_call_target") or "").strip('"')
        m = re.search(r'custom_call_target="([^"]*)"', ins.text)
        target = m.group(1) if m else target
        if target.startswith(GEMM_CUSTOM_CALLS):
            return "gemm"
        if target.startswith(MOSAIC_CUSTOM_CALLS):
            return "mosaic"
        return f"custom-call:{target}"
    if op in ("dot", "convolution"):
        return "gemm"
    if op.endswith("-start"):
        return op[:-len("-start")]
    return op


def _launches(ins: Instr) -> bool:
    return ins.opcode not in NON_KERNEL and not ins.opcode.endswith("-done") \
        and ins.opcode not in ("async-update",)


@dataclasses.dataclass
class Loop:
    name: str
    trip_count: int | None
    body_per_iter: int                   # kernels of one body (+ condition) iteration
    body_categories: dict[str, int]
    depth: int


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    for anchor in ("deepinfer_fn", "custom_calls", "benchmarks", "shardings"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return parts[-1]


def _source(ins: Instr, mod: Module) -> str:
    """The model component a kernel comes from: the innermost file of its root op's call
    stack under COMPONENT_PREFIXES that is not a helper, else the innermost file."""
    m = re.search(r"stack_frame_id=(\d+)", ins.text)
    chain = [_short(f) for f in mod.frames.get(int(m.group(1)), ()) if f] if m else []
    if not chain:
        return "?"
    for f in chain:
        if f.startswith(COMPONENT_PREFIXES) and f not in HELPER_FILES:
            return f
    return chain[0]


def source_line(ins: Instr, mod: Module, depth: int = 2) -> str:
    """The model lines an instruction comes from: its innermost `depth` frames under
    COMPONENT_PREFIXES outside HELPER_FILES, "file:line <- file:line" ("?" if none)."""
    m = re.search(r"stack_frame_id=(\d+)", ins.text)
    lines = mod.frame_lines.get(int(m.group(1)), ()) if m else ()
    keep = [ln for ln in lines if ln.startswith(COMPONENT_PREFIXES)
            and ln.rsplit(":", 1)[0] not in HELPER_FILES]
    return " <- ".join(keep[:depth]) or "?"


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def _top_level_parts(shape: str) -> list[str]:
    """The top-level elements of a tuple shape "(a, (b, c), d)" (a plain shape: itself)."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, cur = [], 0, ""
    for ch in shape[1:-1]:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch in "({["
        depth -= ch in ")}]"
        cur += ch
    return parts + [cur]


def output_bytes(ins: Instr) -> int:
    """Bytes of the arrays an instruction produces (what its kernel writes). An async `-start`
    op's tuple also holds its operands: only its result counts (the first element of a
    `copy-start`, the element after the operand tuple of the others)."""
    shape = ins.text.split(f" {ins.opcode}(", 1)[0]
    if ins.opcode.endswith("-start"):
        parts = _top_level_parts(shape)
        shape = parts[1] if parts[0].strip().startswith("(") and len(parts) > 1 else parts[0]
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(x) for x in dims.split(",") if x)
    return total


# In-place roots of a fusion (XLA:GPU emits them into their operand's buffer): the operand
# index of what they write.
_IN_PLACE_UPDATE = {"dynamic-update-slice": 1, "scatter": 2}


def written_bytes(ins: Instr, mod: Module) -> int:
    """`output_bytes`, except for a fusion whose root updates its operand in place (a
    dynamic-update-slice or a scatter): the bytes of the update it writes (at most the
    result's)."""
    comp = ins.attr("calls") if ins.opcode == "fusion" else None
    body = {i.name: i for i in mod.computations.get(comp, [])} if comp else {}
    root = body.get(mod.roots.get(comp, ""))
    if root is None or root.opcode not in _IN_PLACE_UPDATE:
        return output_bytes(ins)
    args = root.text.split(f"{root.opcode}(", 1)[1]
    names = re.findall(r"%([\w.\-$]+)", args.split(")", 1)[0])
    update = body.get(names[_IN_PLACE_UPDATE[root.opcode]]) if len(names) > 2 else None
    # (a scatter's updates may hold rows it drops: out-of-bounds indices)
    return min(output_bytes(update), output_bytes(ins)) if update is not None \
        else output_bytes(ins)


def _walk(mod: Module, comp: str, mult: int, acc, loops: list, depth: int, seen: tuple):
    """Adds comp's kernels (times mult) to acc = (categories, sources[, bytes by source]);
    recurses into control."""
    if comp in seen:
        raise ValueError(f"recursive computation {comp}")
    total = 0
    for ins in mod.computations.get(comp, []):
        if ins.opcode == "while":
            body, cond = ins.attr("body"), ins.attr("condition")
            n = trip_count(ins)
            k = n if n is not None else 1
            sub = (collections.Counter(), collections.Counter())
            per_body = _walk(mod, body, 1, sub, loops, depth + 1, seen + (comp,))
            per_cond = _walk(mod, cond, 1, sub, loops, depth + 1, seen + (comp,))
            loops.append(Loop(ins.name, n, per_body + per_cond, dict(sub[0]), depth))
            _walk(mod, body, mult * k, acc, [], depth + 1, seen + (comp,))
            _walk(mod, cond, mult * (k + 1), acc, [], depth + 1, seen + (comp,))
            total += per_body * k + per_cond * (k + 1)
        elif ins.opcode == "conditional":
            branches = ins.attr_list("branch_computations") or \
                [b for b in (ins.attr("true_computation"), ins.attr("false_computation")) if b]
            counts = []
            for b in branches:
                sub = (collections.Counter(), collections.Counter())
                counts.append((_walk(mod, b, 1, sub, [], depth + 1, seen + (comp,)), b))
            if counts:
                best = max(counts)[1]
                total += _walk(mod, best, mult, acc, loops, depth + 1, seen + (comp,))
        elif ins.opcode in ("call", "async-start") and ins.attr("to_apply") or \
                ins.opcode == "async-start" and ins.attr("calls"):
            target = ins.attr("to_apply") or ins.attr("calls")
            total += _walk(mod, target, mult, acc, loops, depth + 1, seen + (comp,))
        elif _launches(ins):
            acc[0][category(ins)] += mult
            src = _source(ins, mod)
            acc[1][src] += mult
            if len(acc) > 2:
                acc[2][src] += mult * written_bytes(ins, mod)
            total += 1
    return total


def count_text(text: str, layers: int | None = None, layers_per_iteration: int | None = None
               ) -> dict[str, Any]:
    """Kernel counts of one execution of the program whose optimized HLO is `text`.

    layers: the layer count of a model program (gives kernels_per_layer = total / layers);
    layers_per_iteration: layers one iteration of the outermost while loop runs (a scanned
    layer stack), giving per_layer_in_loop = loop body per iteration / layers_per_iteration.
    """
    mod = parse(text)
    acc = (collections.Counter(), collections.Counter(), collections.Counter())
    loops: list[Loop] = []
    total = _walk(mod, mod.entry, 1, acc, loops, 0, ())
    out = {
        "kernels": total,
        "by_category": dict(sorted(acc[0].items(), key=lambda kv: -kv[1])),
        "by_source": dict(sorted(acc[1].items(), key=lambda kv: -kv[1])),
        # Bytes the kernels write (their result arrays, each launch counted; in-place updates
        # by their update): a lower bound of the program's HBM traffic that needs no device.
        "bytes_written": sum(acc[2].values()),
        "bytes_written_by_source": dict(sorted(acc[2].items(), key=lambda kv: -kv[1])),
        "loops": [dataclasses.asdict(lp) for lp in loops],
        "per_iteration_only": any(lp.trip_count is None for lp in loops),
        "hlo_instructions": sum(len(v) for v in mod.computations.values()),
    }
    if layers:
        out["kernels_per_layer"] = total / layers
    if layers_per_iteration and loops:
        outer = [lp for lp in loops if lp.depth == min(l.depth for l in loops)]
        big = max(outer, key=lambda lp: lp.body_per_iter)
        out["per_layer_in_loop"] = big.body_per_iter / layers_per_iteration
        out["outside_loop"] = total - big.body_per_iter * (big.trip_count or 1)
    return out


def cost(compiled) -> dict[str, float]:
    """XLA's cost analysis of a compiled program: flops, bytes accessed, transcendentals."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {k: float(ca[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in ca}


def count_compiled(compiled, layers: int | None = None,
                   layers_per_iteration: int | None = None) -> dict[str, Any]:
    """count_text of `compiled.as_text()` plus XLA's cost analysis under "cost"."""
    out = count_text(compiled.as_text(), layers, layers_per_iteration)
    out["cost"] = cost(compiled)
    return out


def summary(report: dict[str, Any], top: int = 8) -> str:
    """One line: total, per layer, the largest categories."""
    cats = ", ".join(f"{k} {v}" for k, v in list(report["by_category"].items())[:top])
    per = f" ({report['kernels_per_layer']:.1f}/layer)" if "kernels_per_layer" in report else ""
    return f"{report['kernels']} kernels{per}: {cats}"
