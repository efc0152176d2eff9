"""The prompt cache on vision-language checkpoints, the form real Qwen3.5/3.6 checkpoints ship in
(`Qwen3_5ForConditionalGeneration`, `vision_config`, a vision tower), served with MTP on: in the raw
Hugging Face layout and in the mlx-community layout (`mtp-convert`: `language_model.*`,
`vision_tower.*`). Through chat completions on a real server on loopback, each row asserts the
prompt tokens reused and that the output equals a cold run (the same request on a server without a
prompt cache):

- a repeated text-only prompt reuses everything before the generation prompt;
- a text conversation's second turn reuses at least the whole first prompt;
- an image prompt repeated, and its conversation's second turn, likewise;
- the same image opening a new conversation reuses the prefix through that image;
- a different image of the same size reuses nothing from the image on.

Also on the raw layout: the disk tier across a restart, and 8-bit KV; /v1/stats says why a server
runs without a prompt cache.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from support.server import serve

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You answer questions about pictures and text."}
QUESTION = "What is in this picture?"


def data_url(seed: int, size=(64, 48)) -> str:
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}


def chat(server, messages) -> tuple:
    """(reply text, prompt tokens, cached tokens) of a greedy 6-token reply."""
    r = httpx.post(server.base_url + "/chat/completions", timeout=120,
                   json={"model": "test-model", "messages": messages, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    return body["choices"][0]["message"]["content"] or "", usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def token_count(server, text: str) -> int:
    return len(server.service.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def raw_layout(checkpoint_dir):
    return checkpoint_dir("qwen3_5", vision=True, agreeable=True)


@pytest.fixture(scope="module")
def mlx_community_layout(raw_layout, tmp_path_factory):
    from mtp_serve.cli.convert import main

    out = tmp_path_factory.mktemp("vl-mlx") / "converted"
    assert main(["--hf-path", str(raw_layout), "--mlx-path", str(out), "--no-verify"]) == 0
    return out


def start(path, **config):
    s = serve(path, mtp_depth=2, **config)
    assert s.service.loaded.model.vision is not None, "loaded without its vision tower"
    assert s.service.loaded.model.has_mtp
    return s


@pytest.mark.parametrize("layout", ["raw_layout", "mlx_community_layout"])
def test_vision_language_checkpoint_reuses_prompts(layout, request):
    path = request.getfixturevalue(layout)
    cached, cold = start(path), start(path, prompt_cache_bytes=0)
    try:
        assert cached.service.engine.prompt_cache is not None, cached.service.prompt_cache_off
        generation_prompt = token_count(cached, "<|im_start|>assistant\n")
        rows = {}

        def row(name, messages):
            reply, prompt, reused = chat(cached, messages)
            assert reply == chat(cold, messages)[0], f"{name}: the restored run's output differs from a cold run"
            rows[name] = (prompt, reused)
            return reply, prompt, reused

        text = [SYSTEM, {"role": "user", "content": "Tell me about the weather today."}]
        reply, prompt, reused = row("text", text)
        assert reused == 0
        _, _, reused = row("text again", text)
        assert reused == prompt - generation_prompt
        _, _, reused = row("text turn 2", text + [{"role": "assistant", "content": reply},
                                                  {"role": "user", "content": "And tomorrow?"}])
        assert reused >= prompt

        a, b = data_url(1), data_url(2)  # the same size, different pixels
        picture = [image_message(a)]
        reply, prompt, reused = row("image", picture)
        assert reused == 0
        _, _, reused = row("image again", picture)
        assert reused == prompt - generation_prompt
        _, _, reused = row("image turn 2", picture + [{"role": "assistant", "content": reply},
                                                      {"role": "user", "content": "Say more."}])
        assert reused >= prompt
        through_image = prompt - generation_prompt  # the first message, image included
        _, _, reused = row("same image, new conversation", picture + [{"role": "assistant", "content": "A cat."},
                                                                       {"role": "user", "content": "What colour?"}])
        assert reused >= through_image
        image_start = token_count(cached, f"<|im_start|>user\n{QUESTION}<|vision_start|>")
        _, _, reused = row("different image, same size", [image_message(b)])
        assert reused < image_start, rows
        stats = httpx.get(cached.root + "/v1/stats").json()["prompt_cache"]
        assert stats["enabled"] and stats["failures"] == 0 and stats["off_reason"] is None
        off = httpx.get(cold.root + "/v1/stats").json()["prompt_cache"]
        assert not off["enabled"] and "--prompt-cache-bytes 0" in off["off_reason"]
    finally:
        cached.stop()
        cold.stop()


def test_vision_language_disk_tier_survives_a_restart(raw_layout, tmp_path):
    picture = [image_message(data_url(3))]
    first = start(raw_layout, prompt_cache_dir=str(tmp_path))
    try:
        reply, prompt, reused = chat(first, picture)
        assert reused == 0
    finally:
        first.stop()
    first.service.engine.prompt_cache.close()
    restarted = start(raw_layout, prompt_cache_dir=str(tmp_path))
    try:
        again, _, reused = chat(restarted, picture)
        assert reused == prompt - token_count(restarted, "<|im_start|>assistant\n")
        assert again == reply
        assert httpx.get(restarted.root + "/v1/stats").json()["prompt_cache"]["hits"]["disk"] == 1
    finally:
        restarted.stop()


def test_vision_language_quantized_kv_reuses_prompts(checkpoint_dir):
    s = start(checkpoint_dir("qwen3_5", vision=True, agreeable=True, head_dim=32), kv_bits=8, kv_group_size=32)
    try:
        picture = [image_message(data_url(4))]
        reply, prompt, _ = chat(s, picture)
        again, _, reused = chat(s, picture)
        assert reused == prompt - token_count(s, "<|im_start|>assistant\n") and again == reply
        turn2 = picture + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
        assert chat(s, turn2)[2] >= prompt
    finally:
        s.stop()
