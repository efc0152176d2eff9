"""`GET /v1/stats`: the server's own figures as JSON, for the web page's live charts.

    curl -s localhost:8000/v1/stats | jq .decode.tokens_per_second

Every number is read from the same Prometheus registry `/metrics` renders, at the same
moment, so the two always agree (a scrape and a poll differ only by what happened
between them): `metrics.py` is the one place a figure is defined. Counters are totals
since start-up; a chart turns two polls into a rate, as Prometheus's `rate()` does.

    {"object": "stats", "time": 1767225600.0, "model": "demo", "mtp": {"status": ..., "depth_cap": 3},
     "engine": {"queue_depth": 0, "active_sequences": 1, "running_sequences": 1, "batch_capacity": 8,
                "decode_rounds": 412},
     "decode": {"tokens_per_second": 61.2, "tokens_per_pass": 3.1, "acceptance_per_position": [0.9, 0.8, 0.7],
                "row_depths": [3]},
     "policy": {"acceptance_per_position": [0.88, 0.81, 0.74]},
     "totals": {"requests": 12, "prompt_tokens": ..., "cached_prompt_tokens": ..., "completion_tokens": ...,
                "backbone_passes": ..., "drafted_per_position": [...], "accepted_per_position": [...],
                "drafted_by_source": {"mtp": ..., "copy": ..., "forced": ...}, "accepted_by_source": {...},
                "max_tokens_lowered": 0},
     "prompt_cache": {"enabled": true, "off_reason": null, "failures": 0, "last_failure": null,
                      "bytes": {"ram": ..., "disk": ...}, "budget_bytes": {...}, "snapshots": {...},
                      "hits": {...}, "misses": 3, "reused_tokens": {...}, "stored": 9, "evictions": {...}}}

`decode` describes the rows running now (each row's figures since its decode began,
pooled over rows; empty lists and zeros when idle); `policy` the depth policy's
model-wide moving average; `totals` finished requests. `prompt_cache.off_reason` says why a
server runs without one (turned off, serving across ranks, or a model whose caches failed the
start-up snapshot-and-restore check); `last_failure` what the last failed lookup or snapshot raised.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from fastapi import APIRouter, Request
from pydantic import BaseModel

router = APIRouter()

Samples = Dict[str, Dict[Tuple[Tuple[str, str], ...], float]]


def registry_samples(registry) -> Samples:
    """Every sample of the registry: name -> {sorted label pairs -> value}."""
    out: Samples = defaultdict(dict)
    for family in registry.collect():
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def _one(samples: Samples, name: str, default: float = 0.0) -> float:
    return samples.get(name, {}).get((), default)


def _by(samples: Samples, name: str, label: str) -> Dict[str, float]:
    return {dict(k)[label]: v for k, v in samples.get(name, {}).items() if label in dict(k)}


def _positions(samples: Samples, name: str) -> List[float]:
    """A per-position family (labels "1", "2", ...) as a list in position order."""
    by = _by(samples, name, "position")
    return [by[p] for p in sorted(by, key=int)]


def _int(x: float):
    return int(x) if float(x).is_integer() else x


class Stats(BaseModel):
    """The schema of `GET /v1/stats` (the module's docstring shows an example)."""

    object: str = "stats"
    time: float
    model: str
    mtp: dict
    engine: dict
    decode: dict
    policy: dict
    totals: dict
    prompt_cache: dict


def stats_body(samples: Samples, model: str, mtp_status: Optional[str], prompt_cache_off: Optional[str] = None,
               prompt_cache_failure: Optional[str] = None) -> dict:
    """`prompt_cache_off`: why the server runs without a prompt cache; `prompt_cache_failure`:
    what the last failed lookup or snapshot raised."""
    one = lambda name: _int(_one(samples, name))  # noqa: E731
    rows = _by(samples, "mtp_row_depth", "row")
    tiers = sorted(_by(samples, "mtp_prompt_cache_bytes", "tier"))

    def per_tier(name):
        return {t: _int(v) for t, v in sorted(_by(samples, name, "tier").items())}

    def per_source(name):
        by = _by(samples, name, "source")
        return {s: _int(by.get(s, 0)) for s in ("copy", "forced")}

    return {
        "object": "stats",
        "time": time.time(),
        "model": model,
        "mtp": {"status": mtp_status, "depth_cap": one("mtp_depth_cap")},
        "engine": {
            "queue_depth": one("mtp_queue_depth"),
            "active_sequences": one("mtp_active_sequences"),
            "running_sequences": one("mtp_running_sequences"),
            "batch_capacity": one("mtp_batch_capacity"),
            "decode_rounds": one("mtp_decode_rounds_total"),
        },
        "decode": {
            "tokens_per_second": round(_one(samples, "mtp_running_decode_tokens_per_second"), 3),
            "tokens_per_pass": round(_one(samples, "mtp_running_tokens_per_pass"), 4),
            "acceptance_per_position": [round(a, 4) for a in _positions(samples, "mtp_running_acceptance")],
            "row_depths": [_int(rows[r]) for r in sorted(rows, key=int)],
        },
        "policy": {"acceptance_per_position": [round(a, 4) for a in _positions(samples, "mtp_policy_acceptance")]},
        "totals": {
            "requests": _int(sum(samples.get("mtp_requests_total", {}).values())),
            "prompt_tokens": one("mtp_prompt_tokens_total"),
            "cached_prompt_tokens": one("mtp_cached_prompt_tokens_total"),
            "completion_tokens": one("mtp_completion_tokens_total"),
            "backbone_passes": one("mtp_backbone_passes_total"),
            "drafted_per_position": [_int(v) for v in _positions(samples, "mtp_draft_tokens_total")],
            "accepted_per_position": [_int(v) for v in _positions(samples, "mtp_accepted_tokens_total")],
            "drafted_by_source": {"mtp": _int(sum(_positions(samples, "mtp_draft_tokens_total"))),
                                  **per_source("mtp_certain_draft_tokens_total")},
            "accepted_by_source": {"mtp": _int(sum(_positions(samples, "mtp_accepted_tokens_total"))),
                                   **per_source("mtp_certain_accepted_tokens_total")},
            "max_tokens_lowered": one("mtp_max_tokens_lowered_total"),
        },
        "prompt_cache": {
            "enabled": bool(tiers),
            "off_reason": prompt_cache_off,
            "failures": one("mtp_prompt_cache_failures_total"),
            "last_failure": prompt_cache_failure,
            "bytes": per_tier("mtp_prompt_cache_bytes"),
            "budget_bytes": per_tier("mtp_prompt_cache_budget_bytes"),
            "snapshots": per_tier("mtp_prompt_cache_snapshots"),
            "hits": per_tier("mtp_prompt_cache_hits_total"),
            "misses": one("mtp_prompt_cache_misses_total"),
            "reused_tokens": per_tier("mtp_prompt_cache_reused_tokens_total"),
            "stored": one("mtp_prompt_cache_stored_total"),
            "evictions": per_tier("mtp_prompt_cache_evictions_total"),
        },
    }


@router.get("/v1/stats", response_model=Stats)
async def stats(request: Request):
    """The server's live figures (decode speed, tokens per pass, acceptance per draft position, the
    depth per row, the batch, the prompt cache): the numbers `/metrics` exports, as one JSON object."""
    svc = request.app.state.service
    cache = svc.engine.prompt_cache
    return stats_body(registry_samples(svc.metrics.registry), svc.config.served_model_name, svc.loaded.mtp_status,
                      svc.prompt_cache_off, cache.last_failure if cache is not None else None)
