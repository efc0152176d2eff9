"""The prompt cache's settings, with defaults from the machine and the model.

    cache = open_prompt_cache(loaded, name="Qwen3.6-27B", disk_dir="~/.cache/mtp-serve/prompts")

- Memory budget: a quarter of the memory available once the model is loaded.
- Interval (snapshots inside long stretches): measured per model. A snapshot
  costs its GatedDeltaNet states whatever its position, while the KV it shares
  grows with the tokens. The interval is the smallest multiple of
  INTERVAL_ALIGN tokens over which those states cost at most
  INTERVAL_STATE_SHARE of the KV of the tokens between two snapshots, so the
  extra snapshots add at most that share to a conversation's memory. Multiples
  of INTERVAL_ALIGN fall where prefill's forward passes end (the server's default
  --prefill-chunk and prefill.MAX_FORWARD_TOKENS divide it), so they cost no extra pass.
- Disk budget: half the free space of the cache's file system, at most 16 GiB.
- KV setting: the model's (`--kv-bits`); snapshots hold KV as the caches do,
  and the setting is part of their names and of the disk fingerprint.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

from mtp_serve.models.caches import kv_length, kv_nbytes
from mtp_serve.models.fingerprint import weights_fingerprint
from mtp_serve.models.loader import weight_files

from ..sequence import RowCaches
from .cache import PromptCache
from .disk import DiskTier

log = logging.getLogger("mtp_serve.prompt_cache")

MEMORY_SHARE = 0.25
INTERVAL_STATE_SHARE = 0.25
INTERVAL_ALIGN = 1024
DISK_DEFAULT_MAX = 16 << 30


def available_memory() -> int:
    """Bytes of memory available to new allocations (Linux: MemAvailable; elsewhere
    physical memory less what MLX holds)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, total - mx.get_active_memory())


@dataclass
class SnapshotCosts:
    state_bytes: int  # a snapshot's own GatedDeltaNet states
    kv_bytes_per_token: int  # attention KV per token, the head's included
    dtype: str  # of the cached state


class PromptCacheUnavailable(RuntimeError):
    """The prompt cache cannot serve this model (the message says why)."""


def _probe(model) -> Tuple[RowCaches, mx.array]:
    """Caches holding a two-token prompt, the head's first pair included, and the owed hidden."""
    caches = model.make_cache()
    hidden, _ = model.forward(mx.array([[1, 2]]), caches)
    head = model.make_head_cache() if model.has_mtp else None
    if head is not None:
        model.draft(hidden[:, :1], mx.array([[2]]), head)
    return RowCaches(caches, head), hidden[:, 1:]


def snapshot_costs(model) -> SnapshotCosts:
    """Measured on a two-token forward."""
    probe, owed = _probe(model)
    state, per_token = 0, 0
    for c in probe.backbone + ([probe.head] if probe.head is not None else []):
        if hasattr(c, "keys"):
            per_token += (kv_nbytes(c.keys) + kv_nbytes(c.values)) // kv_length(c.keys)
            if getattr(c, "index_keys", None) is not None:  # qwen4_exp: the indexer's key per token
                per_token += c.index_keys.nbytes // c.index_keys.shape[1]
        else:
            state += sum(a.nbytes for a in c.cache)
            if getattr(c, "ple", None) is not None:  # qwen4_exp: a PLE layer's n-gram and conv windows
                state += c.ple.ngram.nbytes + c.ple.conv.nbytes
    return SnapshotCosts(state, per_token, str(owed.dtype))


def check_round_trip(model) -> None:
    """Snapshot a two-token prompt and restore it for a three-token one, as a request would:
    raises PromptCacheUnavailable, naming the step and the error, where this model's caches
    cannot be snapshot or restored (a cache that would never hit is refused at start-up,
    not discovered one request at a time)."""
    probe, owed = _probe(model)
    trial = PromptCache(max_bytes=1 << 30, kv=model.kv)
    try:
        trial.store([1, 2], probe, owed)
    except Exception as e:  # noqa: BLE001 - reported as the reason the cache is off
        raise PromptCacheUnavailable(f"a snapshot of this model's caches failed ({type(e).__name__}: {e})") from e
    try:
        hit = trial.restore([1, 2, 3], needs_head=model.has_mtp)
    except Exception as e:  # noqa: BLE001
        raise PromptCacheUnavailable(f"restoring a snapshot of this model's caches failed ({type(e).__name__}: {e})") from e
    if hit is None or hit.n != 2:
        raise PromptCacheUnavailable("a stored two-token prompt was not found again for its three-token extension")


def auto_interval(costs: SnapshotCosts) -> int:
    if costs.kv_bytes_per_token == 0:
        return INTERVAL_ALIGN
    tokens = costs.state_bytes / (INTERVAL_STATE_SHARE * costs.kv_bytes_per_token)
    return max(1, math.ceil(tokens / INTERVAL_ALIGN)) * INTERVAL_ALIGN


def default_disk_bytes(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    return min(DISK_DEFAULT_MAX, shutil.disk_usage(folder).free // 2)


def open_prompt_cache(loaded, name: str, *, max_bytes: Optional[int] = None, interval: Optional[int] = None,
                      disk_dir: Optional[str] = None, disk_bytes: Optional[int] = None) -> Optional[PromptCache]:
    """The server's prompt cache (None when `max_bytes` is 0). Raises OSError when the
    disk folder cannot be created, PromptCacheUnavailable when this model's caches cannot be
    snapshot and restored."""
    if max_bytes is None:
        max_bytes = int(available_memory() * MEMORY_SHARE)
    if max_bytes <= 0:
        return None
    model = loaded.model
    check_round_trip(model)
    costs = snapshot_costs(model)
    if interval is None:
        interval = auto_interval(costs)
    disk = None
    if disk_dir:
        folder = Path(disk_dir).expanduser()
        if disk_bytes is None:
            disk_bytes = default_disk_bytes(folder)
        kv = (f"kv={model.kv.tag}",) if model.kv.quantized else ()  # (full precision: the fingerprint as before)
        fingerprint = weights_fingerprint(weight_files(loaded.path), f"dtype={costs.dtype}", f"head={model.has_mtp}",
                                          f"card={model.card}", *kv)
        layout = tuple(bool(layer.is_linear) for layer in model.layers)
        disk = DiskTier(folder, name, fingerprint, disk_bytes, layout, model.kv)
    log.info("prompt cache: %.2f GiB of memory, KV %s (%d bytes a token), a snapshot every %d tokens inside long "
             "messages%s", max_bytes / 2**30, model.kv, costs.kv_bytes_per_token, interval,
             f"; disk tier {disk.dir} ({disk_bytes / 2**30:.2f} GiB, {len(disk)} snapshots found)" if disk is not None else "")
    return PromptCache(max_bytes, interval, disk, model.kv)
