"""Keep a checkpoint's vision tower through `mtp-convert`.

mlx-lm's convert drops the tower (its text model's sanitize skips `model.visual.*`),
`vision_config` and preprocessor_config.json. This puts them back into the converted
directory: the tower as its own shard `vision.safetensors` under mlx-vlm's names
(`vision_tower.*`, Conv3d in MLX layout), in the body's float dtype and never quantized
(a quantized tower costs image quality for little: it runs once per image), the index
updated, `vision_config` restored in config.json and the processor files copied. Stock
mlx-lm still loads the result (it reads only model*.safetensors and skips the tower).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx

from mtp_serve.models.safetensors_files import INDEX_FILE, float_dtype, read_index, weight_map
from mtp_serve.models.vision.loader import TOWER_PREFIXES, conv_to_mlx

VISION_SHARD = "vision.safetensors"
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
CONFIG_KEYS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _source_file(source, name: str, missing_ok: bool = False) -> Optional[Path]:
    local = Path(source.path) / name
    if local.exists() or source.repo is None:
        return local if local.exists() else None
    from mtp_serve.models.mtp_source import _hub_file  # a repo file convert did not fetch (processor configs)
    from mtp_serve.models.mtp_weights import CheckpointError

    try:
        return _hub_file(source.repo, name, source.revision, missing_ok=missing_ok)
    except CheckpointError:
        if missing_ok:  # offline and not cached
            return None
        raise


def source_tower(source) -> Dict[str, mx.array]:
    """The source's tower tensors, renamed to `vision_tower.*` with the conv in MLX layout."""
    # The source's index (or, without one, its shards' headers): convert has downloaded them.
    names = {k: f for k, f in weight_map(Path(source.path)).items() if k.startswith(TOWER_PREFIXES)}
    in_channels = int(source.config.get("vision_config", {}).get("in_channels", 3))
    out: Dict[str, mx.array] = {}
    for shard in sorted(set(names.values())):
        tensors = mx.load(str(_source_file(source, shard)))
        for key, value in tensors.items():
            if names.get(key) != shard:
                continue
            prefix = next(p for p in TOWER_PREFIXES if key.startswith(p))
            name = "vision_tower." + key[len(prefix):]
            if name.endswith("patch_embed.proj.weight"):
                value = conv_to_mlx(value, in_channels)
            out[name] = value
    return out


def carry_vision(source, target: Path, dtype: Optional[str] = None) -> int:
    """Write the source's tower, config and processor files into the converted `target`.
    Returns how many tensors were written (0: the source has no tower; nothing changes)."""
    target = Path(target)
    if not source.config.get("vision_config"):
        return 0
    tower = source_tower(source)
    if not tower:
        return 0
    if any(k.endswith(".scales") for k in tower):
        raise ValueError(f"the vision tower in {source.name} is quantized; convert from the original checkpoint")
    names = weight_map(target)
    dtype = dtype or float_dtype(target, names) or "float32"
    cast = getattr(mx, dtype)
    tower = {k: v.astype(cast) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tower.items()}
    mx.save_safetensors(str(target / VISION_SHARD), tower, metadata={"format": "mlx"})

    index = read_index(target) or {"metadata": {}, "weight_map": dict(names)}
    index["weight_map"] = dict(sorted({**{k: f for k, f in index["weight_map"].items() if f != VISION_SHARD},
                                       **{k: VISION_SHARD for k in tower}}.items()))
    total = index.get("metadata", {}).get("total_size")
    if total is not None:
        index["metadata"]["total_size"] = total + sum(v.nbytes for v in tower.values())
    (target / INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n")

    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config.update({k: source.config[k] for k in CONFIG_KEYS if k in source.config and k not in config})
    config_path.write_text(json.dumps(config, indent=4) + "\n")
    for name in PROCESSOR_FILES:
        f = _source_file(source, name, missing_ok=True)
        if f is not None and not (target / name).exists():
            shutil.copy(f, target / name)
    return len(tower)
