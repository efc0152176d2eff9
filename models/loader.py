"""Load a Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint together with its MTP head.

Stock mlx-lm globs `model*.safetensors` and drops every `mtp.*` tensor. Here
shards are resolved through `model.safetensors.index.json` (so an MTP shard
such as `mtp.safetensors` is found), the backbone goes through mlx-lm's own
`sanitize` and classes, and the `mtp.*` tensors are renamed for `MTPHead`
in one place (`sanitize_mtp_weights`). Both raw Hugging Face layout and
mlx-lm converted layout load.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mtp_serve import BACKEND

from .gdn import install_capturing_gdn
from .mlx_lm_compat import (
    Qwen35DecoderLayer,
    Qwen3NextDecoderLayer,
    TokenizerWrapper,
    get_model_classes,
    infer_quant_config,
    load_tokenizer,
)
from .model_card import ModelCard, load_card
from .mtp_head import MTPHead
from .mtp_model import MTPModel

log = logging.getLogger("mtp_serve.loader")

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"]
MTP_PREFIX = re.compile(r"^(?:model\.)?(?:language_model\.)?mtp\.")
# The seven one-dimensional Gemma-style (1 + w) norms of the head.
MTP_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the cause."""


@dataclass
class LoadedModel:
    model: MTPModel
    tokenizer: TokenizerWrapper
    config: dict
    path: Path
    mtp_status: str  # one line: why MTP is or is not available

    @property
    def card(self) -> ModelCard:
        return self.model.card


def resolve_model_path(path_or_repo: str, revision: Optional[str] = None) -> Path:
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} has no config.json: not a model directory")
        return path
    if path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise CheckpointError(f"model not found: {path_or_repo} is neither a directory nor a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path_or_repo, revision=revision, allow_patterns=DOWNLOAD_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise CheckpointError(f"model not found: could not get {path_or_repo} from the Hugging Face hub or its cache ({type(e).__name__})") from e


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors weights found")
    return files


def load_weights(path: Path) -> Dict[str, mx.array]:
    weights: Dict[str, mx.array] = {}
    for f in weight_files(path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError for corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors file: {e}") from e
    return weights


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def mtp_layers_declared(config: dict) -> int:
    tc = text_config(config)
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        for src in (tc, config):
            if key in src:
                return int(src[key] or 0)
    return 0


def split_mtp_weights(weights: Dict[str, mx.array]) -> Tuple[dict, dict]:
    backbone, mtp = {}, {}
    for k, v in weights.items():
        m = MTP_PREFIX.match(k)
        if m:
            mtp[k[m.end():]] = v
        else:
            backbone[k] = v
    return backbone, mtp


def is_raw_hf_layout(weights: Dict[str, mx.array]) -> bool:
    """Raw HF checkpoints store conv1d as [C, 1, K]; mlx-lm layout as [C, K, 1]."""
    return any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())


def sanitize_mtp_weights(mtp: Dict[str, mx.array], raw_hf: bool) -> Dict[str, mx.array]:
    """Rename `mtp.*` tensors (prefix already stripped) for MTPHead.

    Raw HF norms are zero-centred (y = x_hat * (1 + w)): add 1 exactly once,
    only for raw layout. MoE experts come per expert (Qwen3.5, Qwen3-Next) or
    fused as `experts.gate_up_proj` / `experts.down_proj` (Qwen3.6).
    """
    out: Dict[str, mx.array] = {}
    per_expert: Dict[Tuple[str, str], Dict[int, mx.array]] = {}
    for k, v in mtp.items():
        m = re.match(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m:
            per_expert.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
            continue
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix = k[: -len(".experts.gate_up_proj")]
            mid = v.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = v[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = v[..., mid:, :]
            continue
        if k.endswith(".mlp.experts.down_proj"):
            out[k.replace(".experts.down_proj", ".switch_mlp.down_proj.weight")] = v
            continue
        if raw_hf and v.ndim == 1 and (k == "norm.weight" or k.endswith(MTP_NORM_SUFFIXES)):
            v = v + 1.0
        out[k] = v
    for (prefix, proj), experts in per_expert.items():
        n = max(experts) + 1
        if sorted(experts) != list(range(n)):
            raise CheckpointError(f"mtp.{prefix}.experts: expert tensors for {proj} are not numbered 0..{n - 1}")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(n)])
    return out


def _quantize_like_weights(module: nn.Module, weights: dict, quantization: Optional[dict]) -> None:
    """Quantize exactly the layers whose weights come with `.scales` (mlx-lm layout)."""
    if not quantization or not any(k.endswith(".scales") for k in weights):
        return

    def predicate(p, m):
        if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
            return False
        return infer_quant_config(p, m, weights)

    nn.quantize(
        module,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def _load_strict(module: nn.Module, weights: dict, what: str, path: Path) -> None:
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{path}: {what} weights do not match the config: {e}") from e


def _build(config: dict) -> Tuple[nn.Module, nn.Module, type]:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    if model_type == "qwen3_next":
        return model, model, Qwen3NextDecoderLayer
    return model, model.language_model, Qwen35DecoderLayer


def load_model(path_or_repo: str, *, enable_mtp: bool = True, dtype: Optional[str] = None) -> LoadedModel:
    """Load model, head and tokenizer. `dtype` defaults to the backend's compute dtype."""
    path = resolve_model_path(path_or_repo)
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'}: invalid JSON: {e}") from e
    model, text, decoder_cls = _build(config)
    card = load_card(config["model_type"], path)

    weights = load_weights(path)
    backbone_w, mtp_w = split_mtp_weights(weights)
    raw_hf = is_raw_hf_layout(backbone_w)
    quantization = config.get("quantization") or text_config(config).get("quantization")

    backbone_w = model.sanitize(backbone_w)
    _quantize_like_weights(model, backbone_w, quantization)
    _load_strict(model, backbone_w, "backbone", path)
    install_capturing_gdn(text.model.layers)

    head = None
    declared = mtp_layers_declared(config)
    if not mtp_w:
        status = "MTP off: the checkpoint has no mtp.* weights"
        if declared:
            log.warning(
                "%s declares %d MTP layer(s) but its weights contain no mtp.* tensors; serving without MTP. "
                "Fix: use a checkpoint that ships the MTP head (the original Hugging Face repo keeps mtp.*; "
                "converters that drop it, such as stock mlx-lm, produce this).", path, declared)
            status = "MTP off: config declares an MTP head but the weights have no mtp.* tensors"
    elif not enable_mtp:
        status = "MTP off: disabled by request"
    else:
        args = text.args
        if declared > 1:
            log.warning("%s declares %d MTP layers; only the first is used", path, declared)
            mtp_w = {k: v for k, v in mtp_w.items() if not k.startswith("layers.") or k.startswith("layers.0.")}
        head = MTPHead(args, decoder_cls, embedding_first=card.mtp_concat == "embedding_first")
        head_w = sanitize_mtp_weights(mtp_w, raw_hf)
        if any(k.endswith(".scales") for k in head_w):
            log.warning("%s: the MTP head is quantized; quantized heads are reported to lose most acceptance", path)
        _quantize_like_weights(head, head_w, quantization)
        _load_strict(head, head_w, "MTP head (mtp.*)", path)
        status = "MTP on"

    target = getattr(mx, dtype or BACKEND.compute_dtype)
    float_pred = lambda x: mx.issubdtype(x, mx.floating)  # noqa: E731
    model.set_dtype(target, float_pred)
    if head is not None:
        head.set_dtype(target, float_pred)
        mx.eval(head.parameters())
    mx.eval(model.parameters())
    model.eval()

    eos = config.get("eos_token_id", text_config(config).get("eos_token_id"))
    tokenizer = load_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    return LoadedModel(MTPModel(model, text, head, card, config["model_type"]), tokenizer, config, path, status)
