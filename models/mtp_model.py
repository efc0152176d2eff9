"""A backbone from mlx-lm plus its MTP head, as the engine sees them.

`forward` runs the backbone and returns both the logits and the hidden the
head consumes (post- or pre-final-norm, per the model card); `draft` runs the
head. Nothing here knows about rounds, sampling or requests.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mtp_serve.backend import blas_threads_for

from .activations import install_native_activations
from .caches import FULL_KV, KVSetting, SpeculativeGDNCache
from .compiled_steps import MAX_COMPILED_TOKENS, CompiledLayers, attention_layer_at
from .draft_vocab import DraftVocab
from .model_card import ModelCard
from .mlx_lm_compat import KVCache, create_attention_mask, create_ssm_mask, gather_last_axis
from .mtp_head import MTPHead
from .prefill_layers import PrefillLayers
from .quantized_attention import native_supported
from .rope_positions import RopePositions
from .sharding import local_layers, pipeline_stage


class MTPModel:
    def __init__(self, model: nn.Module, text: nn.Module, head: Optional[MTPHead], card: ModelCard, model_type: str):
        self.model = model  # the mlx-lm Model (what mlx-lm's generate_step accepts)
        self.text = text  # the module holding `.model` (embed, layers, norm) and the LM head
        self.head = head
        self.card = card
        self.model_type = model_type
        install_native_activations(model, head)  # MLX's bits, faster on CPU (models/activations.py)
        # Short decode inputs run through compiled layers (see compiled_steps.py);
        # None runs mlx-lm's layers as they are.
        self.compiled: Optional[CompiledLayers] = CompiledLayers()
        self.stage = pipeline_stage(self.inner)  # this rank's place in a pipeline split, or None
        # Longer inputs (prefill chunks) on CPU run through PrefillLayers (blockwise
        # attention, fast activations); None, or a GPU, runs mlx-lm's layers.
        self.prefill: Optional[PrefillLayers] = PrefillLayers() if mx.default_device() == mx.cpu else None
        # The head's drafts score only this subset of the vocabulary (None: all of it).
        self.draft_vocab: Optional[DraftVocab] = None
        # Precision of every attention cache, the backbone's and the head's (--kv-bits).
        self.kv: KVSetting = FULL_KV
        # The vision tower of a vision-language checkpoint (models/vision), None for text only.
        self.vision: Optional[Any] = None

    @property
    def inner(self) -> nn.Module:
        return self.text.model

    @property
    def layers(self) -> list:
        return local_layers(self.inner)

    @property
    def has_mtp(self) -> bool:
        return self.head is not None

    @property
    def vocab_size(self) -> int:
        return self.inner.embed_tokens.weight.shape[0]

    def make_cache(self) -> List[Any]:
        return [SpeculativeGDNCache() if l.is_linear else self.kv.make() for l in self.layers]

    def make_head_cache(self) -> Any:
        return self.kv.make()

    def use_kv(self, kv: KVSetting) -> None:
        """Keep attention KV at this setting from now on (caches made before keep theirs).
        Raises ValueError when the group size does not divide the head dimension."""
        kv.check([self.text.args.head_dim])
        self.kv = kv
        if kv.quantized:
            self.kv_attention()  # loads (or builds) the native kernel now, not at the first decode step

    def kv_attention(self) -> str:
        """Which decode attention a quantized KV setting gets (start-up line)."""
        dtype = self.inner.norm.weight.dtype
        if native_supported(self.text.args.head_dim, self.kv.group_size, self.kv.bits, dtype):
            return "decode attention on mtp-serve's kernel"
        return "decode attention: mlx-lm's quantized attention"

    def kv_bytes_per_token(self) -> int:
        """Attention KV bytes one token adds at the current setting: every attention layer's
        keys and values, the head's included (at the dtype the layers compute in)."""
        args = self.text.args
        layers = sum(not l.is_linear for l in self.layers) + (1 if self.has_mtp else 0)
        itemsize = self.inner.norm.weight.dtype.size
        return 2 * layers * args.num_key_value_heads * self.kv.bytes_per_vector(args.head_dim, itemsize)

    def memory_note(self) -> str:
        """What the start-up line adds about this model's memory ("" or a clause ending in "; ")."""
        return ""

    def use_draft_vocab(self, ids: Optional[List[int]]) -> None:
        """Draft from these token ids only (None: the whole vocabulary)."""
        if ids is None:
            self.draft_vocab = None
            return
        rows = self.inner.embed_tokens if self.text.args.tie_word_embeddings else self.text.lm_head
        self.draft_vocab = DraftVocab(ids, rows)

    def drafts_note(self) -> str:
        """What a draft reads, for start-up lines: the head's precision and the vocabulary."""
        bits = sorted({m.bits for _, m in self.head.named_modules() if isinstance(m, nn.QuantizedLinear)})
        head = f"the {'/'.join(map(str, bits))}-bit head" if bits else "the unquantized head"
        vocab = f"the {self.draft_vocab.size} most frequent tokens" if self.draft_vocab is not None else "the whole vocabulary"
        return f"drafts from {head} over {vocab}"

    def draft_argmax(self, logits: mx.array) -> mx.array:
        """Token ids of the best draft scores (`draft` logits, over the draft vocabulary if set)."""
        best = mx.argmax(logits, axis=-1)
        return self.draft_vocab.ids[best] if self.draft_vocab is not None else best

    def lm_head(self, h: mx.array) -> mx.array:
        if self.text.args.tie_word_embeddings:
            return self.inner.embed_tokens.as_linear(h)
        logits = self.text.lm_head(h)
        group = getattr(self.text, "sharding_group", None)  # tensor parallel: each rank computes a slice of the vocabulary
        return logits if group is None else gather_last_axis(logits, group)

    def forward(self, tokens: mx.array, cache: List[Any], last_logits: bool = False, *,
                embeds: Optional[mx.array] = None, rope: Optional[RopePositions] = None) -> Tuple[mx.array, mx.array]:
        """Backbone over tokens [B,T]; returns (hidden for the head [B,T,H], logits [B,T,V]),
        with `last_logits` the logits of the last position only [B,1,V] (a prefill needs
        no others; at 8,192 tokens the LM head over all of them was 2% of the demo
        model's prefill, and it grows with the vocabulary). `embeds` replaces the
        tokens' embeddings (image features in place of image tokens); `rope`: positions
        other than the cache offsets (rows of prompts with images)."""
        inner = self.inner
        blas_threads_for(tokens.size)
        h = inner.embed_tokens(tokens) if embeds is None else embeds
        # (A pipeline stage may hold no attention or no GatedDeltaNet layer.)
        fa_mask = create_attention_mask(h, cache[inner.fa_idx]) if inner.fa_idx is not None else None
        ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx]) if inner.ssm_idx is not None else None
        if self.stage is not None:
            h = self.stage.receive(h)
        for layer, c in zip(self.layers, cache):
            h = self.run_layer(layer, h, ssm_mask if layer.is_linear else fa_mask, c, rope)
        if self.stage is not None:
            h = self.stage.pass_on(h)
        post = inner.norm(h)
        return (post if self.card.mtp_hidden == "post_norm" else h), self.lm_head(post[:, -1:] if last_logits else post)

    def draft(self, hidden: mx.array, next_tokens: mx.array, head_cache: KVCache,
              rope: Optional[RopePositions] = None) -> Tuple[mx.array, mx.array]:
        """Head over pairs (hidden[p], next_tokens[p]); returns (head hidden, logits), the
        logits over the draft vocabulary when one is set (`draft_vocab.ids` maps them).
        The head's entry p sits where the backbone's token p does (`rope`)."""
        out = self.head_pass(hidden, next_tokens, head_cache, rope)
        return out, self.draft_logits(out)

    def head_pass(self, hidden: mx.array, next_tokens: mx.array, head_cache: KVCache,
                  rope: Optional[RopePositions] = None) -> mx.array:
        """`draft`'s head hidden alone (when only some positions' logits are wanted)."""
        blas_threads_for(next_tokens.size)
        run_layer = self.run_layer if rope is None else (lambda l, x, m, c: self.run_layer(l, x, m, c, rope))
        return self.head(hidden, self.inner.embed_tokens(next_tokens), head_cache, run_layer=run_layer)

    def draft_logits(self, out: mx.array) -> mx.array:
        """Draft scores of head hidden `out`: over the draft vocabulary when one is set."""
        return self.draft_vocab.logits(out) if self.draft_vocab is not None else self.lm_head(out)

    def run_layer(self, layer: nn.Module, h: mx.array, mask: Any, cache: Any,
                  rope: Optional[RopePositions] = None) -> mx.array:
        """One decoder layer: compiled for decode-sized inputs, PrefillLayers for long ones."""
        if rope is not None and layer.is_linear:
            rope = None  # GatedDeltaNet layers have no positions
        if self.prefill is not None and h.shape[1] > MAX_COMPILED_TOKENS:
            return self.prefill(layer, h, mask, cache, rope)
        if self.compiled is not None:
            return self.compiled(layer, h, mask, cache, rope)
        if rope is not None:
            return attention_layer_at(layer, h, mask, cache, rope)
        return layer(h, mask=mask, cache=cache)
