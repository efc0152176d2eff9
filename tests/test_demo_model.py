"""The shipped demo model (models/demo) loads through the real loader and works.

Checks the official-HF-layout details the loader must handle (top-level
mtp.* in its own shard, zero-centred norms, unsanitized conv1d), the
tokenizer and chat template, and that greedy decoding and the MTP head
produce sensible output.
"""

import json
import os
from pathlib import Path

import mtp_serve  # noqa: F401  (before mlx.core)

import mlx.core as mx
import pytest

from mtp_serve.models.loader import load_model

DEMO = Path(os.environ.get("MTP_SERVE_DEMO_MODEL", Path(__file__).resolve().parents[1] / "models" / "demo"))

pytestmark = pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="models/demo not built")

CODE_PROMPT = '''import os
import sys


def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at *path*."""
    with open(path, encoding=encoding) as f:
        return f.readlines()


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, n=1):
        self.count += n
        return self.count

    def reset(self):
'''

TOOLS = [{
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file from disk.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                       "required": ["path"]},
    },
}]


@pytest.fixture(scope="module")
def demo():
    return load_model(str(DEMO))


def test_layout_is_official_hf():
    config = json.loads((DEMO / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    tc = config["text_config"]
    assert tc["full_attention_interval"] == 4 and tc["mtp_num_hidden_layers"] == 1
    index = json.loads((DEMO / "model.safetensors.index.json").read_text())["weight_map"]
    mtp_keys = [k for k in index if k.startswith("mtp.")]
    assert len(mtp_keys) == 15, mtp_keys  # the 15 tensors of a dense Qwen3.5 head
    assert all(index[k] == "mtp.safetensors" for k in mtp_keys)
    assert any(k.startswith("model.language_model.layers.") for k in index)
    w = mx.load(str(DEMO / "mtp.safetensors"))
    assert w["mtp.fc.weight"].dtype == mx.bfloat16
    # Gemma-style zero-centred norms: stored weights sit near 0, not near 1.
    assert abs(w["mtp.pre_fc_norm_hidden.weight"].astype(mx.float32).mean().item()) < 0.5
    size = sum(p.stat().st_size for p in DEMO.glob("*.safetensors"))
    assert size < 26e6
    gen = json.loads((DEMO / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) >= set(config["eos_token_id"])


def test_loads_with_mtp(demo):
    assert demo.mtp_status == "MTP on"
    assert demo.model.has_mtp
    assert demo.model.model_type == "qwen3_5"
    assert demo.model.vocab_size == 4096


def test_tokenizer_roundtrip_and_special_tokens(demo):
    tok = demo.tokenizer
    text = "def f(x):\n    return {'ünï': x ** 2}  # ok\n\n\tprint(\"done\")\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges, not raw bytes
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
              "</tool_call>", "<tool_response>", "</tool_response>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, (t, ids)
        assert tok.decode(ids) == t
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"
    assert im_end in demo.tokenizer.eos_token_ids


def test_chat_template_tools_and_thinking(demo):
    # The HF tokenizer itself: the template's own default (thinking off). mlx-lm's
    # TokenizerWrapper passes enable_thinking=True unless told otherwise.
    tok = demo.tokenizer._tokenizer
    messages = [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Show me setup.py"},
        {"role": "assistant", "content": "", "reasoning_content": "Read it first.",
         "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": "setup.py", "limit": 20}}}]},
        {"role": "tool", "content": "from setuptools import setup"},
        {"role": "tool", "content": "setup()"},
    ]
    off = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    on = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert off.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "read_file"' in off
    assert "You are a coding assistant.<|im_end|>" in off
    assert "<tool_call>\n<function=read_file>\n<parameter=path>\nsetup.py\n</parameter>\n<parameter=limit>\n20\n</parameter>\n</function>\n</tool_call><|im_end|>" in off
    assert "<think>\nRead it first.\n</think>\n\n<tool_call>" in off  # after the last user query: kept
    assert ("<|im_start|>user\n<tool_response>\nfrom setuptools import setup\n</tool_response>\n"
            "<tool_response>\nsetup()\n</tool_response><|im_end|>\n") in off
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # default: thinking off
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    wrapped = demo.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
    assert wrapped == off
    # Reasoning of turns before the last user query is dropped.
    hist = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nold\n</think>\n\nA"},
            {"role": "user", "content": "b"}]
    text = tok.apply_chat_template(hist, tokenize=False, add_generation_prompt=True)
    assert "old" not in text and "<|im_start|>assistant\nA<|im_end|>" in text


def test_greedy_decode_and_head(demo):
    m = demo.model
    ids = demo.tokenizer.encode(CODE_PROMPT, add_special_tokens=False)
    cache, head_cache = m.make_cache(), m.make_head_cache()
    x = mx.array([ids])
    H, logits = m.forward(x, cache)
    m.draft(H[:, :-1], x[:, 1:], head_cache)
    tok, h = mx.argmax(logits[:, -1], -1), H[:, -1:]
    out, hits = [tok.item()], 0
    for _ in range(32):
        _, dl = m.draft(h, tok[:, None], head_cache)
        H, logits = m.forward(tok[:, None], cache)
        nxt = mx.argmax(logits[:, -1], -1)
        hits += int(mx.argmax(dl[:, -1], -1).item() == nxt.item())
        tok, h = nxt, H[:, -1:]
        out.append(tok.item())
    text = demo.tokenizer.decode(out)
    assert len(set(out)) >= 6, text  # not a degenerate repeat of one or two tokens
    assert any(ch.isalpha() for ch in text)
    assert hits / 32 >= 0.4, (hits, text)  # a trained head agrees with the backbone far above chance
