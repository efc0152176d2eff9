"""Small random-weight checkpoints in the real Hugging Face layout.

For tests and benchmarks: nothing is downloaded, yet loading goes through the
same loader as a real checkpoint. Five families: Qwen3.5 dense, Qwen3.5 MoE
(per-expert MTP experts), Qwen3.6 MoE (fused MTP experts), Qwen3-Next, and
Qwen3.8-Flash-Next (`qwen4_exp`: hyper-connections, PLE, the QSA indexer).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mtp_serve.testing.hf_layout import hf_weights, qwen4_exp_hf_weights, save_hf_checkpoint
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

# The families mlx-lm runs (its own model classes: quantization, grafting, KV bits and batching
# are tested over these), and every family this server loads.
MLX_LM_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next")
FAMILIES = MLX_LM_FAMILIES + ("qwen4_exp",)

VISION_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# The minimal template plus Qwen3.5's rendering of image content parts.
VISION_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}{%- for item in content -%}"
    "{%- if item.type in ('image', 'image_url') or 'image' in item or 'image_url' in item -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in item -%}{{ item.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ render(m['content']) }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vision_config(text_hidden: int, **overrides) -> dict:
    """A Qwen3.5-shaped vision tower small enough for unit tests (depth 2, width 32)."""
    c = dict(model_type="qwen3_5", depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
             out_hidden_size=text_hidden, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
             in_channels=3, num_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
             deepstack_visual_indexes=[])
    c.update(overrides)
    return c


# qwen4_exp's tower is Qwen3.5's under its own config type (axial 2-D RoPE, as Qwen3.5's).
QWEN4_EXP_VISION = {"model_type": "qwen4_exp_vision", "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}


def tiny_preprocessor_config(vision: dict, min_pixels: int = 32 * 32, max_pixels: int = 128 * 128) -> dict:
    """preprocessor_config.json with small bounds: at most (128/32)^2 = 16 image tokens."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
            "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"], "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
            "resample": 3}


def random_vision_weights(vision: dict, seed: int = 0, hf_layout: bool = True) -> dict:
    """Random tower tensors: `model.visual.*` with PyTorch's Conv3d layout (as HF ships them),
    or mlx-vlm's `vision_tower.*` with MLX's layout."""
    from mtp_serve.models.vision.tower import TowerConfig, VisionTower

    mx.random.seed(seed)
    tower = VisionTower(TowerConfig.from_dict(vision))
    params = dict(tree_flatten(tower.parameters()))
    for k, v in params.items():  # LayerNorms away from (1, 0), so a dropped norm shows up
        if ".norm" in k or k.startswith("norm"):
            params[k] = v + 0.1 * mx.random.normal(v.shape)
    params["pos_embed.weight"] = 0.5 * mx.random.normal(params["pos_embed.weight"].shape)
    if not hf_layout:
        return {f"vision_tower.{k}": v for k, v in params.items()}
    params["patch_embed.proj.weight"] = params["patch_embed.proj.weight"].transpose(0, 4, 1, 2, 3)
    return {f"model.visual.{k}": v for k, v in params.items()}


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


def tiny_qwen4_exp_text_config(**overrides) -> dict:
    """Every part of qwen4_exp at toy size: 4 streams, GatedDeltaNet layers 1 and 3 with PLE
    (orders 2-3, 2 heads each, ~1k-row prime tables in 4 shards), indexed attention on layers
    2 and 4 (8 index heads, so block scores rarely tie at zero) choosing 2 blocks of 2 keys (so queries past position 5 attend sparsely), 8 experts
    top 2 with a shared expert."""
    c = dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, vocab_size=320, hidden_act="silu",
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
        tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0]},
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        norm_topk_prob=True, hc_count=4, hc_lowrank=16, ple_layer_ids=[1, 3], ple_embed_dim=32,
        ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=128, seed=1234, split_ngram_parts=4,
        indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2,
        eos_token_id=257,
    )
    c.update(overrides)
    return c


def hf_config(family: str, text: dict) -> dict:
    if family == "qwen4_exp":
        text = {**text, "model_type": "qwen4_exp_text", "mtp_num_hidden_layers": 1}
        return {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "text_config": text,
                "tie_word_embeddings": text["tie_word_embeddings"], "eos_token_id": text["eos_token_id"]}
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
    if family == "qwen4_exp":
        return _build_random_qwen4_exp(config, with_head)
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


def _build_random_qwen4_exp(config: dict, with_head: bool):
    from mtp_serve.models import qwen4_exp
    from mtp_serve.models.mlx_lm_compat import Qwen35DecoderLayer

    model = qwen4_exp.build(config)
    head = MTPHead(qwen4_exp.head_args(config), Qwen35DecoderLayer) if with_head else None
    for m in [model] + ([head] if head is not None else []):
        params = dict(tree_flatten(m.parameters()))
        for k, v in params.items():
            if (k.endswith("norm.weight") or "norm_" in k) and v.ndim == 1:  # away from 1: a lost shift shows
                params[k] = v + 0.1 * mx.random.normal(v.shape)
            elif k.endswith(("conv_weight", "dt_bias")):
                params[k] = 0.5 * mx.random.normal(v.shape)
            elif k.endswith("A_log"):
                params[k] = mx.log(mx.random.uniform(0.5, 4.0, v.shape))
        m.update(_unflatten(params))
    return model, head, config


def _unflatten(flat: dict):
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


def make_agreeable(model: nn.Module, head: Optional[MTPHead], family: str, mix: Optional[float] = None, n_likely: int = 4,
                   seed: int = 1, also_likely: tuple = ()) -> None:
    """Make a random head agree with the backbone often, but not always.

    Every layer's output projections (attention, GatedDeltaNet, MLP) are scaled
    by `mix`, so the backbone's prediction at p+1 depends mostly on the token
    x[p+1]; the head's `fc` passes emb(x[p+1]) through and its norms copy the
    backbone's, so the head's guess for x[p+2] tends to match the backbone's.
    The rest of the context (scaled by `mix`) makes them disagree at times.
    Only `n_likely` tokens get large LM-head rows, so both choose among a few;
    `also_likely` ids join them (e.g. EOS, for replies that end after a few sampled tokens).
    """
    if mix is None:  # qwen4_exp's blocks add to 4 streams and the streams are normed before the LM head
        mix = 0.2 if family == "qwen4_exp" else 0.6
    lm = model if family == "qwen3_next" else model.language_model
    modules = list(lm.model.layers) + (list(head.layers) if head is not None else [])
    if family == "qwen4_exp":  # PLE adds to the streams too; the final mixer becomes a plain mean of normed streams
        for layer in lm.model.layers:
            if layer.has_ple:  # its conv reads normed values: scaled here, not through value_proj
                layer.ple.conv_weight = layer.ple.conv_weight * mix * 0.1
                layer.ple.value_proj.weight = layer.ple.value_proj.weight * 0.1
        mixer = lm.model.hyper_connection_mixer
        mixer.input_mix_weight_up.weight = mx.zeros_like(mixer.input_mix_weight_up.weight)
        mixer.hc_norm.weight = mx.ones_like(mixer.hc_norm.weight)
    for layer in modules:
        for name, sub in layer.named_modules():
            if name.endswith(("o_proj", "out_proj", "down_proj")) and hasattr(sub, "weight"):
                sub.weight = sub.weight * mix
    if head is not None:
        H = head.fc.weight.shape[0]
        noise = 0.02 * mx.random.normal((H, 2 * H), key=mx.random.key(seed))
        head.fc.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1) + noise
        head.pre_fc_norm_embedding.weight = mx.ones((H,))
        head.norm.weight = mx.ones((H,)) if family == "qwen4_exp" else lm.model.norm.weight
    W = lm.lm_head.weight
    keep = mx.zeros((W.shape[0], 1))
    keep[mx.random.permutation(W.shape[0], key=mx.random.key(seed))[:n_likely]] = 1.0
    for t in also_likely:
        keep[t] = 1.0
    lm.lm_head.weight = W * (0.05 + 10.0 * keep)


def write_byte_tokenizer(out_dir: Path, chat_template: str = MINIMAL_CHAT_TEMPLATE, eos: str = "<|im_end|>",
                         extra_special: tuple = ()) -> int:
    """A byte-level BPE tokenizer with no merges (256 byte tokens) plus Qwen's special tokens.

    Returns the vocabulary size; ids 256.. are the special tokens in QWEN_SPECIAL_TOKENS order,
    then `extra_special`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(QWEN_SPECIAL_TOKENS + list(extra_special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return len(vocab) + len(QWEN_SPECIAL_TOKENS) + len(extra_special)


def write_word_tokenizer(out_dir: Path, vocab_size: int, chat_template: str = MINIMAL_CHAT_TEMPLATE) -> None:
    """A tokenizer whose token i is the word "t<i>", so a client can read the token ids
    back from the text (`word_ids`, with or without spaces between them); no special
    tokens (the model's EOS id comes from its config)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def word_ids(text: str) -> List[int]:
    """The token ids in text decoded by `write_word_tokenizer`'s tokenizer."""
    return [int(i) for i in re.findall(r"t(\d+)", text)]


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
    words: bool = False,
    vision: bool = False,
    vision_overrides: Optional[dict] = None,
    max_image_pixels: int = 128 * 128,
    **text_overrides,
) -> Path:
    """Write a random checkpoint of `family` in HF layout with a byte tokenizer
    (`words`: a word tokenizer whose text gives the token ids back).

    `vision` (qwen3_5, qwen3_5_moe, qwen3_6_moe, qwen4_exp): also a tiny vision tower (`model.visual.*`),
    its config (vision_config, image/vision token ids), preprocessor_config.json and a
    tokenizer with <|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|> (ids 265-268) whose chat
    template renders image content parts as Qwen3.5's does. `vision_overrides` change the tower's
    shape (benchmarks: a real model's depth and width); `max_image_pixels` is the processor's
    resize bound (the default keeps images at most 16 tokens).

    `likely_eos` (with `agreeable`): EOS is one of the few likely tokens, so sampled
    replies end after a handful of tokens (agents' end-to-end tests)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}")
    if vision and (family == "qwen3_next" or words):
        raise ValueError("vision checkpoints are Qwen3.5/3.6/3.8-Flash-Next families with the byte tokenizer")
    out_dir = Path(out_dir)
    if vision and "rope_parameters" not in text_overrides:
        # 8 rotary dims = 4 frequencies, interleaved t h w t: every M-RoPE axis moves the logits.
        text_overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = tiny_qwen4_exp_text_config(**text_overrides) if family == "qwen4_exp" else tiny_text_config(family, **text_overrides)
    model, head, config = build_random(family, text, seed=seed, with_head=with_head)
    if agreeable:
        make_agreeable(model, head, family, also_likely=(text["eos_token_id"],) if likely_eos else ())
    if family == "qwen4_exp":
        weights = qwen4_exp_hf_weights(model, head, text["split_ngram_parts"])
    else:
        weights = hf_weights(model, head, config["model_type"], mtp_fused_experts=(family == "qwen3_6_moe"))
    if vision:
        own = QWEN4_EXP_VISION if family == "qwen4_exp" else {}
        vc = tiny_vision_config(text["hidden_size"], **{**own, **(vision_overrides or {})})
        first = 256 + len(QWEN_SPECIAL_TOKENS)
        config.update(vision_config=vc, vision_start_token_id=first, vision_end_token_id=first + 1,
                      image_token_id=first + 2, video_token_id=first + 3)
        weights.update(random_vision_weights(vc, seed=seed + 7))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "preprocessor_config.json").write_text(json.dumps(tiny_preprocessor_config(vc, max_pixels=max_image_pixels), indent=2))
    save_hf_checkpoint(out_dir, weights, config, dtype=dtype, mtp_shard=mtp_shard, max_shard_tensors=max_shard_tensors)
    if words:
        write_word_tokenizer(out_dir, text["vocab_size"])
    elif vision:
        write_byte_tokenizer(out_dir, chat_template=VISION_CHAT_TEMPLATE, extra_special=tuple(VISION_SPECIAL_TOKENS))
    else:
        write_byte_tokenizer(out_dir)
    gen = {"eos_token_id": text["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir
