"""Reuse of model state across requests: an agent's growing conversation, and the
system prompt and tool schemas that many conversations share.

    cache = PromptCache(max_bytes=8 << 30, interval=1024, disk=DiskTier(...))
    checkpoints = cache.checkpoints(len(prompt), boundaries)  # where prefill stops to snapshot
    hit = cache.restore(prompt, needs_head=True)            # caches after the longest stored prefix
    cache.store(tokens, caches, owed_hidden)                # at a checkpoint, after a prompt, after a reply

Where snapshots are taken. GatedDeltaNet state cannot be cut back, so a
snapshot serves only prompts that extend its tokens exactly; the server
passes every message boundary of a rendered chat (each `<|im_start|>`: the
end of the system prompt and tools, of each message, where the generation
prompt starts), the cache adds every multiple of `interval` tokens (long
messages, raw completions prompts), and the scheduler stores one after each
prompt and at the end of each reply.

Memory. Attention KV lives in token blocks shared by every snapshot with
that prefix (`snapshot.py`), so the many snapshots of one conversation cost
its KV once plus, each, its GatedDeltaNet states, a KV tail shorter than a
block and its owed hiddens. Over `max_bytes` the least recently used
snapshot goes first, but a snapshot that is a branch point (two or more
stored continuations diverge after it: a system prompt several
conversations share) only once no other is left.

Disk (optional, `disk.py`): every snapshot is also written in
the background; a prompt whose longest prefix is on disk but not in memory
reads it back, also after a restart.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence as Seq

import mlx.core as mx

from mtp_serve.models.caches import FULL_KV, KVSetting

from .prefix_index import PrefixIndex
from .disk import DiskTier
from ..sequence import RowCaches
from .snapshot import BlockStore, Snapshot, as_tokens, block_hashes, capture, kv_salt, materialize, snapshot_key

log = logging.getLogger("mtp_serve.prompt_cache")


@dataclass
class Hit:
    n: int  # prompt tokens restored
    caches: RowCaches
    owed: Optional[mx.array]  # the owed backbone hiddens (see OwedPairs)
    tier: str  # "ram" or "disk"


class PromptCache:
    def __init__(self, max_bytes: int = 4 << 30, interval: int = 0, disk: Optional[DiskTier] = None,
                 kv: KVSetting = FULL_KV):
        if disk is not None and disk.kv != kv:
            raise ValueError(f"a disk tier at KV {disk.kv.tag} under a prompt cache at KV {kv.tag}")
        self.max_bytes = max_bytes
        self.kv = kv  # the KV setting of every snapshot it holds (part of their names)
        self._salt = kv_salt(kv)
        self.interval = interval  # 0: no snapshots inside long stretches
        self.disk = disk
        self.blocks = BlockStore()
        self.index: PrefixIndex[Snapshot] = PrefixIndex()
        self.by_key: Dict[str, Snapshot] = {}
        self.roots: List[Snapshot] = []  # snapshots no other stored snapshot is a prefix of
        self.own_bytes = 0
        self._clock = itertools.count(1)
        self.counts = {"hits_ram": 0, "hits_disk": 0, "misses": 0, "reused_ram": 0, "reused_disk": 0,
                       "stored": 0, "evictions_ram": 0, "snapshot_s": 0.0, "failures": 0}
        self.last_failure: Optional[str] = None  # what the last failed lookup or snapshot raised

    def __len__(self) -> int:
        return len(self.by_key)

    @property
    def nbytes(self) -> int:
        return self.own_bytes + self.blocks.nbytes

    def checkpoints(self, prompt_len: int, boundaries: Seq[int] = ()) -> tuple:
        """Prompt lengths at which prefill stops to snapshot: the given boundaries and every
        multiple of `interval`."""
        points = set(boundaries)
        if self.interval > 0:
            points.update(range(self.interval, prompt_len, self.interval))
        return tuple(sorted(n for n in points if 2 <= n < prompt_len))

    # -- restore

    def restore(self, prompt: Seq[int], needs_head: bool) -> Optional[Hit]:
        """Fresh caches after the longest stored strict prefix of `prompt` (from memory,
        or read back from disk when the disk holds a longer one); None on a miss."""
        tokens = as_tokens(prompt)
        chain = block_hashes(tokens, salt=self._salt)
        usable = lambda s: s.has_head or not needs_head  # noqa: E731
        snap = self.index.longest_prefix(tokens, chain, len(tokens) - 1, usable)
        tier = "ram"
        while self.disk is not None:
            entry = self.disk.lookup(tokens, chain, len(tokens) - 1, needs_head)
            if entry is None or (snap is not None and entry.n <= snap.n):
                break
            same = self.by_key.get(entry.key)
            if same is not None:  # in memory, but without the head's state
                self._remove(same)
            loaded = self.disk.read(entry, self.blocks.blocks.get)
            if loaded is not None:  # else dropped as corrupt: try the next best
                snap, blocks = loaded
                for name, block in blocks.items():
                    self.blocks.add(name, block)
                self._insert(snap)
                tier = "disk"
                break
        if snap is None:
            self.counts["misses"] += 1
            return None
        snap.last_used = next(self._clock)
        if self.disk is not None and tier == "ram":
            self.disk.touch(snap.key)
        caches, owed = materialize(snap, self.blocks)
        self.counts["hits_" + tier] += 1
        self.counts["reused_" + tier] += snap.n
        self._evict()
        return Hit(snap.n, caches, owed if needs_head else None, tier)

    # -- store

    def store(self, tokens: Seq[int], caches: RowCaches, owed: Optional[mx.array]) -> None:
        """Snapshot caches that hold exactly `tokens` (unless that snapshot exists). Raises
        ValueError for caches at another KV setting than the cache's."""
        if len(tokens) < 2 or self.max_bytes <= 0:
            return
        kv = next((KVSetting.of(c) for c in caches.backbone + [caches.head] if hasattr(c, "keys")), self.kv)
        if kv != self.kv:
            raise ValueError(f"caches at KV {kv.tag} offered to a prompt cache at KV {self.kv.tag}")
        if caches.head is not None and caches.head.offset == 0:
            return  # nothing in the head's cache yet (a one-token prompt): not worth a snapshot
        have = self.by_key.get(snapshot_key(tokens, self._salt))
        if have is not None:
            have.last_used = next(self._clock)
            return
        t0 = time.perf_counter()
        snap = capture(tokens, caches, owed, self.blocks)
        self.counts["stored"] += 1
        self._insert(snap)
        if self.disk is not None:
            self.disk.write(snap, self.blocks, shared=self._shared(snap))
        self._evict()
        self.counts["snapshot_s"] += time.perf_counter() - t0

    # -- bookkeeping

    @staticmethod
    def _shared(snap: Snapshot) -> bool:
        return len(snap.children) >= 2

    def _insert(self, snap: Snapshot) -> None:
        """Index it, count its blocks, and place it in the prefix tree (parent: the longest
        stored prefix of it; children: the stored snapshots it is a prefix of)."""
        snap.last_used = next(self._clock)
        self.blocks.acquire(snap)
        self.own_bytes += snap.nbytes
        parent = self.index.longest_prefix(snap.tokens, snap.chain, snap.n - 1)
        self.index.add(snap)
        self.by_key[snap.key] = snap
        siblings = parent.children if parent is not None else self.roots
        for c in [c for c in siblings if c.extends(snap)]:
            siblings.remove(c)
            c.parent = snap
            snap.children.append(c)
        snap.parent = parent
        siblings.append(snap)
        if parent is not None and self.disk is not None and self._shared(parent):
            self.disk.touch(parent.key, shared=True)

    def _remove(self, snap: Snapshot) -> None:
        self.index.remove(snap)
        del self.by_key[snap.key]
        self.own_bytes -= snap.nbytes
        self.blocks.release(snap)
        siblings = snap.parent.children if snap.parent is not None else self.roots
        siblings.remove(snap)
        for c in snap.children:
            c.parent = snap.parent
            siblings.append(c)

    def _evict(self) -> None:
        """Over the budget: the least recently used snapshot that is not a branch point first."""
        while self.nbytes > self.max_bytes and self.by_key:
            victim = min(self.by_key.values(), key=lambda s: (self._shared(s), s.last_used))
            self._remove(victim)
            self.counts["evictions_ram"] += 1

    def failed(self, what: str, error: BaseException) -> None:
        """A lookup or snapshot raised (the request went on without reuse): counted, and the
        reason kept for /v1/stats."""
        self.counts["failures"] += 1
        self.last_failure = f"{what}: {type(error).__name__}: {error}"

    # -- reporting and shutdown

    def stats(self) -> dict:
        """Counters and sizes per tier (for /metrics)."""
        out = dict(self.counts, snapshots_ram=len(self), bytes_ram=self.nbytes, budget_ram=self.max_bytes,
                   blocks_ram=len(self.blocks))
        if self.disk is not None:
            disk = dict(self.disk.stats)
            out.update(snapshots_disk=len(self.disk), bytes_disk=self.disk.nbytes, budget_disk=self.disk.max_bytes,
                       evictions_disk=disk.pop("evictions"), **{"disk_" + k: v for k, v in disk.items()})
        return out

    def close(self) -> None:
        """Finish the disk writes in flight (a clean shutdown keeps every snapshot)."""
        if self.disk is not None:
            self.disk.close()
