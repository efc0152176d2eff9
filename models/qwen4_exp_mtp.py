"""qwen4_exp as the engine sees it: `MTPModel` over the project's own backbone (models/qwen4_exp.py).

The backbone's layers need the token ids (PLE) and carry several residual streams, so
`forward` runs the model's own layer loop instead of mlx-lm's layers through the compiled
and prefill paths. Caches: a `Qwen4ExpGDNCache` per GatedDeltaNet layer (the GatedDeltaNet
state plus, with PLE, the n-gram and conv windows, all cut at the accepted length after
a verify), an `IndexedKVCache` per attention layer (trimmed with the indexer's keys).
Parts not built yet refuse with `qwen4_exp: <part> is not supported yet`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import mlx.core as mx

from mtp_serve.backend import blas_threads_for

from . import qwen4_exp
from .caches import FULL_KV, KVSetting, SpeculativeGDNCache
from .mtp_model import MTPModel
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
    # Why the engine must not batch rows of this family or keep its snapshots on disk (batched
    # rows and snapshot files would drop the indexer's keys and the PLE windows).
    batching_unsupported = qwen4_exp.unsupported("batched decoding").args[0]
    prompt_cache_disk_unsupported = qwen4_exp.unsupported("the prompt cache's disk tier").args[0]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled = None  # mlx-lm-layer paths; this backbone runs its own loop
        self.prefill = None

    def make_cache(self) -> List[Any]:
        return [Qwen4ExpGDNCache(ple=l.has_ple) if l.is_linear else qwen4_exp.IndexedKVCache() for l in self.layers]

    kv_bits_unsupported = qwen4_exp.unsupported("quantized KV (--kv-bits)").args[0]

    def use_kv(self, kv: KVSetting) -> None:
        if kv.quantized:
            raise ValueError(self.kv_bits_unsupported)
        self.kv = kv

    def kv_attention(self) -> str:
        return "decode attention: full precision"

    def kv_bytes_per_token(self) -> int:
        args = self.text.args
        itemsize = self.inner.embed_tokens.weight.dtype.size
        attn = sum(not l.is_linear for l in self.layers)
        per = 2 * args.num_key_value_heads * args.head_dim + (args.indexer_head_dim or 0)
        head = 2 * args.num_key_value_heads * args.head_dim if self.has_mtp else 0
        return (attn * per + head) * itemsize

    def ngram_table_bytes(self) -> int:
        return qwen4_exp.ngram_table_bytes(self.inner)

    def memory_note(self) -> str:
        return f"PLE n-gram tables {self.ngram_table_bytes() / 2**20:,.1f} MiB; "

    def forward(self, tokens: mx.array, cache: List[Any], last_logits: bool = False, *,
                embeds: Optional[mx.array] = None, rope: Optional[RopePositions] = None) -> Tuple[mx.array, mx.array]:
        if embeds is not None or rope is not None:
            raise ValueError(qwen4_exp.unsupported("image input").args[0])
        blas_threads_for(tokens.size)
        h = self.inner(tokens, cache)
        return h, self.lm_head(h[:, -1:] if last_logits else h)
