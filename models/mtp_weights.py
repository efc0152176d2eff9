"""The MTP head's tensors: every checkpoint quirk about them, in one place.

Used by the loader (a checkpoint that ships its head) and by `mtp-graft`
(a head copied from the original checkpoint into a converted one):

* where the head sits: under `mtp.`, `model.mtp.`, `language_model.mtp.` or
  `model.language_model.mtp.`;
* how MoE experts are stored: one tensor per expert (Qwen3.5 MoE, Qwen3-Next)
  or fused `experts.gate_up_proj` / `experts.down_proj` (Qwen3.6);
* how the RMSNorm weights are stored: raw zero-centred (`y = x_hat * (1 + w)`,
  Hugging Face) or already shifted (`y = x_hat * w`, MLX). The +1 shift is
  applied exactly once: a head grafted by `mtp-graft` records the format it
  stored, otherwise the values decide (with the body's layout as tie-break);
* which config field declares the head.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

MTP_PREFIX = re.compile(r"^(?:model\.)?(?:language_model\.)?mtp\.")
# The head's one-dimensional Gemma-style (1 + w) norms, besides the final `norm.weight`.
MTP_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
RAW, SHIFTED = "raw", "shifted"
# Written next to a grafted head (see models/graft.py); records the stored norm format.
PROVENANCE_FILE = "mtp_graft.json"
# Below / above these, the median norm value decides the format alone; between them
# (trained scales far from 1) the body's layout decides.
_CLEARLY_RAW, _CLEARLY_SHIFTED = 0.3, 0.7

_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or grafted as it is; the message names the cause."""


def is_mtp_key(key: str) -> bool:
    return MTP_PREFIX.match(key) is not None


def split_mtp_weights(weights: Dict[str, mx.array]) -> Tuple[dict, dict]:
    """(backbone tensors, head tensors with the MTP prefix stripped)."""
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


# --- the config's MTP field -------------------------------------------------------

def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def mtp_layers_declared(config: dict) -> int:
    tc = text_config(config)
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        for src in (tc, config):
            if key in src:
                return int(src[key] or 0)
    return 0


def declare_mtp_layers(config: dict, n: int = 1) -> dict:
    """A copy of `config` declaring `n` MTP layers in the field its family uses."""
    config = json.loads(json.dumps(config))
    if config.get("model_type") == "qwen3_next":
        config["num_nextn_predict_layers"] = n
    else:
        text_config(config)["mtp_num_hidden_layers"] = n
    return config


# --- layers, experts, norms ---------------------------------------------------------

def first_layer_only(mtp: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """MTPHead has one decoder layer; checkpoints declaring more use the first."""
    return {k: v for k, v in mtp.items() if not k.startswith("layers.") or k.startswith("layers.0.")}


def expert_format(mtp: Dict[str, mx.array]) -> str:
    if any(k.endswith(".experts.gate_up_proj") for k in mtp):
        return "fused"
    if any(_PER_EXPERT.match(k) for k in mtp):
        return "per_expert"
    return "stacked" if any(".switch_mlp." in k for k in mtp) else "none"


def is_norm_key(key: str) -> bool:
    return key == "norm.weight" or key.endswith(MTP_NORM_SUFFIXES)


@dataclass(frozen=True)
class NormFormat:
    stored: str  # RAW or SHIFTED
    statistic: float  # median over the head's norms of each norm's mean value
    decided_by: str  # "values", "layout" or "record"

    @property
    def needs_shift(self) -> bool:
        return self.stored == RAW


def detect_norm_format(mtp: Dict[str, mx.array], layout_hint: Optional[str] = None) -> NormFormat:
    """How the head's norms are stored, from their values.

    Raw zero-centred weights sit near 0, shifted ones near 1. Where the median
    is ambiguous (trained scales far from 1), `layout_hint` (the format the
    rest of the checkpoint uses) decides; without one, 0.5 does."""
    means = [mx.mean(v.astype(mx.float32)).item() for k, v in mtp.items() if v.ndim == 1 and is_norm_key(k)]
    if not means:
        raise CheckpointError("the MTP head has no norm weights (expected mtp.norm.weight and the pre_fc norms)")
    stat = sorted(means)[len(means) // 2]
    if stat < _CLEARLY_RAW or stat > _CLEARLY_SHIFTED or layout_hint is None:
        return NormFormat(RAW if stat < 0.5 else SHIFTED, stat, "values")
    return NormFormat(layout_hint, stat, "layout")


def recorded_norm_format(model_dir: Path) -> Optional[NormFormat]:
    """The norm format `mtp-graft` stored in `model_dir`, if it grafted the head there."""
    path = Path(model_dir) / PROVENANCE_FILE
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text()).get("stored_norm_format")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); delete it and graft again") from e
    return NormFormat(stored, float("nan"), "record") if stored in (RAW, SHIFTED) else None


def sanitize_mtp_weights(mtp: Dict[str, mx.array], shift_norms: bool) -> Dict[str, mx.array]:
    """Rename head tensors (prefix already stripped) to MTPHead's names.

    `shift_norms` adds 1 to the norms (raw zero-centred storage). MoE experts
    come per expert or fused and leave stacked as `switch_mlp.*` (mlx-lm's names).
    """
    out: Dict[str, mx.array] = {}
    per_expert: Dict[Tuple[str, str], Dict[int, mx.array]] = {}
    for k, v in mtp.items():
        m = _PER_EXPERT.match(k)
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
        if shift_norms and v.ndim == 1 and is_norm_key(k):
            v = v + 1.0
        out[k] = v
    for (prefix, proj), experts in per_expert.items():
        n = max(experts) + 1
        if sorted(experts) != list(range(n)):
            raise CheckpointError(f"mtp.{prefix}.experts: expert tensors for {proj} are not numbered 0..{n - 1}")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(n)])
    return out
