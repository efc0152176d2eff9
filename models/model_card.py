"""Model cards: per-architecture defaults in `configs/*.json`.

A checkpoint directory may carry `mtp_serve.json` with any of the same fields;
they override the card (for example a head trained on the pre-norm hidden is
`{"mtp_hidden": "pre_norm"}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path

CHECKPOINT_CARD_FILE = "mtp_serve.json"


@dataclass(frozen=True)
class ModelCard:
    model_types: tuple = ()
    description: str = ""
    mtp_hidden: str = "post_norm"  # "post_norm" (after the final norm) or "pre_norm"
    mtp_concat: str = "embedding_first"  # or "hidden_first"
    tool_call_parser: str = "none"
    reasoning_parser: str = "none"
    default_mtp_depth: int = 2
    draft_vocab_size: int = 0  # draft from the checkpoint's N most frequent tokens (draft_vocab.json); 0 = all
    draft_head_bits: int = 0  # draft from the head quantized to 4 or 8 bits (models/draft_head.py); 0 = as stored
    # (verify-window bucket, its cost in plain steps on this machine), from mtp-tune; in
    # mtp_serve.json a mapping {"4": 1.2, "8": 1.5, ...}
    window_costs: tuple = ()

    def __post_init__(self):
        if self.mtp_hidden not in ("post_norm", "pre_norm"):
            raise ValueError(f"mtp_hidden must be post_norm or pre_norm, got {self.mtp_hidden!r}")
        if self.mtp_concat not in ("embedding_first", "hidden_first"):
            raise ValueError(f"mtp_concat must be embedding_first or hidden_first, got {self.mtp_concat!r}")


def _card_fields(data: dict) -> dict:
    known = {f.name for f in fields(ModelCard)}
    out = {k: v for k, v in data.items() if k in known}
    if "model_types" in out:
        out["model_types"] = tuple(out["model_types"])
    if "window_costs" in out:
        try:
            out["window_costs"] = tuple(sorted((int(w), float(c)) for w, c in dict(out["window_costs"]).items()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"window_costs must map window sizes to costs in plain steps, e.g. "
                             f"{{\"4\": 1.2}}; got {out['window_costs']!r}") from e
    return out


def builtin_cards() -> list[ModelCard]:
    cards = []
    for entry in resources.files("mtp_serve.configs").iterdir():
        if entry.name.endswith(".json"):
            cards.append(ModelCard(**_card_fields(json.loads(entry.read_text()))))
    return cards


def load_card(model_type: str, model_dir: Path | None = None) -> ModelCard:
    card = next((c for c in builtin_cards() if model_type in c.model_types), None)
    if card is None:
        supported = sorted(t for c in builtin_cards() for t in c.model_types)
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported)}")
    override = model_dir / CHECKPOINT_CARD_FILE if model_dir else None
    if override is not None and override.exists():
        card = replace(card, **_card_fields(json.loads(override.read_text())))
    return card
