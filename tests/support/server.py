"""Helpers for the server tests: a real uvicorn server on loopback, and a small model
trained to answer fixed prompts with fixed replies that hold reasoning, tool calls and
malformed tool text, so the parsers see real model output (committed in tests/data/scripted_model;
`python tests/support/server.py` retrains it).

Imported by the server tests (tests/test_server*.py and the API tests).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import threading
import time
from pathlib import Path

import mtp_serve  # noqa: F401  (before mlx)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import uvicorn

from mtp_serve.models.gdn import install_capturing_gdn
from mtp_serve.testing.hf_layout import hf_weights, save_hf_checkpoint
from mtp_serve.testing.launch import Loopback, free_port
from mtp_serve.models.loader import load_model
from mtp_serve.testing.synthetic import build_random, tiny_text_config, write_byte_tokenizer
from mtp_serve.server.app import ServerConfig, create_app


class LiveServer(Loopback):
    """`create_app` served by uvicorn in a background thread (its own event loop)."""

    def __init__(self, loaded, config: ServerConfig):
        self.app = create_app(loaded, config)
        self.service = self.app.state.service
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "LiveServer":
        if self.thread.is_alive():
            return self
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(path, **config) -> LiveServer:
    """Load the checkpoint at `path` (its own copy) and serve it."""
    loaded = load_model(str(path))
    config.setdefault("served_model_name", "test-model")
    return LiveServer(loaded, ServerConfig(**config)).start()


# ---------------------------------------------------------------- the scripted model

# Short Qwen3.5-style template: tools listed by name, thinking opens <think>.
SCRIPT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

THINK = {"enable_thinking": True}
NO_THINK = {"enable_thinking": False}

XML_CALLS = (
    "The user wants the weather.\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n</function>\n</tool_call>"
)
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
REASONED = "Greet them briefly.\n</think>\n\nHello there!"
MALFORMED = "<tool_call>\n<function=get_weather>\nParis, please"  # unclosed: a call, its stray text ignored
NAMED_ARGS = "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"

# (messages, tools, template kwargs, forced suffix of the prompt, reply)
SCRIPT = [
    ([{"role": "user", "content": "Weather in Paris and Tokyo?"}], [WEATHER_TOOL], THINK, "", XML_CALLS),
    ([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER_TOOL], NO_THINK, "", HERMES_CALL),
    ([{"role": "user", "content": "Say hi."}], None, THINK, "", REASONED),
    ([{"role": "user", "content": "Break the tool."}], [WEATHER_TOOL], NO_THINK, "", MALFORMED),
    ([{"role": "user", "content": "Weather in Rome?"}], [WEATHER_TOOL], NO_THINK,
     "<tool_call>\n<function=get_weather>\n", NAMED_ARGS),
]
IM_END = 258
VERBOSE = False
# The trained model, committed so that test runs skip the training; used while its fingerprint
# (the token sequences it learns and the code that trains it) matches.
COMMITTED = Path(__file__).resolve().parent.parent / "data" / "scripted_model"


def _render(tokenizer, messages, tools, kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                         chat_template=SCRIPT_TEMPLATE, **kwargs)


def script_sequences(tokenizer) -> list:
    """(prompt, reply) token ids of every SCRIPT entry."""
    seqs = []
    for messages, tools, kwargs, forced, reply in SCRIPT:
        prompt = tokenizer.encode(_render(tokenizer, messages, tools, kwargs) + forced, add_special_tokens=False)
        seqs.append((prompt, tokenizer.encode(reply, add_special_tokens=False) + [IM_END]))
    return seqs


def _memorized(model, x, y, mask) -> bool:
    """Greedy decoding reproduces every reply, with a clear margin at every token."""
    logits = model(x)
    top2 = mx.sort(logits, axis=-1)[..., -2:]
    right = (mx.argmax(logits, axis=-1) == y) & (top2[..., 1] - top2[..., 0] > 1.0)
    return bool(mx.all(right | (mask == 0)).item())


def write_scripted_checkpoint(out_dir: Path, steps: int = 400, seed: int = 0) -> Path:
    """A 2-layer attention-only Qwen3.5 model trained to give SCRIPT's replies (then <|im_end|>).

    Random MTP head (greedy output does not depend on it). Written in HF layout
    with the byte tokenizer and SCRIPT_TEMPLATE as its chat template.
    """
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(out_dir, chat_template=SCRIPT_TEMPLATE)
    seqs = script_sequences(PreTrainedTokenizerFast.from_pretrained(str(out_dir)))
    fingerprint = scripted_fingerprint(seqs, steps, seed)
    if committed_fingerprint() == fingerprint:
        shutil.copytree(COMMITTED, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("fingerprint"))
        return out_dir
    L = max(len(p) + len(a) for p, a in seqs)
    x = mx.zeros((len(seqs), L - 1), mx.int32)
    y = mx.zeros((len(seqs), L - 1), mx.int32)
    mask = mx.zeros((len(seqs), L - 1))
    for i, (p, a) in enumerate(seqs):
        full = p + a
        x[i, : len(full) - 1] = mx.array(full[:-1])
        y[i, : len(full) - 1] = mx.array(full[1:])
        mask[i, len(p) - 1 : len(full) - 1] = 1.0

    # One GatedDeltaNet layer (the chunked rule makes training fast), one attention layer.
    text = tiny_text_config("qwen3_5", num_hidden_layers=2, full_attention_interval=2, hidden_size=96,
                            intermediate_size=192, eos_token_id=IM_END)
    model, head, config = build_random("qwen3_5", text, seed=seed)
    install_capturing_gdn(model.language_model.model.layers)

    def loss_fn(m):
        logits = m(x)
        ce = nn.losses.cross_entropy(logits, y) * mask
        return ce.sum() / mask.sum()

    opt = optim.Adam(learning_rate=4e-3)
    step = nn.value_and_grad(model, loss_fn)
    for i in range(steps):
        loss, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if VERBOSE:
            print(i, loss.item(), flush=True)
        if i % 5 == 4 and loss.item() < 0.05 and _memorized(model, x, y, mask):
            break
    else:
        raise RuntimeError("the scripted model did not memorize its replies")
    save_hf_checkpoint(out_dir, hf_weights(model, head, config["model_type"]), config, dtype=mx.float32)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    (out_dir / "fingerprint").write_text(fingerprint)
    return out_dir


def scripted_fingerprint(seqs, steps: int = 400, seed: int = 0) -> str:
    code = inspect.getsource(write_scripted_checkpoint) + inspect.getsource(_memorized)
    blob = json.dumps({"seqs": seqs, "steps": steps, "seed": seed, "template": SCRIPT_TEMPLATE, "code": code})
    return hashlib.sha256(blob.encode()).hexdigest()


def committed_fingerprint() -> str:
    f = COMMITTED / "fingerprint"
    return f.read_text() if f.exists() else ""


if __name__ == "__main__":  # python tests/support/server.py: retrain and commit the scripted model
    shutil.rmtree(COMMITTED, ignore_errors=True)
    write_scripted_checkpoint(COMMITTED)
    print(f"wrote {COMMITTED}")
