"""qwen4_exp as the engine sees it: `MTPModel` over the project's own backbone (models/qwen4_exp.py).

The backbone's layers need the token ids (PLE) and carry several residual streams, so
`forward` runs the model's own layer loop instead of mlx-lm's layers through the compiled
and prefill paths; a batch runs row by row on the rows' own caches (`RowsCache`). Caches: a `Qwen4ExpGDNCache` per GatedDeltaNet layer (the GatedDeltaNet
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
        if cache and isinstance(cache[0], RowsCache):  # a batch: each row on its own caches
            rows = []
            for i in range(tokens.shape[0]):
                row_cache = [c.rows[i] for c in cache]
                e = None if embeds is None else embeds[i : i + 1]
                rows.append(self.inner(tokens[i : i + 1], row_cache, e, positions_of(rope, row_cache, tokens.shape[1], i)))
            h = mx.concatenate(rows)
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
    """One layer's caches for a batch of qwen4_exp rows, kept as the rows' own single-row
    caches: the backbone runs each row on its own (`Qwen4ExpMTPModel.forward`), so a row's
    numbers are those of its single-sequence decoding, and the indexer's block grouping and the
    PLE windows need no padding or holes. The engine's batch operations act row by row."""

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


class RowsGDNCache(RowsCache, SpeculativeGDNCache):
    """GatedDeltaNet (and PLE) caches of the rows; a commit keeps each row's own length."""

    def __init__(self, rows: List[Any]):
        RowsCache.__init__(self, rows)
        self._capturing = False

    @property
    def capturing(self) -> bool:
        return self._capturing

    @capturing.setter
    def capturing(self, on: bool) -> None:
        self._capturing = on
        for c in getattr(self, "rows", []):
            c.capturing = on

    def select(self, accepted_tokens) -> None:
        n = accepted_tokens if isinstance(accepted_tokens, int) else None
        per_row = [n] * len(self.rows) if n is not None else accepted_tokens.tolist()
        for c, k in zip(self.rows, per_row):
            c.select(int(k))

    @property
    def state(self) -> list:
        return [c.state for c in self.rows]


class RowsKVCache(RowsCache):
    """Indexed attention caches of the rows; a rejection trims each row by its own count."""

    def trim_rows(self, rejected: List[int]) -> None:
        for c, n in zip(self.rows, rejected):
            if n:
                c.trim(n)


def merge_rows(layers: List[List[Any]]) -> List[RowsCache]:
    """Per backbone layer, the rows' caches (`layers[l][i]`: row i's cache of layer l) as one
    RowsCache."""
    return [RowsKVCache(rs) if isinstance(rs[0], qwen4_exp.IndexKeys) else RowsGDNCache(rs) for rs in layers]


def holds_rows(caches: List[Any]) -> bool:
    """Whether these backbone caches are qwen4_exp's (merged per row in a batch)."""
    return any(isinstance(c, (qwen4_exp.IndexKeys, RowsCache)) for c in caches)
