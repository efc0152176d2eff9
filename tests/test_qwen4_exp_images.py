"""qwen4_exp (Qwen3.8-Flash-Next) with images in the engine: greedy MTP output is token-identical
to greedy plain output (depths 1-3, one and two images), rows with and without images decode
together as they do alone, and the next turn restores the prefix with the image from the prompt
cache (the indexer's per-token positions come back with it) and decodes as a cold run does.

The checkpoint is the agreeable synthetic qwen4_exp with a tiny vision tower
(`write_synthetic_checkpoint(..., "qwen4_exp", vision=True)`): 8 rotary dims, M-RoPE sections
[2, 1, 1] interleaved, so every position axis reaches the logits and the indexer's choices.
The logits themselves are checked against transformers in tests/test_qwen4_exp.py.
"""

import mlx.core as mx
import pytest

from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.models import qwen4_exp

from support.engine_images import assert_batched_rows_decode_as_alone, assert_mtp_identical_to_plain, image_prompt, pictures_for, run


@pytest.fixture(scope="module")
def vlm(loaded):
    return loaded("qwen4_exp", agreeable=True, vision=True)


@pytest.fixture(scope="module")
def pictures(vlm):
    return pictures_for(vlm)


def test_the_image_reaches_the_model(vlm, pictures):
    """Another image of the same size changes the reply; the same image gives the same one."""
    a, b = pictures["a"], pictures["b"]
    assert a.n_tokens == b.n_tokens > 1
    prompt = image_prompt(vlm, [a])
    with_a, with_b = run(vlm, prompt, (a,), 0)[0], run(vlm, image_prompt(vlm, [b]), (b,), 0)[0]
    assert with_a != with_b
    assert run(vlm, prompt, (a,), 0)[0] == with_a


@pytest.mark.parametrize("names", [("a",), ("a", "c")], ids=["one-image", "two-images"])
def test_mtp_identical_to_plain_with_images(vlm, pictures, names):
    assert_mtp_identical_to_plain(vlm, pictures, names)


def test_batched_rows_with_and_without_images(vlm, pictures):
    assert_batched_rows_decode_as_alone(vlm, pictures)


def test_next_turn_restores_the_image_prefix_with_its_positions(vlm, pictures):
    """Turn 2 starts from turn 1's snapshot (image included) and decodes as a cold run does; the
    restored indexed caches hold the image tokens' multimodal positions, not their indices."""
    a = pictures["a"]
    turn1 = image_prompt(vlm, [a])
    reply, _ = run(vlm, turn1, (a,), 0, max_tokens=6)
    turn2 = turn1 + reply + [40, 41, 42, 43, 44, 45]
    cold, _ = run(vlm, turn2, (a,), 2)
    cache = PromptCache(interval=0)
    run(vlm, turn1, (a,), 2, cache, max_tokens=6)
    restored = []
    original = qwen4_exp.IndexKeys.place_positions

    def keep(self, positions):
        restored.append(positions)
        return original(self, positions)

    qwen4_exp.IndexKeys.place_positions = keep
    try:
        warm, stats = run(vlm, turn2, (a,), 2, cache)
    finally:
        qwen4_exp.IndexKeys.place_positions = original
    assert stats.cached_tokens >= len(turn1) and warm == cold
    pad = turn1.index(vlm.model.vision.spec.image_token_id)
    assert restored and not mx.array_equal(restored[0][1, pad:pad + a.n_tokens], mx.arange(pad, pad + a.n_tokens))


def test_mtp_convert_keeps_the_tower_and_a_quantized_body_reads_images_alike(checkpoint_dir, pictures, tmp_path):
    """`mtp-convert -q` on a checkpoint with its tower: the tower stays unquantized beside the
    8-bit body, loads, and greedy MTP with an image gives plain decoding's tokens."""
    from mtp_serve.cli import convert
    from mtp_serve.models.loader import load_model

    out = tmp_path / "conv"
    src = checkpoint_dir("qwen4_exp", agreeable=True, vision=True)
    assert convert.main(["--hf-path", str(src), "--mlx-path", str(out), "-q", "--q-bits", "8",
                         "--q-group-size", "32", "--no-verify"]) == 0
    assert (out / "vision.safetensors").exists()
    lm = load_model(str(out))
    assert lm.model.vision is not None and lm.mtp_status == "MTP on"
    a = pictures["a"]
    prompt = image_prompt(lm, [a])
    plain, _ = run(lm, prompt, (a,), 0)
    assert run(lm, prompt, (a,), 2)[0] == plain
