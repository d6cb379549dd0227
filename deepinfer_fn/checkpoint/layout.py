"""The official checkpoint inventory of a config: every tensor's name, shape, storage dtype and
shard, computed from the weight specs without allocating anything (docs/MODEL.md §5.2, §V6).

Storage formats (quantized, as the official release stores them):

* FP8 dense matrix `[o, i]`: `F8_E4M3 [o, i]` + `.scale` `F8_E8M0 [ceil(o/b0), ceil(i/b1)]`
  (`weight_block_size`: V4 128 x 128, V4.1 32 x 32).
* FP4 routed expert `[o, i]`: `I8 [o, i/2]` (two nibbles per byte) + `.scale` `F8_E8M0 [o, i/32]`.
* V4.1 Engram table: `F8_E4M3 [rows, W]` and its `F8_E8M0 [rows, W/32]` (separate specs).
* BF16 / F32 / I64 as the spec's format says. Unquantized (`quantized=False`, what
  `save_params(quantize=False)` writes): every float weight F32, no scales; the Engram tables
  stay FP8 (they are held as FP8 bytes).

V4.1 shard layout (`shard_groups`): one shard per group, in this order, empty groups left
out: the embedding; the vision tower, aligner and image_* embeddings; each backbone layer
(without its Engram table); each DSpark stage `mtp.k` (the drafter's extra tensors with the
stage they are named under); the final norm and the head; each Engram table with its scales.
For `v4.1-flash` that is 1 + 1 + 40 + 3 + 1 + 2 = 48 shards, the tables in shards 47-48 (§V6.1).
The assignment of the other tensors to shards is ours (the spec fixes only the count and
where the tables are); loading never depends on it, the index's `weight_map` is read.

Vision tower names (§V2.10, 266 tensors with the aligner and image_*): the spec fixes the
`vision.` prefix, `attn.wqkv` and `attn.wo`, the shapes and the count (8 tensors per block);
the remaining leaf names (`patch_embed`, `blocks.{b}`, `attn_norm`, `ffn_norm`, the fused
gate/up `ffn.w13`, `norm`) are our assumption. They are listed, never loaded (text only).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from deepinfer_fn.checkpoint.names import is_vision_name, scale_name
from deepinfer_fn.config import ModelConfig
from deepinfer_fn.params import (BF16, E8M0, F32, FP4, FP8, FP8_CODES, I64, Spec, ckpt_prefixes,
                                 is_spec, param_specs, per_layer)

ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1,
            "F8_E4M3": 1, "F8_E8M0": 1}
_PLAIN = {BF16: "BF16", F32: "F32", I64: "I64", FP8_CODES: "F8_E4M3", E8M0: "F8_E8M0"}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor. `shape` is the stored shape (FP4: packed bytes); `logical` is
    the number of model values it holds (FP4: two per byte; 0 for scales)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    logical: int
    shard: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


# ------------------------------------------------------------------------------- shapes
def checkpoint_shape(spec: Spec) -> tuple[int, ...]:
    """Shape of the (per-expert) checkpoint tensor a spec is stored as, logical elements."""
    if spec.layout == "linear":
        return spec.shape[::-1]
    if spec.layout == "experts":
        return (spec.shape[2], spec.shape[1])
    if spec.layout == "grouped":
        g, i, r = spec.shape
        return (g * r, i)
    return spec.shape


def tensor_names(spec: Spec, prefix: str) -> list[str]:
    """The checkpoint name(s) of one (unstacked) spec: one per expert for routed experts."""
    if spec.layout == "experts":
        return [prefix + spec.ckpt.format(e=e) for e in range(spec.shape[0])]
    return [prefix + spec.ckpt]


def fp8_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(o/b0), ceil(i/b1)]: the UE8M0 scale grid of an FP8 [o, i] weight."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def fp4_scale_shape(shape: tuple[int, int], group: int) -> tuple[int, int]:
    """[o, ceil(i/group)]: the UE8M0 scales of an FP4 [o, i] (logical) weight."""
    return (shape[0], -(-shape[1] // group))


def stored(spec: Spec, name: str, cfg: ModelConfig, quantized: bool = True) -> list[Tensor]:
    """The tensor(s) one checkpoint weight is stored as: the weight, then its scale if any."""
    shape = checkpoint_shape(spec)
    n = math.prod(shape)
    if quantized and spec.fmt == FP8:
        return [Tensor(name, shape, "F8_E4M3", n),
                Tensor(scale_name(name), fp8_scale_shape(shape, cfg.fp8_block), "F8_E8M0", 0)]
    if quantized and spec.fmt == FP4:
        assert shape[1] % 2 == 0, (name, shape)
        return [Tensor(name, (shape[0], shape[1] // 2), "I8", n),
                Tensor(scale_name(name), fp4_scale_shape(shape, cfg.fp4_group), "F8_E8M0", 0)]
    if spec.fmt == E8M0:
        return [Tensor(name, shape, "F8_E8M0", 0)]
    if quantized or spec.fmt in (FP8_CODES, I64):
        return [Tensor(name, shape, _PLAIN[spec.fmt], n)]
    return [Tensor(name, shape, "F32", n)]


# ------------------------------------------------------------------------------- vision
def vision_tensors(cfg: ModelConfig) -> list[Tensor]:
    """The vision tower, aligner and image_* tensors of a V4.1 config (module docstring);
    empty without a vision tower. All BF16 (§V7: 485,268,480 BF16 values = 970,536,960 bytes
    in the public manifest)."""
    if not cfg.vision_num_hidden_layers:
        return []
    d, f, p = cfg.vision_hidden_size, cfg.vision_intermediate_size, cfg.vision_patch_size
    D, k = cfg.hidden_size, cfg.vision_downsample_ratio

    def t(name, shape, dtype="BF16"):
        return Tensor(name, tuple(shape), dtype, math.prod(shape))

    out = [t("vision.patch_embed.weight", (d, 3 * p * p)), t("vision.patch_embed.bias", (d,))]
    for b in range(cfg.vision_num_hidden_layers):
        pre = f"vision.blocks.{b}."
        out += [t(pre + "attn_norm.weight", (d,)),
                t(pre + "attn.wqkv.weight", (3 * d, d)), t(pre + "attn.wqkv.bias", (3 * d,)),
                t(pre + "attn.wo.weight", (d, d)), t(pre + "attn.wo.bias", (d,)),
                t(pre + "ffn_norm.weight", (d,)),
                t(pre + "ffn.w13.weight", (2 * f, d)), t(pre + "ffn.w2.weight", (d, f))]
    out.append(t("vision.norm.weight", (d,)))
    out += [t("aligner.w1.weight", (D, k * k * d)), t("aligner.w1.bias", (D,)),
            t("aligner.w2.weight", (D, D)), t("aligner.w2.bias", (D,))]
    out += [t(f"image_{w}", (D,)) for w in ("start", "end", "newline")]
    return out


# ------------------------------------------------------------------------------- shards
_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.")


def shard_groups(cfg: ModelConfig, include_mtp: bool = True) -> list[str]:
    """The V4.1 shard groups in file order (module docstring); group k is shard k + 1 when
    all are present."""
    groups = ["embed", "vision"]
    groups += [f"layers.{i}" for i in range(cfg.num_hidden_layers)]
    groups += [f"mtp.{k}" for k in range(cfg.num_mtp_layers if include_mtp else 0)]
    groups += ["head"]
    groups += [f"engram_table.{layer}" for layer in cfg.engram_layer_ids]
    return groups


def shard_group(name: str) -> str:
    """The shard group of an official V4.1 tensor name."""
    if name == "embed.weight":
        return "embed"
    if is_vision_name(name):
        return "vision"
    if name in ("head.weight", "norm.weight"):
        return "head"
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"tensor {name!r} belongs to no V4.1 shard group")
    if name.endswith((".engram.embed.weight", ".engram.embed.scale")):
        return f"engram_table.{m.group(2)}"
    return f"{m.group(1)}.{m.group(2)}"


def shard_file(k: int, n: int) -> str:
    """`model-000kk-of-000nn.safetensors` (k 1-based)."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


# ------------------------------------------------------------------------------- inventory
def weight_tensors(cfg: ModelConfig, include_mtp: bool = True,
                   quantized: bool = True) -> list[Tensor]:
    """Every stored tensor of the model's weights (official names, param-spec order)."""
    specs = param_specs(cfg, include_mtp=include_mtp)
    prefixes = ckpt_prefixes(cfg, specs)
    out = []
    for spec, prefix in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(prefixes)):
        for s, p in per_layer(spec, prefix):
            for name in tensor_names(s, p):
                out += stored(s, name, cfg, quantized)
    return out


def inventory(cfg: ModelConfig, include_mtp: bool = True, quantized: bool = True,
              vision: bool = True) -> list[Tensor]:
    """The whole V4.1 checkpoint: weights (+ scales), the vision tensors when `vision` and the
    config has a tower, each with its 1-based shard number (`shard_groups`, empty groups left
    out)."""
    assert cfg.is_v41, "the sharded inventory is the V4.1 layout"
    tensors = weight_tensors(cfg, include_mtp, quantized)
    if vision:
        tensors += vision_tensors(cfg)
    used = {shard_group(t.name) for t in tensors}
    order = [g for g in shard_groups(cfg, include_mtp) if g in used]
    assert used == set(order), sorted(used - set(order))
    number = {g: k + 1 for k, g in enumerate(order)}
    return [dataclasses.replace(t, shard=number[shard_group(t.name)]) for t in tensors]


def index_json(tensors: list[Tensor]) -> dict:
    """`model.safetensors.index.json` of an inventory: total bytes and the weight map."""
    n = max(t.shard for t in tensors)
    return {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: shard_file(t.shard, n) for t in tensors}}
