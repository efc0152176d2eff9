"""Load a Qwen3.5 / Qwen3.6 / Qwen3-Next / Qwen3.8-Flash-Next checkpoint together with its MTP head.

Stock mlx-lm globs `model*.safetensors` and drops every `mtp.*` tensor. Here
shards are resolved through `model.safetensors.index.json` (so an MTP shard
such as `mtp.safetensors` is found; a shard's tensors the index assigns
elsewhere or not at all are ignored), the backbone goes through mlx-lm's own
`sanitize` and classes, and the head's tensors are renamed for `MTPHead` by
`mtp_weights.py`, the one place that knows their quirks. Both raw Hugging
Face layout and mlx-lm converted layout load. `qwen4_exp` (Qwen3.8-Flash-Next) has no
mlx-lm release with it: its backbone is the project's own (`models/qwen4_exp.py`), loaded from the raw HF
layout, `mtp-convert`'s, or the layout mlx-lm's main branch writes (mlx-community conversions).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mtp_serve import BACKEND

from .draft_head import group_size_of, head_is_quantized, quantized_head
from .draft_vocab import DRAFT_VOCAB_FILE, load_draft_ids
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
from .quantized_layers import install_decode_qmm
from .mtp_head import MTPHead
from . import qwen4_exp
from .mtp_model import MTPModel
from .qwen4_exp_mtp import Qwen4ExpMTPModel
from .ngram_tables import mapped_tables
from .mtp_source import graft_command
from .mtp_weights import (
    RAW,
    SHIFTED,
    CheckpointError,
    detect_norm_format,
    first_layer_only,
    is_raw_hf_layout,
    mtp_layers_declared,
    recorded_norm_format,
    sanitize_mtp_weights,
    split_mtp_weights,
    text_config,
)
from .safetensors_files import INDEX_FILE, read_index
from .sharding import Split
from .vision import is_vision_key, load_vision

log = logging.getLogger("mtp_serve.loader")

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp")
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.md", "tokenizer.model", "*.tiktoken"]
__all__ = ["CheckpointError", "LoadedModel", "load_model", "resolve_model_path", "empty_head"]


@dataclass
class LoadedModel:
    model: MTPModel
    tokenizer: TokenizerWrapper
    config: dict
    path: Path
    mtp_status: str  # one line: why MTP is or is not available
    mtp_fix: Optional[str] = None  # for a checkpoint without a head: the command that adds it

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


def _index(path: Path) -> Optional[dict]:
    try:
        return read_index(path)
    except ValueError as e:  # invalid JSON or no weight_map
        raise CheckpointError(f"{path / INDEX_FILE}: {e}") from e


def weight_files(path: Path) -> list[Path]:
    index = _index(path)
    if index is not None:
        names = sorted(set(index["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors weights found")
    return files


def load_weights(path: Path) -> Dict[str, mx.array]:
    index = _index(path)
    weights: Dict[str, mx.array] = {}
    for f in weight_files(path):
        try:
            shard = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError for corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors file: {e}") from e
        if index is not None:  # e.g. a head replaced by `mtp-graft --force` stays in its old shard, unlisted
            shard = {k: v for k, v in shard.items() if index["weight_map"].get(k) == f.name}
        weights.update(shard)
    return weights


def _map_ngram_tables(text: nn.Module, path: Path, weights: dict) -> None:
    """qwen4_exp: PLE layers read their full-precision n-gram tables memory-mapped from the
    files (models/ngram_tables.py); their tensors leave `weights` unread."""
    index = _index(path)
    tables = mapped_tables(weight_files(path), index["weight_map"] if index is not None else None)
    for i, (table, names) in tables.items():
        try:
            text.model.layers[i].ple.ple_embedding.use_mapped(table)
        except (IndexError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{path}: layer {i}'s n-gram table does not match the config: {e}") from e
        for name in names:
            weights.pop(name, None)


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
    if model_type == "qwen4_exp":
        try:
            model = qwen4_exp.build(config)
        except (qwen4_exp.Unsupported, TypeError, KeyError) as e:
            raise CheckpointError(f"{e}") from e
        return model, model.language_model, Qwen35DecoderLayer
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    if model_type == "qwen3_next":
        return model, model, Qwen3NextDecoderLayer
    return model, model.language_model, Qwen35DecoderLayer


def _head(text: nn.Module, decoder_cls: type, card: Optional[ModelCard] = None) -> MTPHead:
    args = qwen4_exp.head_args(vars(text.args)) if isinstance(text.args, qwen4_exp.Qwen4ExpArgs) else text.args
    return MTPHead(args, decoder_cls, embedding_first=card is None or card.mtp_concat == "embedding_first")


def empty_head(config: dict) -> Tuple[MTPHead, nn.Module]:
    """An (unquantized, randomly initialized) MTP head for a model with `config`,
    and that model's mlx-lm module (for its quantization rules). Lazy: nothing is
    allocated until evaluated."""
    model, text, decoder_cls = _build(config)
    return _head(text, decoder_cls), model


def load_model(path_or_repo: str, *, enable_mtp: bool = True, dtype: Optional[str] = None,
               draft_vocab: Optional[int] = None, draft_head_bits: Optional[int] = None,
               split: Optional[Split] = None) -> LoadedModel:
    """Load model, head and tokenizer. `dtype` defaults to the backend's compute dtype;
    `draft_vocab`: draft from the checkpoint's N most frequent tokens (None: the model
    card's `draft_vocab_size`; 0: the whole vocabulary); `draft_head_bits`: draft from
    the head quantized to 4 or 8 bits (None: the card's `draft_head_bits`; 0: the head
    as stored). With `split`, this rank keeps
    (and reads from disk) only its part of the model."""
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

    if config["model_type"] == "qwen4_exp":
        _map_ngram_tables(text, path, backbone_w)
        backbone_w = {k: v for k, v in backbone_w.items() if not is_vision_key(k)}  # the tower loads below
        if quantization and quantization.get("mode", "affine") != "affine":
            raise CheckpointError(f"{path}: {qwen4_exp.unsupported(repr(quantization['mode']) + ' quantization (affine only)')}")
        try:
            backbone_w = model.sanitize(backbone_w)
        except qwen4_exp.Unsupported as e:
            raise CheckpointError(f"{path}: {e}") from e
    else:
        backbone_w = model.sanitize(backbone_w)
    _quantize_like_weights(model, backbone_w, quantization)
    _load_strict(model, backbone_w, "backbone", path)
    install_capturing_gdn(text.model.layers)

    head, fix = None, None
    declared = mtp_layers_declared(config)
    if not mtp_w:
        fix = graft_command(path, config)
        status = "MTP off: the checkpoint has no mtp.* weights"
        if declared:
            status = "MTP off: config declares an MTP head but the weights have no mtp.* tensors"
        log.warning("%s: %s (converters such as stock mlx-lm drop the head); serving without MTP. Fix: %s",
                    path, status[len("MTP off: "):], fix)
    elif not enable_mtp:
        status = "MTP off: disabled by request"
    else:
        if declared > 1:
            log.warning("%s declares %d MTP layers; only the first is used", path, declared)
            mtp_w = first_layer_only(mtp_w)
        norms = recorded_norm_format(path) or detect_norm_format(mtp_w, RAW if raw_hf else SHIFTED)
        head = _head(text, decoder_cls, card)
        head_w = sanitize_mtp_weights(mtp_w, shift_norms=norms.needs_shift)
        if any(k.endswith(".scales") for k in head_w):
            log.warning("%s: the MTP head is quantized; quantized heads are reported to lose most acceptance", path)
        _quantize_like_weights(head, head_w, quantization)
        _load_strict(head, head_w, "MTP head (mtp.*)", path)
        status = "MTP on"

    if split is not None:  # before anything is evaluated: the rest is never read
        head = split.apply(config["model_type"], model, text, head)
    target = getattr(mx, dtype or BACKEND.compute_dtype)
    float_pred = lambda x: mx.issubdtype(x, mx.floating)  # noqa: E731
    model.set_dtype(target, float_pred)
    for layer in text.model.layers:  # memory-mapped n-gram tables: their rows at the compute dtype
        if getattr(layer, "has_ple", False) and layer.ple.ple_embedding.mapped is not None:
            layer.ple.ple_embedding.mapped.target = target
    if head is not None:
        head.set_dtype(target, float_pred)
        mx.eval(head.parameters())
    mx.eval(model.parameters())
    model.eval()
    if quantization:  # decode-sized quantized products on mtp-serve's kernel (CPU; built at first use)
        install_decode_qmm([model, head])
    bits = card.draft_head_bits if draft_head_bits is None else draft_head_bits
    if head is not None and bits and not head_is_quantized(head):
        if split is None:
            head = quantized_head(head, bits, group_size_of(quantization))  # the unquantized head is freed
        else:  # a split head's layers are sharded modules: it drafts as stored
            log.warning("%s: split across ranks: the MTP head drafts as stored (draft_head_bits %d is off)", path, bits)

    eos = config.get("eos_token_id", text_config(config).get("eos_token_id"))
    tokenizer = load_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    model_cls = Qwen4ExpMTPModel if config["model_type"] == "qwen4_exp" else MTPModel
    mtp_model = model_cls(model, text, head, card, config["model_type"])
    if config["model_type"] == "qwen4_exp":
        if split is not None:
            raise CheckpointError(f"{path}: {qwen4_exp.unsupported('distributed serving')}")
        log.info("%s: PLE n-gram tables %.1f MiB%s", path, mtp_model.ngram_table_bytes() / 2**20,
                 " (memory-mapped)" if qwen4_exp.tables_mapped(model.language_model.model) else "")
    if split is None and "vision_config" in config:  # a vision-language checkpoint: its tower too
        mtp_model.vision = load_vision(config, weights, path, target)
    del weights
    if head is not None:
        size = card.draft_vocab_size if draft_vocab is None else draft_vocab
        ids = load_draft_ids(path, size)
        if ids is not None and split is not None and split.splits_vocabulary(text):
            log.warning("%s: tensor parallel splits the LM head by vocabulary; drafting from the whole vocabulary "
                        "(the draft vocabulary is off)", path)
            ids = None
        if size and ids is None:
            log.warning("%s: no %s: drafting from the whole vocabulary (mtp-tune --draft-vocab-text FILE measures one)",
                        path, DRAFT_VOCAB_FILE)
        mtp_model.use_draft_vocab(ids)
    return LoadedModel(mtp_model, tokenizer, config, path, status, fix)
