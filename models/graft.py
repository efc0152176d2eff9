"""Add the original checkpoint's MTP head to a converted model (`mtp-graft`).

The target's body is never touched. The head is checked against the target
(the same model: hidden size, vocabulary, heads, experts, tied LM head; every
tensor's shape), converted once to the form the loader reads in an MLX
checkpoint (stacked experts, norms shifted exactly once, the body's float
dtype, unquantized unless asked) and written as its own shard; the index and
the config's MTP field are updated and `mtp_graft.json` records where the head
came from. Files are written under temporary names and renamed into place at
the end, the index last; a failure on the way puts back what was there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

import mlx.core as mx
from mlx.utils import tree_flatten

from mtp_serve import __version__

from .loader import empty_head
from .mtp_source import MTPSource, open_source
from .mtp_weights import (
    PROVENANCE_FILE,
    SHIFTED,
    CheckpointError,
    NormFormat,
    declare_mtp_layers,
    detect_norm_format,
    expert_format,
    first_layer_only,
    is_mtp_key,
    mtp_layers_declared,
    sanitize_mtp_weights,
    split_mtp_weights,
    text_config,
)
from .safetensors_files import INDEX_FILE, float_dtype, read_header, read_index, weight_map

log = logging.getLogger("mtp_serve.graft")

HEAD_SHARD = "mtp.safetensors"
CONFIG_FILE = "config.json"
TMP_PREFIX = ".mtp-graft-tmp-"
BAK_PREFIX = ".mtp-graft-bak-"
# Config fields the head depends on: a source and a target that differ in one are different models.
SAME_MODEL_FIELDS = (
    "model_type", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "tie_word_embeddings",
)
QUANTIZED_HEAD_WARNING = ("a quantized MTP head usually loses most of its acceptance (reports: 0-11% at 4 bits "
                          "against ~80% unquantized); check the verify table")


@dataclass
class GraftResult:
    status: str  # "grafted", "replaced" or "unchanged"
    target: Path
    source: MTPSource
    norms: NormFormat
    experts: str
    dtype: str
    tensors: int
    quantized_head: bool
    warnings: List[str] = field(default_factory=list)


def graft(
    source: Union[str, MTPSource],
    target: Path,
    *,
    revision: Optional[str] = None,
    force: bool = False,
    quantize_head: bool = False,
    norms: Optional[str] = None,
) -> GraftResult:
    """Graft the MTP head of `source` (a directory or hub repo) into the MLX model at `target`.

    `norms` ("raw" or "shifted") overrides the detected storage of the source's norms."""
    target = Path(target)
    config = _read_config(target)
    _recover_interrupted(target)
    names = weight_map(target)
    src = source if isinstance(source, MTPSource) else open_source(source, revision)
    check_same_model(src.config, config)
    norm_format, head = convert_head(src, config, norms)
    # The head takes the body's float precision (a bf16 body: a bf16 head).
    dtype = float_dtype(target, {k: f for k, f in names.items() if not is_mtp_key(k)}) or _dtype_name(head)
    head = _cast(head, dtype)
    warnings = list(src.notes)
    quantization = config.get("quantization") or text_config(config).get("quantization")
    if quantize_head:
        if not quantization:
            raise CheckpointError(f"--quantize-head: {target}'s body is not quantized, so there are no bits to match")
        head = _quantize(head, config, quantization)
        warnings.append(f"the head was quantized to {quantization['bits']} bits (--quantize-head): {QUANTIZED_HEAD_WARNING}")
    elif quantization:
        warnings.append(f"the body is quantized ({quantization.get('bits')}-bit) and the head is stored {dtype}; "
                        "mtp-tune chooses the precision it drafts at by measuring acceptance")
    tensors = {f"mtp.{k}": v for k, v in head.items()}
    result = GraftResult("grafted", target, src, norm_format, expert_format(split_mtp_weights(src.tensors)[1]),
                         dtype, len(tensors), quantize_head, warnings)

    existing = sorted(k for k in names if is_mtp_key(k))
    if existing:
        if _holds(target, names, tensors):
            result.status = "unchanged"
            return result
        if not force:
            origin = "grafted by mtp-graft" if (target / PROVENANCE_FILE).exists() else "shipped with the model"
            raise CheckpointError(f"{target} already has a different MTP head ({len(existing)} tensors, {origin}); "
                                  "pass --force to replace it")
        result.status = "replaced"
    _write(target, config, names, tensors, _provenance(result, src))
    return result


def _read_config(target: Path) -> dict:
    path = target / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{target} has no {CONFIG_FILE}: not a model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e


def _field(config: dict, key: str):
    tc = text_config(config)
    value = tc.get(key, config.get(key))
    if key == "model_type" and isinstance(config.get("model_type"), str):
        value = config["model_type"]
    if key == "num_experts" and value is None:
        value = 0
    return value


def check_same_model(source_config: dict, target_config: dict) -> None:
    """Refuse a source that is another model than the target, naming both values."""
    diffs = []
    for key in SAME_MODEL_FIELDS:
        a, b = _field(source_config, key), _field(target_config, key)
        if a is not None and b is not None and a != b:
            diffs.append(f"{key} {a!r} (source) vs {b!r} (target)")
    if diffs:
        raise CheckpointError("the source is a different model than the target: " + "; ".join(diffs))


def convert_head(src: MTPSource, target_config: dict, norms: Optional[str] = None):
    """The source's head in the target's MLX form: (norm format found, {name: tensor})."""
    mtp = split_mtp_weights(src.tensors)[1]
    quantized = sorted(k for k in mtp if k.endswith((".scales", ".weight_scale_inv", ".weight_scale", ".qweight")))
    if quantized:
        raise CheckpointError(f"the MTP head in {src.name} is quantized ({quantized[0]}, ...): graft from the original "
                              "unquantized checkpoint (quantized heads lose most of their acceptance)")
    if mtp_layers_declared(src.config) > 1 or any(k.startswith("layers.1.") for k in mtp):
        log.warning("%s has more than one MTP layer; the first is grafted", src.name)
        mtp = first_layer_only(mtp)
    found = NormFormat(norms, float("nan"), "--norms") if norms else detect_norm_format(mtp, src.layout_hint)
    head = sanitize_mtp_weights(mtp, shift_norms=found.needs_shift)
    module, _ = empty_head(target_config)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(module.parameters())}
    problems = [f"{k}: missing" for k in sorted(expected.keys() - head.keys())]
    problems += [f"{k}: not part of this model's head" for k in sorted(head.keys() - expected.keys())]
    problems += [f"mtp.{k}: shape {list(head[k].shape)} (source) vs {list(s)} (target)"
                 for k, s in sorted(expected.items()) if k in head and tuple(head[k].shape) != s]
    if problems:
        raise CheckpointError(f"the MTP head of {src.name} does not fit the target: " + "; ".join(problems[:6])
                              + ("; ..." if len(problems) > 6 else ""))
    return found, head


def _dtype_name(head: Dict[str, mx.array]) -> str:
    return str(next(v.dtype for v in head.values() if mx.issubdtype(v.dtype, mx.floating))).split(".")[-1]


def _cast(head: Dict[str, mx.array], dtype: Optional[str]) -> Dict[str, mx.array]:
    if dtype is None:
        return head
    target = getattr(mx, dtype)
    return {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in head.items()}


def _quantize(head: Dict[str, mx.array], config: dict, quantization: dict) -> Dict[str, mx.array]:
    """Quantize the head with mlx-lm's own quantizer and the body's settings."""
    from mtp_serve.models.mlx_lm_compat import quantize_model

    module, model = empty_head(config)
    module.load_weights(list(head.items()))
    quantize_model(module, {}, quantization["group_size"], quantization["bits"], mode=quantization.get("mode", "affine"),
                   quant_predicate=getattr(model, "quant_predicate", None))
    return dict(tree_flatten(module.parameters()))


def _holds(target: Path, names: Dict[str, str], tensors: Dict[str, mx.array]) -> bool:
    """Whether the target already holds exactly these head tensors."""
    mine = {k: f for k, f in names.items() if is_mtp_key(k)}
    if mine.keys() != tensors.keys() or set(mine.values()) != {HEAD_SHARD} or not (target / HEAD_SHARD).exists():
        return False
    current = mx.load(str(target / HEAD_SHARD))
    return all(k in current and current[k].dtype == v.dtype and current[k].shape == v.shape
               and mx.array_equal(current[k], v).item() for k, v in tensors.items())


def _provenance(result: GraftResult, src: MTPSource) -> Callable[[Dict[str, mx.array]], dict]:
    def make(written: Dict[str, mx.array]) -> dict:
        return {
            "tool": f"mtp-graft (mtp-serve {__version__})",
            "source": {"name": src.name, "repo": src.repo, "path": None if src.repo else str(src.path),
                       "revision": src.revision, "commit": src.commit, "files": src.files},
            "source_tensors": sorted(src.tensors),
            "norm_format_found": result.norms.stored,
            "norm_statistic": None if result.norms.statistic != result.norms.statistic else round(result.norms.statistic, 4),
            "norm_format_decided_by": result.norms.decided_by,
            "stored_norm_format": SHIFTED,
            "experts": result.experts,
            "dtype": result.dtype,
            "quantized": result.quantized_head,
            "shard": HEAD_SHARD,
            "tensors": {k: hashlib.sha256(memoryview(v)).hexdigest() for k, v in sorted(written.items())},
        }

    return make


# --- writing: stage under temporary names, then rename into place --------------------

def _write(target: Path, config: dict, names: Dict[str, str], tensors: Dict[str, mx.array],
           provenance: Callable[[Dict[str, mx.array]], dict]) -> None:
    if any(f == HEAD_SHARD and not is_mtp_key(k) for k, f in names.items()):
        raise CheckpointError(f"{target}/{HEAD_SHARD} holds body tensors; cannot write the head there")
    staged: Dict[str, Path] = {}
    try:
        shard = staged[HEAD_SHARD] = target / f"{TMP_PREFIX}{HEAD_SHARD}"
        mx.save_safetensors(str(shard), tensors, metadata={"format": "mlx"})
        written = mx.load(str(shard))  # hash what is on disk
        new_names = {k: f for k, f in names.items() if not is_mtp_key(k)}
        new_names.update({k: HEAD_SHARD for k in tensors})
        staged[INDEX_FILE] = _stage_json(target, INDEX_FILE, _index(target, new_names, shard))
        if mtp_layers_declared(config) != 1:
            staged[CONFIG_FILE] = _stage_json(target, CONFIG_FILE, declare_mtp_layers(config, 1))
        staged[PROVENANCE_FILE] = _stage_json(target, PROVENANCE_FILE, provenance(written))
        _commit(target, staged)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)


def _stage_json(target: Path, name: str, data: dict) -> Path:
    tmp = target / f"{TMP_PREFIX}{name}"
    tmp.write_text(json.dumps(data, indent=4) + "\n")
    return tmp


def _index(target: Path, names: Dict[str, str], staged_shard: Path) -> dict:
    old = read_index(target) or {}
    sizes: Dict[str, int] = {}
    for f in sorted(set(names.values())):
        header = read_header(staged_shard if f == HEAD_SHARD else target / f)
        sizes.update({k: m["data_offsets"][1] - m["data_offsets"][0] for k, m in header.items() if k in names})
    metadata = {**old.get("metadata", {}), "total_size": sum(sizes.values())}
    return {"metadata": metadata, "weight_map": dict(sorted(names.items()))}


def _commit(target: Path, staged: Dict[str, Path]) -> None:
    """Rename the staged files into place, the index last (the loader reads through it);
    on any failure remove the new versions and put every replaced file back."""
    backed_up: List[str] = []
    placed: List[str] = []
    bak = lambda name: target / f"{BAK_PREFIX}{name}"  # noqa: E731
    try:
        for name in sorted(staged, key=lambda n: n == INDEX_FILE):
            dst = target / name
            if dst.exists() or dst.is_symlink():
                os.replace(dst, bak(name))
                backed_up.append(name)
            os.replace(staged[name], dst)
            placed.append(name)
    except BaseException:
        for name in reversed(placed):
            (target / name).unlink(missing_ok=True)
        for name in reversed(backed_up):
            os.replace(bak(name), target / name)
        raise
    for name in backed_up:
        bak(name).unlink(missing_ok=True)


def _recover_interrupted(target: Path) -> None:
    """Undo what a killed run left: staged files go, backed-up originals come back."""
    for tmp in target.glob(f"{TMP_PREFIX}*"):
        tmp.unlink()
    for bak in target.glob(f"{BAK_PREFIX}*"):
        name = bak.name[len(BAK_PREFIX):]
        log.warning("%s: restoring %s from an interrupted mtp-graft", target, name)
        os.replace(bak, target / name)
