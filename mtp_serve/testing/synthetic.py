"""Small random-weight checkpoints in the real Hugging Face layout.

For tests and benchmarks: nothing is downloaded, yet loading goes through the
same loader as a real checkpoint. Four families: Qwen3.5 dense, Qwen3.5 MoE
(per-expert MTP experts), Qwen3.6 MoE (fused MTP experts), Qwen3-Next.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mtp_serve.testing.hf_layout import hf_weights, save_hf_checkpoint
from mtp_serve.models.mtp_head import MTPHead

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]

# A minimal Qwen-style ChatML template; the demo model ships the full one.
MINIMAL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next")


def tiny_text_config(family: str, **overrides) -> dict:
    c = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=320,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0]},
        eos_token_id=257,
    )
    if family != "qwen3_5":
        c.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, decoder_sparse_step=1, norm_topk_prob=True)
    if family == "qwen3_next":
        c.update(rope_theta=10000.0, partial_rotary_factor=0.25, mlp_only_layers=[])
        del c["rope_parameters"]
    c.update(overrides)
    return c


def hf_config(family: str, text: dict) -> dict:
    if family == "qwen3_next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **text}
    model_type = "qwen3_5" if family == "qwen3_5" else "qwen3_5_moe"
    arch = "Qwen3_5ForConditionalGeneration" if family == "qwen3_5" else "Qwen3_5MoeForConditionalGeneration"
    text = {**text, "model_type": model_type + "_text", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
    return {"architectures": [arch], "model_type": model_type, "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"], "eos_token_id": text["eos_token_id"]}


def build_random(family: str, text: dict, seed: int = 0, with_head: bool = True):
    """Random mlx-lm model (+ head) for `family`; returns (model, head, config)."""
    from mtp_serve.models.mlx_lm_compat import Qwen35DecoderLayer, Qwen3NextDecoderLayer, get_model_classes

    config = hf_config(family, text)
    mx.random.seed(seed)
    model_cls, args_cls = get_model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    if family == "qwen3_next":
        args, layer_cls = model.args, Qwen3NextDecoderLayer
    else:
        args, layer_cls = model.language_model.args, Qwen35DecoderLayer
    head = MTPHead(args, layer_cls) if with_head else None
    # Norms away from exactly 1 so a missing or doubled +1 shift shows up.
    for m in [model] + ([head] if head is not None else []):
        params = dict(tree_flatten(m.parameters()))
        for k, v in params.items():
            if k.endswith("norm.weight") and v.ndim == 1:
                params[k] = v + 0.1 * mx.random.normal(v.shape)
        m.update(tree_map(lambda x: x, _unflatten(params)))
    return model, head, config


def _unflatten(flat: dict):
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


def make_agreeable(model: nn.Module, head: Optional[MTPHead], family: str, mix: float = 0.6, n_likely: int = 4, seed: int = 1,
                   also_likely: tuple = ()) -> None:
    """Make a random head agree with the backbone often, but not always.

    Every layer's output projections (attention, GatedDeltaNet, MLP) are scaled
    by `mix`, so the backbone's prediction at p+1 depends mostly on the token
    x[p+1]; the head's `fc` passes emb(x[p+1]) through and its norms copy the
    backbone's, so the head's guess for x[p+2] tends to match the backbone's.
    The rest of the context (scaled by `mix`) makes them disagree at times.
    Only `n_likely` tokens get large LM-head rows, so both choose among a few;
    `also_likely` ids join them (e.g. EOS, for replies that end after a few sampled tokens).
    """
    lm = model if family == "qwen3_next" else model.language_model
    modules = list(lm.model.layers) + (list(head.layers) if head is not None else [])
    for layer in modules:
        for name, sub in layer.named_modules():
            if name.endswith(("o_proj", "out_proj", "down_proj")) and hasattr(sub, "weight"):
                sub.weight = sub.weight * mix
    if head is not None:
        H = head.fc.weight.shape[0]
        noise = 0.02 * mx.random.normal((H, 2 * H), key=mx.random.key(seed))
        head.fc.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1) + noise
        head.pre_fc_norm_embedding.weight = mx.ones((H,))
        head.norm.weight = lm.model.norm.weight
    W = lm.lm_head.weight
    keep = mx.zeros((W.shape[0], 1))
    keep[mx.random.permutation(W.shape[0], key=mx.random.key(seed))[:n_likely]] = 1.0
    for t in also_likely:
        keep[t] = 1.0
    lm.lm_head.weight = W * (0.05 + 10.0 * keep)


def write_byte_tokenizer(out_dir: Path, chat_template: str = MINIMAL_CHAT_TEMPLATE, eos: str = "<|im_end|>") -> int:
    """A byte-level BPE tokenizer with no merges (256 byte tokens) plus Qwen's special tokens.

    Returns the vocabulary size; ids 256.. are the special tokens in QWEN_SPECIAL_TOKENS order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(QWEN_SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return len(vocab) + len(QWEN_SPECIAL_TOKENS)


def _byte_of(ch: str) -> int:
    from tokenizers import pre_tokenizers  # noqa: F401

    # GPT-2 byte-to-unicode: printable bytes map to themselves, the rest to 256+.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


def write_synthetic_checkpoint(
    out_dir: Path,
    family: str = "qwen3_5",
    *,
    seed: int = 0,
    with_head: bool = True,
    agreeable: bool = False,
    likely_eos: bool = False,
    mtp_shard: bool = True,
    max_shard_tensors: Optional[int] = 40,
    dtype: mx.Dtype = mx.float32,
    **text_overrides,
) -> Path:
    """Write a random checkpoint of `family` in HF layout with a byte tokenizer.

    `likely_eos` (with `agreeable`): EOS is one of the few likely tokens, so sampled
    replies end after a handful of tokens (agents' end-to-end tests)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}")
    out_dir = Path(out_dir)
    text = tiny_text_config(family, **text_overrides)
    model, head, config = build_random(family, text, seed=seed, with_head=with_head)
    if agreeable:
        make_agreeable(model, head, family, also_likely=(text["eos_token_id"],) if likely_eos else ())
    weights = hf_weights(model, head, config["model_type"], mtp_fused_experts=(family == "qwen3_6_moe"))
    save_hf_checkpoint(out_dir, weights, config, dtype=dtype, mtp_shard=mtp_shard, max_shard_tensors=max_shard_tensors)
    write_byte_tokenizer(out_dir)
    gen = {"eos_token_id": text["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir
