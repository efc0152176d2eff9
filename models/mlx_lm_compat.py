"""Every piece of mlx-lm this project relies on beyond its documented API, in one place.

mtp-serve builds on mlx-lm's model classes, caches and helpers, and in places
on their internals: private functions (`_get_classes`, `_gated_delta_step_ops`),
a class swap (the GatedDeltaNet forward, `models/gdn.py`), the fields of its
cache objects (`BatchKVCache._idx`, `left_padding`, `offset`, ...) and the
attribute names its layers set in `__init__` (the compiled decode steps and the
GatedDeltaNet forward read them). All project code imports these names from
here. At import this module checks that each one is still there and fails
with one message naming the mlx-lm version found and the one tested, instead
of an AttributeError deep inside a decode round. The version is pinned in
pyproject.toml; a newer mlx-lm that still passes these checks only warns.
"""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace
from typing import Iterable

import mlx_lm
from mlx_lm.models import activations as _activations
from mlx_lm.models import base as _base
from mlx_lm.models import cache as _cache
from mlx_lm.models import gated_delta as _gated_delta
from mlx_lm.models import pipeline as _pipeline
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models import switch_layers as _switch_layers
from mlx_lm import sample_utils as _sample_utils
from mlx_lm import tokenizer_utils as _tokenizer_utils
from mlx_lm import utils as _utils

TESTED_MLX_LM = "0.32.2"
mlx_lm_version = mlx_lm.__version__

log = logging.getLogger("mtp_serve.mlx_lm_compat")


class MlxLmIncompatible(ImportError):
    """The installed mlx-lm lacks something mtp-serve relies on."""


def _fail(what: str) -> None:
    raise MlxLmIncompatible(
        f"mtp-serve needs mlx-lm {TESTED_MLX_LM} (found {mlx_lm.__version__}): {what}. "
        f"Install it with: pip install 'mlx-lm=={TESTED_MLX_LM}'"
    )


def _require(owner, names: Iterable[str], where: str) -> None:
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        _fail(f"{where} has no {', '.join(missing)}")


def _require_init_fields(cls: type, names: Iterable[str]) -> None:
    """Attributes the class's own __init__ sets (read on instances by this project)."""
    source = "".join(inspect.getsource(c.__init__) for c in cls.__mro__ if "__init__" in vars(c) and c.__module__.startswith("mlx_lm"))
    missing = [n for n in names if f"self.{n}" not in source]
    if missing:
        _fail(f"{cls.__module__}.{cls.__name__} no longer sets {', '.join(missing)}")


# ---------------------------------------------------------------- what is used

_require(_utils, ["_get_classes", "infer_quant_config", "load_tokenizer"], "mlx_lm.utils")
_require(_gated_delta, ["_gated_delta_step_ops", "compute_g", "gated_delta_update", "normalize_qk"], "mlx_lm.models.gated_delta")
_require(_base, ["create_attention_mask", "create_ssm_mask", "scaled_dot_product_attention", "gather_last_axis",
               "quantized_scaled_dot_product_attention"],
         "mlx_lm.models.base")
_require(_cache, ["KVCache", "BatchKVCache", "ArraysCache", "QuantizedKVCache"], "mlx_lm.models.cache")
_require(_sample_utils, ["apply_top_k", "apply_top_p", "apply_min_p"], "mlx_lm.sample_utils")
_require(_tokenizer_utils.BPEStreamingDetokenizer, ["_maybe_trim_space"], "mlx_lm.tokenizer_utils.BPEStreamingDetokenizer")
_require(qwen3_5, ["GatedDeltaNet", "DecoderLayer", "TextModelArgs"], "mlx_lm.models.qwen3_5")
_require(qwen3_next, ["Qwen3NextGatedDeltaNet", "Qwen3NextDecoderLayer", "Qwen3NextAttention", "Qwen3NextMLP",
                     "Qwen3NextRMSNormGated", "Qwen3NextSparseMoeBlock"], "mlx_lm.models.qwen3_next")
# qwen4_exp (models/qwen4_exp.py) builds its MoE block from mlx-lm's Qwen3-Next one.
_require_init_fields(qwen3_next.Qwen3NextSparseMoeBlock, ["gate", "switch_mlp", "shared_expert", "shared_expert_gate"])

_require(_cache.BatchKVCache, ["merge", "extend", "filter", "extract", "trim", "make_mask", "update_and_fetch"], "BatchKVCache")
_require_init_fields(_cache.BatchKVCache, ["_idx", "left_padding", "offset", "keys", "values"])
_require_init_fields(_cache.KVCache, ["offset", "keys", "values"])
# Quantized KV (--kv-bits): a (packed, scales, biases) triple per keys and values, grown in `step`s;
# scaled_dot_product_attention takes the quantized path for a cache with `bits`.
_require_init_fields(_cache.QuantizedKVCache, ["offset", "keys", "values", "group_size", "bits"])
_require(_cache.QuantizedKVCache, ["step", "update_and_fetch", "trim"], "QuantizedKVCache")
_require_init_fields(_tokenizer_utils.TokenizerWrapper, ["_tokenizer"])
_require_init_fields(_cache.ArraysCache, ["cache", "lengths", "left_padding"])
_require(_cache.ArraysCache, ["advance", "extend", "filter", "extract"], "ArraysCache")
_require_init_fields(qwen3_5.GatedDeltaNet, [
    "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim", "conv_kernel_size", "conv_dim",
    "conv1d", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "dt_bias", "A_log", "norm", "out_proj"])
_require(qwen3_next.Qwen3NextGatedDeltaNet, ["fix_query_key_value_ordering"], "Qwen3NextGatedDeltaNet")
_require_init_fields(qwen3_next.Qwen3NextGatedDeltaNet, ["in_proj_qkvz", "in_proj_ba", "conv_kernel_size", "conv_dim"])
_require_init_fields(qwen3_next.Qwen3NextAttention, [
    "num_attention_heads", "num_key_value_heads", "scale", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rope"])
# Distributed serving (models/sharding.py): mlx-lm's tensor-parallel `shard` and pipeline split.
_require(qwen3_5.Model, ["shard"], "mlx_lm.models.qwen3_5.Model")
_require(_pipeline.PipelineMixin, ["pipeline", "pipeline_layers"], "PipelineMixin")
_require_init_fields(_pipeline.PipelineMixin, ["pipeline_rank", "pipeline_size", "start_idx", "end_idx"])
_require_init_fields(qwen3_5.GatedDeltaNet, ["sharding_group"])
_require_init_fields(qwen3_5.TextModel, ["sharding_group"])
_require_init_fields(qwen3_next.Qwen3NextMLP, ["gate_proj", "up_proj", "down_proj"])
_require_init_fields(qwen3_next.Qwen3NextRMSNormGated, ["weight", "eps"])
# Quantized MoE experts: models/quantized_layers.py computes their decode-sized products.
_require(_switch_layers, ["QuantizedSwitchLinear", "SwiGLU"], "mlx_lm.models.switch_layers")
_require(_activations, ["swiglu", "precise_swiglu"], "mlx_lm.models.activations")
_require_init_fields(_switch_layers.QuantizedSwitchLinear, ["group_size", "bits", "mode"])
for _layer in (qwen3_5.DecoderLayer, qwen3_next.Qwen3NextDecoderLayer):
    _require_init_fields(_layer, ["is_linear", "input_layernorm", "post_attention_layernorm", "mlp"])

if mlx_lm.__version__ != TESTED_MLX_LM:
    log.warning("mlx-lm %s is installed; mtp-serve was tested with %s (the parts it relies on are present)",
                mlx_lm.__version__, TESTED_MLX_LM)

# ---------------------------------------------------------------- the names project code imports

get_model_classes = _utils._get_classes
infer_quant_config = _utils.infer_quant_config
load_tokenizer = _utils.load_tokenizer
TokenizerWrapper = _tokenizer_utils.TokenizerWrapper


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


gated_delta_step_ops = _gated_delta._gated_delta_step_ops
compute_g = _gated_delta.compute_g
gated_delta_update = _gated_delta.gated_delta_update
normalize_qk = _gated_delta.normalize_qk

create_attention_mask = _base.create_attention_mask
create_ssm_mask = _base.create_ssm_mask
scaled_dot_product_attention = _base.scaled_dot_product_attention
quantized_scaled_dot_product_attention = _base.quantized_scaled_dot_product_attention
gather_last_axis = _base.gather_last_axis

KVCache = _cache.KVCache
BatchKVCache = _cache.BatchKVCache
QuantizedKVCache = _cache.QuantizedKVCache
ArraysCache = _cache.ArraysCache

apply_top_k = _sample_utils.apply_top_k
apply_top_p = _sample_utils.apply_top_p
apply_min_p = _sample_utils.apply_min_p

Qwen35GatedDeltaNetBase = qwen3_5.GatedDeltaNet
Qwen35DecoderLayer = qwen3_5.DecoderLayer
Qwen35TextModelArgs = qwen3_5.TextModelArgs
Qwen3NextGatedDeltaNetBase = qwen3_next.Qwen3NextGatedDeltaNet
Qwen3NextDecoderLayer = qwen3_next.Qwen3NextDecoderLayer
Qwen3NextAttention = qwen3_next.Qwen3NextAttention
QuantizedSwitchLinear = _switch_layers.QuantizedSwitchLinear


class _ByteLevelDetokenizer(_tokenizer_utils.BPEStreamingDetokenizer):
    """mlx-lm's BPE detokenizer drops a space that starts the first token (a SentencePiece
    habit). In byte-level BPE (Qwen's tokenizers) that space is text: a completion of
    "x =" whose first token is " 1" must read " 1", as `tokenizer.decode` has it."""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


def streaming_detokenizer(tokenizer):
    """The tokenizer's streaming detokenizer, keeping every space the tokens hold."""
    detok = tokenizer.detokenizer
    if type(detok) is _tokenizer_utils.BPEStreamingDetokenizer:
        detok.__class__ = _ByteLevelDetokenizer  # same state; only the first-space trim differs
    return detok


def shard_decoder_layers(layers, group) -> None:
    """Split decoder layers (attention or GatedDeltaNet, MLP or MoE) across `group`
    exactly as mlx-lm's Qwen3.5 `Model.shard` splits the backbone's: its own loop,
    run over these layers only (the MTP head's), with no LM head to split."""
    only_layers = SimpleNamespace(layers=list(layers),
                                  language_model=SimpleNamespace(args=SimpleNamespace(tie_word_embeddings=True)))
    qwen3_5.Model.shard(only_layers, group)
Qwen3NextMLP = qwen3_next.Qwen3NextMLP
Qwen3NextSparseMoeBlock = qwen3_next.Qwen3NextSparseMoeBlock
Qwen3NextRMSNormGated = qwen3_next.Qwen3NextRMSNormGated
SwiGLU = _switch_layers.SwiGLU
swiglu = _activations.swiglu
precise_swiglu = _activations.precise_swiglu


# -- conversion and quantization (mtp-convert, mtp-graft): mlx-lm's converter and quantizer

quantize_model = _utils.quantize_model


def conversion_choices() -> tuple:
    """(dtypes, mixed-bit recipes) mlx-lm's converter accepts."""
    from mlx_lm.convert import MODEL_CONVERSION_DTYPES, QUANT_RECIPES  # imported on use: mtp-convert only

    return MODEL_CONVERSION_DTYPES, QUANT_RECIPES


def convert(*args, **kwargs):
    """mlx-lm's `convert` (Hugging Face checkpoint -> MLX, optionally quantized)."""
    from mlx_lm.convert import convert as _convert

    return _convert(*args, **kwargs)
