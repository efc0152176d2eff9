"""A prompt-cache snapshot: a sequence's model state after a token prefix.

    snap = capture(tokens, caches, owed_hidden, blocks)   # from a sequence's live caches
    caches, owed_hidden = materialize(snap, blocks)        # fresh caches holding the same state

What a snapshot of n tokens holds:
- attention KV (backbone layers and the MTP head) in fixed-size token blocks
  shared by every snapshot with the same prefix (vLLM-style: block i is named
  by a hash chained over tokens[0 : (i+1)B], so equal names mean equal
  prefixes), plus its own tail past the last full block;
- per GatedDeltaNet layer, the conv window and the recurrent state after the n
  tokens (these cannot be cut back or shared: each snapshot has its own), and on a
  qwen4_exp PLE layer its n-gram and conv windows as well;
- on qwen4_exp's indexed attention layers, the indexer's keys with the keys and
  values (a third part, blocked alike);
- the owed backbone hiddens H[head_offset .. n-1], whose head entries need the
  next token (see `OwedPairs`).

The head's KV entry at position p is f(H[p], x[p+1]): it depends on tokens up
to p+1, so head block i holds the entries [iB-1, (i+1)B-1) (block 0: [0, B-1)),
all of which depend only on tokens[0 : (i+1)B], the same prefix as backbone
block i.

Quantized KV (`--kv-bits`) is stored as the caches hold it: each keys or
values part a (packed, scales, biases) triple, counted at its real bytes.
Names (block hashes, snapshot keys) are salted with the KV setting, so a
snapshot taken at one setting is never found, shared or restored at another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence as Seq, Tuple

import mlx.core as mx
import numpy as np

from mtp_serve.models.caches import FULL_KV, KVSetting, SpeculativeGDNCache, kv_concatenate, kv_length, kv_map, kv_nbytes
from mtp_serve.models.qwen4_exp import IndexKeys, indexed_kv_cache
from mtp_serve.models.qwen4_exp_mtp import Qwen4ExpGDNCache

from ..sequence import RowCaches

BLOCK_TOKENS = 256
Pair = Tuple[Any, Any]  # (keys, values): arrays, or quantized (packed, scales, biases) triples


def kv_salt(kv: KVSetting) -> str:
    """What a KV setting adds to names ("" at full precision: names as before quantized KV)."""
    return "" if not kv.quantized else kv.tag


def block_hashes(tokens: np.ndarray, block: int = BLOCK_TOKENS, salt: str = "") -> List[str]:
    """Names of the full blocks of `tokens`: hash i covers tokens[0 : (i+1)*block]
    (and the KV setting's `salt`)."""
    out, h = [], salt.encode()
    for i in range(len(tokens) // block):
        h = hashlib.blake2b(h + tokens[i * block : (i + 1) * block].tobytes(), digest_size=16).digest()
        out.append(h.hex())
    return out


def as_tokens(tokens: Seq[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def snapshot_key(tokens: Seq[int], salt: str = "") -> str:
    """A snapshot's name: a hash of all its tokens (and the KV setting's `salt`)."""
    return hashlib.blake2b(salt.encode() + as_tokens(tokens).tobytes(), digest_size=16).hexdigest()


def head_span(i: int, block: int = BLOCK_TOKENS) -> Tuple[int, int]:
    """Head KV entries that head block i holds."""
    return max(0, i * block - 1), (i + 1) * block - 1


def _own(x: Any) -> Any:
    """A copy with its own buffer: a slice of a live cache would keep the whole
    cache buffer alive (and make its next in-place update copy it)."""
    return kv_map(mx.array, x)


def _nbytes(parts) -> int:
    return sum(kv_nbytes(a) for a in parts)


@dataclass(eq=False)
class Block:
    """KV of one token block: per attention layer (keys, values) for positions
    [iB, (i+1)B), and the head's entries head_span(i) once a snapshot had them."""

    kv: List[Pair]
    head: Optional[Pair] = None
    refs: int = 0  # snapshots using it

    @property
    def nbytes(self) -> int:
        return _nbytes([a for pair in self.kv + ([self.head] if self.head else []) for a in pair])


@dataclass(eq=False)
class Snapshot:
    tokens: np.ndarray  # int32 [n]
    chain: List[str]  # block_hashes(tokens)
    linear: Tuple[bool, ...]  # per layer: GatedDeltaNet (else attention)
    layers: List[Pair]  # per layer: (conv window, state[, n-gram window, PLE conv window]), or the attention
    # (keys, values[, indexer keys]) past the full blocks
    head_blocks: int  # leading blocks whose head entries are used (0 without a head)
    head_tail: Optional[Pair]  # head KV entries [head_start, head_offset); None: no head
    owed: Optional[mx.array]  # [1, n - head_offset, H]
    kv: KVSetting = FULL_KV  # the attention KV's setting
    # Bookkeeping of the tier holding it.
    last_used: float = 0.0
    parent: Optional["Snapshot"] = None
    children: List["Snapshot"] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.tokens)

    @cached_property
    def key(self) -> str:
        return snapshot_key(self.tokens, kv_salt(self.kv))

    @property
    def tail(self) -> np.ndarray:
        return self.tokens[len(self.chain) * BLOCK_TOKENS :]

    @property
    def has_head(self) -> bool:
        return self.head_tail is not None

    @property
    def head_start(self) -> int:
        return head_span(self.head_blocks)[0] if self.head_blocks else 0

    @property
    def nbytes(self) -> int:
        """Bytes of its own (shared blocks not counted)."""
        own = [a for pair in self.layers + ([self.head_tail] if self.head_tail else []) for a in pair]
        return _nbytes(own + [self.owed]) + self.tokens.nbytes

    def extends(self, other: "Snapshot") -> bool:
        """`other`'s tokens are a prefix of this snapshot's."""
        return other.n <= self.n and np.array_equal(self.tokens[: other.n], other.tokens)


class BlockStore:
    """Blocks by name, with the snapshots using each counted; a block goes when its last user does."""

    def __init__(self) -> None:
        self.blocks: Dict[str, Block] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, name: str, block: Block) -> Block:
        """Adds a block (or the head part it lacks); returns the stored one."""
        have = self.blocks.get(name)
        if have is None:
            self.blocks[name] = block
            self.nbytes += block.nbytes
            return block
        if have.head is None and block.head is not None:
            have.head = block.head
            self.nbytes += _nbytes(block.head)
        return have

    def acquire(self, snap: Snapshot) -> None:
        for name in snap.chain:
            self.blocks[name].refs += 1

    def release(self, snap: Snapshot) -> None:
        for name in snap.chain:
            block = self.blocks[name]
            block.refs -= 1
            if block.refs == 0:
                del self.blocks[name]
                self.nbytes -= block.nbytes


def capture(tokens: Seq[int], caches: RowCaches, owed: Optional[mx.array], store: BlockStore) -> Snapshot:
    """Snapshot the caches holding exactly `tokens`; blocks the store lacks are copied into it
    (it does not count them as used until `store.acquire`)."""
    toks = as_tokens(tokens)
    linear = tuple(isinstance(c, SpeculativeGDNCache) for c in caches.backbone)
    attention = [c for c, lin in zip(caches.backbone, linear) if not lin]
    setting = KVSetting.of(attention[0] if attention else caches.head) if attention or caches.head is not None else FULL_KV
    n, chain = len(toks), block_hashes(toks, salt=kv_salt(setting))
    full = len(chain) * BLOCK_TOKENS
    if any(c.offset != n for c in attention):
        raise ValueError(f"caches hold {attention[0].offset} tokens, not the snapshot's {n}")
    head = caches.head
    head_offset = head.offset if head is not None else 0
    head_blocks = 0
    if head is not None:  # leading blocks whose head entries are all computed
        head_blocks = min(len(chain), (head_offset + 1) // BLOCK_TOKENS)
    fresh: List[mx.array] = []

    def cut(c, start: int, end: int) -> Pair:
        parts = (c.keys, c.values) + ((c.index_keys,) if isinstance(c, IndexKeys) else ())
        pair = tuple(_own(kv_map(lambda x: x[..., start:end, :], p)) for p in parts)
        fresh.extend(pair)
        return pair

    def windows(c) -> tuple:
        ple = getattr(c, "ple", None)  # a qwen4_exp PLE layer's n-gram and conv windows
        return (_own(c[0]), _own(c[1])) + ((_own(ple.ngram), _own(ple.conv)) if ple is not None else ())

    for i, name in enumerate(chain):
        have = store.blocks.get(name)
        needs_head = i < head_blocks and (have is None or have.head is None)
        if have is None or needs_head:
            kv = have.kv if have is not None else [cut(c, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS) for c in attention]
            store.add(name, Block(kv, cut(head, *head_span(i)) if needs_head else None))
    layers = []
    for c, lin in zip(caches.backbone, linear):
        pair = windows(c) if lin else cut(c, full, n)
        fresh.extend(pair)
        layers.append(pair)
    head_tail = cut(head, head_span(head_blocks)[0] if head_blocks else 0, head_offset) if head is not None else None
    owed_copy = _own(owed) if head is not None and owed is not None else None
    mx.eval(fresh, owed_copy if owed_copy is not None else [])
    return Snapshot(toks, chain, linear, layers, head_blocks, head_tail, owed_copy, setting)


def _kv_cache(parts: List[Any], values: List[Any], kv: KVSetting, index: Optional[List[mx.array]] = None) -> Any:
    """An attention cache at setting `kv` holding the concatenated parts (and, with `index`,
    the QSA indexer's keys: an indexed cache), with a step of free positions so the next
    update writes in place instead of reallocating."""
    cache = kv.make() if index is None else indexed_kv_cache(kv)
    room = cache.step
    k, v = kv_concatenate(parts), kv_concatenate(values)
    cache.offset = kv_length(k)
    pad = lambda x: mx.concatenate([x, mx.zeros(x.shape[:2] + (room,) + x.shape[3:], x.dtype)], axis=2)  # noqa: E731
    cache.keys, cache.values = kv_map(pad, k), kv_map(pad, v)
    if index is not None:
        i = mx.concatenate(index, axis=1)
        cache.index_keys = mx.concatenate([i, mx.zeros((i.shape[0], room, i.shape[2]), i.dtype)], axis=1)
    return cache


def materialize(snap: Snapshot, store: BlockStore) -> Tuple[RowCaches, Optional[mx.array]]:
    """Fresh caches holding the snapshot's state, and its owed hiddens."""
    blocks = [store.blocks[name] for name in snap.chain]
    backbone: List[Any] = []
    j = 0  # attention layer index
    for lin, (a, b, *extra) in zip(snap.linear, snap.layers):
        if lin:
            c = Qwen4ExpGDNCache(ple=True) if extra else SpeculativeGDNCache()
            c.cache = [a, b]  # never updated in place: the layer stores new arrays
            if extra:
                c.ple.ngram, c.ple.conv = extra
        else:
            index = [blk.kv[j][2] for blk in blocks] + extra if extra else None
            c = _kv_cache([blk.kv[j][0] for blk in blocks] + [a], [blk.kv[j][1] for blk in blocks] + [b], snap.kv, index)
            j += 1
        backbone.append(c)
    head = None
    if snap.head_tail is not None:
        used = blocks[: snap.head_blocks]
        head = _kv_cache([blk.head[0] for blk in used] + [snap.head_tail[0]], [blk.head[1] for blk in used] + [snap.head_tail[1]],
                         snap.kv)
    mx.eval([c.state for c in backbone], head.state if head is not None else [])
    return RowCaches(backbone, head), snap.owed
