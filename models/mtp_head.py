"""The checkpoint's own MTP head (Qwen3.5 / Qwen3.6 / Qwen3-Next).

    e   = pre_fc_norm_embedding(embed_tokens(x[p+1]))
    h   = pre_fc_norm_hidden(H[p])
    z   = fc(concat([e, h]))            # order from the model card
    z   = DecoderLayer(full attention)(z, position p, own KV cache)
    out = norm(z)                        # fed back as the next draft's hidden
    logits = lm_head(out)                # shared with the backbone

Weights load under the names the checkpoint uses after the `mtp.` prefix.
The decoder layer is mlx-lm's own (dense or MoE), built at a full-attention
layer index.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .mlx_lm_compat import create_attention_mask


class MTPHead(nn.Module):
    def __init__(self, args: Any, decoder_layer_cls: type, embedding_first: bool = True):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = [decoder_layer_cls(args, layer_idx=args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(H, eps=eps)
        self._embedding_first = embedding_first

    def __call__(
        self, hidden: mx.array, embeddings: mx.array, cache: Optional[Any] = None, run_layer: Optional[Callable] = None
    ) -> mx.array:
        """hidden [B,T,H] from the backbone (or the previous draft), embeddings of the next tokens.

        `run_layer(layer, x, mask, cache)`, when given, runs the decoder layer
        (the engine passes its compiled-layer runner)."""
        e = self.pre_fc_norm_embedding(embeddings)
        h = self.pre_fc_norm_hidden(hidden)
        z = self.fc(mx.concatenate([e, h] if self._embedding_first else [h, e], axis=-1))
        mask = create_attention_mask(z, cache)
        layer = self.layers[0]
        z = run_layer(layer, z, mask, cache) if run_layer is not None else layer(z, mask=mask, cache=cache)
        return self.norm(z)
