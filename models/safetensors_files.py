"""Which tensors a checkpoint directory holds, and where, without loading them.

`model.safetensors.index.json` maps tensor names to shard files; a directory
without one is described by its shards' headers (the JSON at the start of
every safetensors file).
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Dict, Optional

INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
MLX_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def read_header(path: Path) -> Dict[str, dict]:
    """{tensor name: {"dtype": "BF16", "shape": [...], ...}} plus "__metadata__" if present."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read_index(model_dir: Path) -> Optional[dict]:
    path = Path(model_dir) / INDEX_FILE
    if not path.exists():
        return None
    index = json.loads(path.read_text())
    if not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"{path}: no weight_map")
    return index


def weight_map(model_dir: Path) -> Dict[str, str]:
    """Tensor name -> shard file name, from the index or from the shards' headers."""
    index = read_index(model_dir)
    if index is not None:
        return dict(index["weight_map"])
    out: Dict[str, str] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update({k: f.name for k in read_header(f) if k != "__metadata__"})
    return out


def float_dtype(model_dir: Path, names: Dict[str, str]) -> Optional[str]:
    """The MLX name of the floating dtype most of the listed tensors use
    (a quantized model's scales and norms; A_log, kept fp32, is left out)."""
    counts: Counter = Counter()
    for shard in sorted(set(names.values())):
        for k, meta in read_header(Path(model_dir) / shard).items():
            if k in names and not k.endswith("A_log") and meta["dtype"] in _FLOAT_DTYPES:
                counts[meta["dtype"]] += 1
    return MLX_DTYPE_NAMES.get(counts.most_common(1)[0][0]) if counts else None


def layout_format(header: Dict[str, dict]) -> Optional[str]:
    """`"pt"` for files written by PyTorch/transformers, `"mlx"` by MLX; else None."""
    return (header.get("__metadata__") or {}).get("format")
