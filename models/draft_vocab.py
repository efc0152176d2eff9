"""A draft vocabulary: the MTP head scores only the most frequent tokens.

At real vocabulary sizes the head's LM head is most of a draft's cost (Qwen3.5
has ~248k tokens: for the 0.8B-2B models one draft reads the whole embedding
matrix, a third of the 0.8B model). Drafting from the N most frequent tokens
reads N rows instead. Exactness does not depend on it: the verify pass decides
every token. Greedy drafts are the argmax over the subset; sampled drafts come
from the request's pipeline over the subset (other tokens at -inf), which is
then the q of the rejection test.

The list lives with the checkpoint: `draft_vocab.json`, token ids most frequent
first, measured once on text (`measure_draft_vocab`, or `mtp-tune
--draft-vocab-text FILE`) or, without text, the tokenizer's own order
(`tokenizer_order`, what `mtp-tune` writes by default for a quantized body); its
size in use is a setting (`--draft-vocab N`, or `draft_vocab_size` as `mtp-tune`
chose it).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .quantized_layers import quantized_matmul, rows_of

DRAFT_VOCAB_FILE = "draft_vocab.json"


class DraftVocab:
    """The LM-head rows of a token subset, gathered once into their own matrix."""

    def __init__(self, ids: List[int], embed_or_head: nn.Module):
        self.ids = mx.array(sorted(set(ids)), dtype=mx.uint32)
        self.size = self.ids.size
        if isinstance(embed_or_head, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
            self._quant = dict(group_size=embed_or_head.group_size, bits=embed_or_head.bits,
                               mode=getattr(embed_or_head, "mode", "affine"))
            self._w, self._scales, self._biases = rows_of(embed_or_head, self.ids)
            mx.eval(self._w, self._scales, self._biases if self._biases is not None else [])
        else:
            self._quant = None
            self._w = mx.contiguous(embed_or_head.weight[self.ids])
            mx.eval(self._w)

    def logits(self, h: mx.array) -> mx.array:
        """[..., N] scores of the subset's tokens (ids: `self.ids`)."""
        if self._quant is None:
            return h @ self._w.T
        return quantized_matmul(h, self._w, self._scales, self._biases, **self._quant)

    def to_vocab(self, logits: mx.array, vocab_size: int) -> mx.array:
        """Subset scores [R, N] -> full-vocabulary scores [R, V], -inf outside the subset."""
        full = mx.full((logits.shape[0], vocab_size), -mx.inf, dtype=logits.dtype)
        full[:, self.ids] = logits
        return full


def load_draft_ids(model_dir: Path, size: int) -> Optional[List[int]]:
    """The first `size` ids of the checkpoint's draft vocabulary, or None without one."""
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    if size <= 0 or not path.exists():
        return None
    ids = json.loads(path.read_text())["ids"]
    return ids[:size]


def measure_draft_vocab(encode, texts: Iterable[str], always: Iterable[int] = ()) -> List[int]:
    """Token ids by frequency over `texts` (most frequent first), `always` first of all
    (special tokens a grammar or a chat turn needs, e.g. end of output)."""
    counts: Counter = Counter()
    for text in texts:
        counts.update(encode(text))
    first = list(dict.fromkeys(always))
    return first + [t for t, _ in counts.most_common() if t not in set(first)]


def tokenizer_order(vocab_size: int, always: Iterable[int] = ()) -> List[int]:
    """Every id in the tokenizer's own order, `always` first: a byte-pair vocabulary is
    numbered in the order its merges were learned, most frequent first, so this is a
    frequency ranking of the tokenizer's training text (the fallback when no text of
    the user's was measured)."""
    first = [t for t in dict.fromkeys(always) if 0 <= t < vocab_size]
    seen = set(first)
    return first + [t for t in range(vocab_size) if t not in seen]


def save_draft_vocab(model_dir: Path, ids: List[int], source: str) -> Path:
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps({"source": source, "ids": ids}))
    return path
