"""qwen4_exp as the engine sees it: `MTPModel` over the project's own backbone (models/qwen4_exp.py).

The backbone's layers need the token ids (PLE) and carry several residual streams, so
`forward` runs the model's own layer loop instead of mlx-lm's layers through the compiled
and prefill paths. A batch runs that loop once for all rows, with the GatedDeltaNet states
and PLE windows stacked (`BatchGDNCache`) and each row's attention on its own indexed cache
(`RowsKVCache`). Caches: a `Qwen4ExpGDNCache` per GatedDeltaNet layer (the GatedDeltaNet
state plus, with PLE, the n-gram and conv windows, all cut at the accepted length after
a verify), an indexed KV cache per attention layer (`qwen4_exp.IndexKeys`: full precision or,
with `--kv-bits`, quantized; trimmed with the indexer's keys).
Prompts with images: the tower is Qwen3.5's (models/vision/); positions reach the backbone
as explicit multimodal positions (`positions_of`). Parts not built yet refuse with
`qwen4_exp: <part> is not supported yet`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import mlx.core as mx

from mtp_serve.backend import blas_threads_for

from . import qwen4_exp
from .caches import KVSetting, SpeculativeGDNCache
from .mtp_model import MTPModel
from .quantized_attention import native_supported
from .rope_positions import RopePositions


class Qwen4ExpGDNCache(SpeculativeGDNCache):
    """A GatedDeltaNet layer's cache plus its PLE windows (`ple`, None without PLE)."""

    def __init__(self, left_padding: Optional[List[int]] = None, ple: bool = False):
        super().__init__(left_padding)
        self.ple = qwen4_exp.PLEState() if ple else None

    def select(self, accepted_tokens) -> None:
        if self.ple is not None:
            self.ple.keep(accepted_tokens)
        super().select(accepted_tokens)


class Qwen4ExpMTPModel(MTPModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled = None  # mlx-lm-layer paths; this backbone runs its own loop
        self.prefill = None

    def make_cache(self) -> List[Any]:
        return [Qwen4ExpGDNCache(ple=l.has_ple) if l.is_linear else qwen4_exp.indexed_kv_cache(self.kv) for l in self.layers]

    def compute_dtype(self) -> mx.Dtype:
        # There is no final norm; the mixer's norm stays unquantized in a quantized body.
        return self.inner.hyper_connection_mixer.hc_norm.weight.dtype

    def kv_attention(self) -> str:
        if not self.kv.quantized:
            return "decode attention: full precision"
        if native_supported(self.text.args.head_dim, self.kv.group_size, self.kv.bits, self.compute_dtype()):
            return "decode attention on mtp-serve's kernel"
        return "decode attention: mlx-lm's quantized attention"

    def kv_bytes_per_token(self) -> int:
        """Attention KV bytes a token adds: keys and values at the KV setting, the indexer's key
        at the compute dtype (kept unquantized), the head's keys and values."""
        args = self.text.args
        itemsize = self.compute_dtype().size
        attn = sum(not l.is_linear for l in self.layers)
        pair = 2 * args.num_key_value_heads * self.kv.bytes_per_vector(args.head_dim, itemsize)
        per = pair + (args.indexer_head_dim or 0) * itemsize
        return attn * per + (pair if self.has_mtp else 0)

    def ngram_table_bytes(self) -> int:
        return qwen4_exp.ngram_table_bytes(self.inner)

    def memory_note(self) -> str:
        mapped = " memory-mapped" if qwen4_exp.tables_mapped(self.inner) else ""
        return f"PLE n-gram tables {self.ngram_table_bytes() / 2**20:,.1f} MiB{mapped}; "

    def forward(self, tokens: mx.array, cache: List[Any], last_logits: bool = False, *,
                embeds: Optional[mx.array] = None, rope: Optional[RopePositions] = None) -> Tuple[mx.array, mx.array]:
        """`MTPModel.forward` on this backbone: `embeds` (image features in place of image
        tokens; PLE still hashes the token ids) and `rope` (a prompt chunk's explicit
        positions, or each row's shift after its images) as there."""
        blas_threads_for(tokens.size)
        if any(isinstance(c, RowsKVCache) for c in cache):  # a batch: one backbone pass, attention row by row
            attn = next(c for c in cache if isinstance(c, RowsKVCache))
            positions = [positions_of(rope, [c], tokens.shape[1], i) for i, c in enumerate(attn.rows)]
            h = self.inner(tokens, cache, embeds, None if all(p is None for p in positions) else positions)
        else:
            h = self.inner(tokens, cache, embeds, positions_of(rope, cache, tokens.shape[1]))
        return h, self.lm_head(h[:, -1:] if last_logits else h)


def positions_of(rope: Optional[RopePositions], cache: List[Any], T: int, row: int = 0) -> Optional[mx.array]:
    """Multimodal positions [1, 3, T] of one row's forward of T tokens (None: its indices):
    a prompt chunk's own grid, or the row's cache offset plus its shift."""
    if rope is None:
        return None
    if rope.grid is not None:
        return rope.grid[None]
    delta = rope.delta if isinstance(rope.delta, int) else int(rope.delta[row].item())
    if not delta:
        return None
    offset = next((c.offset for c in cache if isinstance(c, qwen4_exp.IndexKeys)), 0)
    return qwen4_exp.text_positions(offset, T, delta)


class RowsCache:
    """One attention layer's caches for a batch of qwen4_exp rows, kept as the rows' own
    single-row caches: rows differ in length, and the indexer groups each row's own keys into
    blocks, so each row attends on its own cache (`DecoderLayer` runs the attention row by row;
    the rest of the backbone runs batched). The engine's batch operations act row by row."""

    def __init__(self, rows: List[Any]):
        self.rows = list(rows)

    # -- the batch's operations (engine/batch.py)
    def extend(self, other: "RowsCache") -> None:
        self.rows += other.rows

    def filter(self, batch_indices) -> None:
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.rows = [self.rows[i] for i in keep]

    def extract(self, idx: int) -> Any:
        return self.rows[idx]

    @property
    def state(self) -> list:
        return [c.state for c in self.rows]


class BatchGDNCache(Qwen4ExpGDNCache):
    """The rows' GatedDeltaNet states and PLE windows stacked along the batch axis (every row's
    windows have the same size), so these layers run once for all rows; a commit keeps each
    row's own accepted length."""

    @classmethod
    def of_rows(cls, rows: List[Qwen4ExpGDNCache]) -> "BatchGDNCache":
        merged = cls(ple=rows[0].ple is not None)
        merged.cache = [mx.concatenate([r[i] for r in rows]) for i in range(2)]
        if merged.ple is not None:
            merged.ple.ngram = mx.concatenate([r.ple.ngram for r in rows])
            merged.ple.conv = mx.concatenate([r.ple.conv for r in rows])
        return merged

    def filter(self, batch_indices) -> None:
        super().filter(batch_indices)
        if self.ple is not None:
            self.ple.ngram, self.ple.conv = self.ple.ngram[batch_indices], self.ple.conv[batch_indices]

    def extend(self, other: "BatchGDNCache") -> None:
        super().extend(other)
        if self.ple is not None:
            self.ple.ngram = mx.concatenate([self.ple.ngram, other.ple.ngram])
            self.ple.conv = mx.concatenate([self.ple.conv, other.ple.conv])

    def extract(self, idx: int) -> Qwen4ExpGDNCache:
        row = Qwen4ExpGDNCache(ple=self.ple is not None)
        row.cache = [c[idx : idx + 1] for c in self.cache]
        if self.ple is not None:
            row.ple.ngram, row.ple.conv = self.ple.ngram[idx : idx + 1], self.ple.conv[idx : idx + 1]
        return row


class RowsKVCache(RowsCache):
    """Indexed attention caches of the rows; a rejection trims each row by its own count."""

    def trim_rows(self, rejected: List[int]) -> None:
        for c, n in zip(self.rows, rejected):
            if n:
                c.trim(n)


def merge_rows(layers: List[List[Any]]) -> List[RowsCache]:
    """Per backbone layer, the rows' caches (`layers[l][i]`: row i's cache of layer l) as the
    batch's: attention layers' side by side (RowsKVCache), GatedDeltaNet layers' stacked."""
    return [RowsKVCache(rs) if isinstance(rs[0], qwen4_exp.IndexKeys) else BatchGDNCache.of_rows(rs) for rs in layers]


def holds_rows(caches: List[Any]) -> bool:
    """Whether these backbone caches are qwen4_exp's (merged per row in a batch)."""
    return any(isinstance(c, (qwen4_exp.IndexKeys, RowsCache)) for c in caches)
