"""Write the tiny qwen4_exp checkpoint and transformers' logits on it (the goldens).

    python tests/support/make_qwen4_exp_golden.py   # needs torch; CI only reads the output

Writes tests/data/qwen4_exp_tiny/ (a random checkpoint in raw Hugging Face layout, vision tower
and MTP head included, written by `write_synthetic_checkpoint(..., "qwen4_exp", vision=True)`)
and tests/data/qwen4_exp_golden.npz: for each prompt, the logits of transformers'
`Qwen4ExpForConditionalGeneration` (eager attention, float32) over the whole prompt in one
forward (`<name>_prefill`) and fed in the chunks `<name>_chunks` with its cache
(`<name>_steps`). The prompts hold an EOS (the n-gram hash's segment break) and run past
the indexer's budget (so queries attend to a chosen subset of blocks). Prompt "img" holds an
image (`img_pixels`, patches as the processor lays them out, grid `img_grid`) between text:
the tower, the multimodal positions in the attention and the indexer, and (its later chunks)
the positions' shift after the image.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "tests" / "data" / "qwen4_exp_tiny"
GOLDEN = ROOT / "tests" / "data" / "qwen4_exp_golden.npz"
EOS = 257
IMAGE_GRID = (1, 4, 6)  # patches: 2 x 3 merged tokens, a wide image (height and width positions differ)

PROMPTS = {
    "a": ([5, 17, 3, 99, 42, 7, 7, 7, 250, EOS, 12, 13, 14, 300, 2, 61, 88, 5, 17, 3, 99, 1, 0, 64], [5, 3, 1, 1, 7, 1, 1, 1, 1, 1, 1, 1]),
    "b": ([EOS, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 1, 1, 6, 1, 1, 2, 4, 1, 1, 1]),
}


def image_prompt(config: dict) -> tuple:
    """Text, the image's start token, its 6 pad tokens, its end token, text with an EOS;
    the first chunk holds the image (transformers computes the positions' shift there)."""
    pad, start, end = config["image_token_id"], config["vision_start_token_id"], config["vision_end_token_id"]
    tokens = [5, 17, 3, 99, start] + [pad] * 6 + [end, 42, 7, EOS, 12, 13, 14, 300, 2, 61, 88, 5, 17]
    return tokens, [14, 1, 1, 3, 1, 2, 2]


def write_checkpoint() -> None:
    import mlx.core as mx

    from mtp_serve.testing.synthetic import write_synthetic_checkpoint

    if CKPT.exists():
        shutil.rmtree(CKPT)
    write_synthetic_checkpoint(CKPT, "qwen4_exp", seed=0, max_shard_tensors=None, dtype=mx.bfloat16, vision=True)


def transformers_model():
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    raw = json.loads((CKPT / "config.json").read_text())
    text = {k: v for k, v in raw["text_config"].items() if k not in ("model_type", "mtp_num_hidden_layers")}
    vision = {k: v for k, v in raw["vision_config"].items() if k != "model_type"}
    tokens = {k: raw[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = Qwen4ExpConfig(text_config=text, vision_config=vision, **tokens)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = Qwen4ExpForConditionalGeneration(config).float().eval()
    state, shards = {}, {}
    for f in sorted(CKPT.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k.startswith("mtp."):
                continue
            if ".ngram_embedding.shard_" in k:
                base, idx = k.split(".shard_")
                shards.setdefault(base + ".weight", {})[int(idx.split(".")[0])] = v
            else:
                state[k] = v
    for k, parts in shards.items():
        state[k] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    missing = [m for m in missing if m not in buffers]
    if missing or unexpected:
        raise SystemExit(f"weights do not match transformers' model: missing {missing}, unexpected {unexpected}")
    return model, raw


def golden() -> dict:
    import torch
    from transformers import DynamicCache

    model, raw = transformers_model()
    out = {}
    pixels = np.random.default_rng(0).uniform(-1, 1, (int(np.prod(IMAGE_GRID)), 3 * 2 * 16 * 16)).astype(np.float32)
    prompts = {**PROMPTS, "img": image_prompt(raw)}
    with torch.no_grad():
        for name, (tokens, chunks) in prompts.items():
            assert sum(chunks) == len(tokens)
            ids = torch.tensor([tokens])
            extra = {}
            if name == "img":
                out["img_pixels"], out["img_grid"] = pixels, np.array(IMAGE_GRID, dtype=np.int32)
                extra = dict(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.tensor([IMAGE_GRID]),
                             mm_token_type_ids=(ids == raw["image_token_id"]).int())
            out[f"{name}_tokens"] = np.array(tokens, dtype=np.int32)
            out[f"{name}_chunks"] = np.array(chunks, dtype=np.int32)
            model.model.rope_deltas = None  # the shift of the previous prompt's image
            out[f"{name}_prefill"] = model(input_ids=ids, use_cache=False, **extra).logits[0].numpy()
            model.model.rope_deltas = None
            cache, steps, start = DynamicCache(config=model.config.text_config), [], 0
            for i, n in enumerate(chunks):
                chunk = ids[:, start : start + n]
                kw = {k: (v[:, start : start + n] if k == "mm_token_type_ids" else v) for k, v in extra.items()} if i == 0 else {}
                logits = model(input_ids=chunk, cache=cache, use_cache=True, **kw).logits
                steps.append(logits[0].numpy())
                start += n
            out[f"{name}_steps"] = np.concatenate(steps, axis=0)
    return out


def main() -> int:
    write_checkpoint()
    np.savez_compressed(GOLDEN, **golden())
    print(f"wrote {CKPT} and {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
