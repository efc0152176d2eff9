"""Reuse of a conversation's model state across requests (multi-turn, agents).

A snapshot holds the caches after some token prefix: attention KV, the
GatedDeltaNet conv window and state, the MTP head's KV, and the backbone
hiddens whose head entries are still owed. GatedDeltaNet state cannot be
rolled back, so a snapshot is reusable only by a prompt that extends its
tokens exactly. Up to three are kept per request: at its checkpoints (the
server puts one where the generation prompt starts, so an agent's next turn,
which re-renders the previous reply, still reuses everything before it),
after the prompt, and at the end of the reply.
Least recently used snapshots go first when over the entry or byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence as Seq

import mlx.core as mx

from mtp_serve.models.caches import SpeculativeGDNCache
from mtp_serve.models.mlx_lm_compat import KVCache


def copy_cache(c: Any) -> Any:
    if isinstance(c, SpeculativeGDNCache):
        new = SpeculativeGDNCache()
        new.cache = list(c.cache)
        return new
    if isinstance(c, KVCache):
        new = KVCache()
        if c.keys is not None:
            new.keys = c.keys[..., : c.offset, :]
            new.values = c.values[..., : c.offset, :]
        new.offset = c.offset
        return new
    raise TypeError(f"cannot snapshot cache of type {type(c).__name__}")


def _nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


@dataclass
class Snapshot:
    tokens: tuple
    cache: List[Any]
    head_cache: Optional[KVCache]
    owed_hidden: Optional[mx.array]  # hiddens H[head_offset .. len(tokens)-1]

    @property
    def nbytes(self) -> int:
        arrays = []
        for c in self.cache:
            arrays += list(c.cache) if isinstance(c, SpeculativeGDNCache) else [c.keys, c.values]
        if self.head_cache is not None:
            arrays += [self.head_cache.keys, self.head_cache.values]
        return _nbytes(arrays + [self.owed_hidden])

    def restore(self):
        """Fresh, independent copies of (cache, head_cache, owed_hidden)."""
        head = copy_cache(self.head_cache) if self.head_cache is not None else None
        return [copy_cache(c) for c in self.cache], head, self.owed_hidden


def take_snapshot(tokens: Seq[int], cache: List[Any], head_cache: Optional[KVCache], owed_hidden) -> Snapshot:
    snap = Snapshot(
        tokens=tuple(tokens),
        cache=[copy_cache(c) for c in cache],
        head_cache=copy_cache(head_cache) if head_cache is not None else None,
        owed_hidden=owed_hidden,
    )
    mx.eval([c.state for c in snap.cache])
    return snap


def checkpoint_saver(prompt_cache: Optional["PromptCache"]):
    """`prefill`'s on_checkpoint callback: snapshot the caches holding the first n prompt tokens."""
    if prompt_cache is None:
        return None
    return lambda seq, n: prompt_cache.store(take_snapshot(seq.prompt[:n], seq.caches.backbone, seq.caches.head, seq.owed.hidden))


class PromptCache:
    def __init__(self, max_entries: int = 16, max_bytes: int = 4 << 30):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[tuple, Snapshot]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Seq[int], needs_head: bool) -> Optional[Snapshot]:
        """The longest snapshot whose tokens are a strict prefix of `prompt`."""
        prompt = tuple(prompt)
        best = None
        for key, snap in self._entries.items():
            n = len(key)
            if n < len(prompt) and prompt[:n] == key and (snap.head_cache is not None or not needs_head):
                if best is None or n > len(best.tokens):
                    best = snap
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best

    def store(self, snap: Snapshot) -> None:
        if len(snap.tokens) < 2:
            return
        self._entries[snap.tokens] = snap
        self._entries.move_to_end(snap.tokens)
        while len(self._entries) > self.max_entries or (
            len(self._entries) > 1 and sum(s.nbytes for s in self._entries.values()) > self.max_bytes
        ):
            self._entries.popitem(last=False)
