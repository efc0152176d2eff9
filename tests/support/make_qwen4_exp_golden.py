"""Write the tiny qwen4_exp checkpoint and transformers' logits on it (the goldens).

    python tests/support/make_qwen4_exp_golden.py   # needs torch; CI only reads the output

Writes tests/data/qwen4_exp_tiny/ (a random checkpoint in raw Hugging Face layout, MTP head
included, written by `write_synthetic_checkpoint(..., "qwen4_exp")`) and
tests/data/qwen4_exp_golden.npz: for each prompt, the logits of transformers'
`Qwen4ExpForCausalLM` (eager attention, float32) over the whole prompt in one forward
(`<name>_prefill`) and fed in the chunks `<name>_chunks` with its cache
(`<name>_steps`). The prompts hold an EOS (the n-gram hash's segment break) and run past
the indexer's budget (so queries attend to a chosen subset of blocks).
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

PROMPTS = {
    "a": ([5, 17, 3, 99, 42, 7, 7, 7, 250, EOS, 12, 13, 14, 300, 2, 61, 88, 5, 17, 3, 99, 1, 0, 64], [5, 3, 1, 1, 7, 1, 1, 1, 1, 1, 1, 1]),
    "b": ([EOS, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 1, 1, 6, 1, 1, 2, 4, 1, 1, 1]),
}


def write_checkpoint() -> None:
    import mlx.core as mx

    from mtp_serve.testing.synthetic import write_synthetic_checkpoint

    if CKPT.exists():
        shutil.rmtree(CKPT)
    write_synthetic_checkpoint(CKPT, "qwen4_exp", seed=0, max_shard_tensors=None, dtype=mx.bfloat16)


def transformers_model():
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    text = json.loads((CKPT / "config.json").read_text())["text_config"]
    config = Qwen4ExpTextConfig(**{k: v for k, v in text.items() if k not in ("model_type", "mtp_num_hidden_layers")})
    config._attn_implementation = "eager"
    model = Qwen4ExpForCausalLM(config).float().eval()
    state, shards = {}, {}
    for f in sorted(CKPT.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k.startswith("mtp."):
                continue
            k = k.replace("model.language_model.", "model.")
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
    return model


def golden() -> dict:
    import torch
    from transformers import DynamicCache

    model = transformers_model()
    out = {}
    with torch.no_grad():
        for name, (tokens, chunks) in PROMPTS.items():
            assert sum(chunks) == len(tokens)
            ids = torch.tensor([tokens])
            out[f"{name}_tokens"] = np.array(tokens, dtype=np.int32)
            out[f"{name}_chunks"] = np.array(chunks, dtype=np.int32)
            out[f"{name}_prefill"] = model(input_ids=ids, use_cache=False).logits[0].numpy()
            cache, steps, start = DynamicCache(config=model.config), [], 0
            for n in chunks:
                logits = model(input_ids=ids[:, start : start + n], cache=cache, use_cache=True).logits
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
