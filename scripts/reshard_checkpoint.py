"""Re-shards an HF-format checkpoint directory in place into files of at most N MB
(model-0000k-of-0000n.safetensors + model.safetensors.index.json), tensors unchanged.

    python scripts/reshard_checkpoint.py DIR --max-shard-mb 12
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from deepinfer_fn.checkpoint.safetensors_io import SafetensorsFile, save_file  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--max-shard-mb", type=float, default=12)
    args = ap.parse_args()
    src = [f for f in sorted(os.listdir(args.dir)) if f.startswith("model") and f.endswith(".safetensors")]
    tensors = {}
    for f in src:
        st = SafetensorsFile(os.path.join(args.dir, f))
        tensors.update({k: np.array(st.get(k)) for k in st.keys()})
    limit = args.max_shard_mb * 2**20
    shards, size = [{}], 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    for f in src:
        os.remove(os.path.join(args.dir, f))
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(args.dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    with open(os.path.join(args.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                   "weight_map": weight_map}, f, indent=1)
    print(f"{len(tensors)} tensors -> {len(shards)} shards")


if __name__ == "__main__":
    main()
