"""Prompt log-probabilities for eval harnesses: `/v1/completions` with `echo`,
`logprobs: N` and `max_tokens: 0` returns each prompt token's log-probability given the tokens
before it (the first has none), as OpenAI's legacy API and vLLM do; lm-evaluation-harness's
loglikelihood tasks read exactly this. Checked against one plain forward pass's log-softmax."""

import json

import httpx
import mlx.core as mx
import pytest

from support.server import serve

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    s = serve(checkpoint_dir("qwen3_5", agreeable=True), mtp_depth=2, max_context=512, prefill_chunk=16)
    yield s
    s.stop()


def reference(server, ids):
    """log_softmax of one forward pass over the whole prompt (fresh caches)."""
    model = server.service.loaded.model
    _, logits = model.forward(mx.array([ids]), model.make_cache())
    lp = logits[0].astype(mx.float32)
    return lp - mx.logsumexp(lp, axis=-1, keepdims=True)


IDS = [5, 17, 200, 31, 44, 9, 120, 77, 3, 250, 18, 66, 90, 12, 140, 7, 33, 8, 101, 64, 29, 55, 2, 180, 41, 93, 16, 70, 11, 160]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_are_the_prompts_log_softmax(server, max_tokens):
    body = {"prompt": IDS, "echo": True, "logprobs": 3, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(IDS)
    assert len(lp["tokens"]) == n + max_tokens and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference(server, IDS)
    # prefill_chunk 16: scored over two chunks, against one forward over all 30 tokens
    want = [ref[i - 1, IDS[i]].item() for i in range(1, n)]
    assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-4)
    for i in range(1, n):
        top = lp["top_logprobs"][i]  # the 3 most likely, and the prompt's own token among them
        assert 3 <= len(top) <= 4 and lp["tokens"][i] in top  # (keys are texts: byte tokens can share "\ufffd")
        best = mx.argsort(-ref[i - 1])[:3].tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([ref[i - 1, t].item() for t in best], abs=1e-4)
    assert choice["text"].startswith(server.service.tokenizer.decode(IDS))
    assert r.json()["usage"]["prompt_tokens"] == n and r.json()["usage"]["completion_tokens"] == max_tokens
    assert choice["finish_reason"] == "length"
    if max_tokens:  # the generated tokens' own logprobs follow the prompt's
        assert all(isinstance(x, float) for x in lp["token_logprobs"][n:])
        assert lp["text_offset"][n] == len(server.service.tokenizer.decode(IDS))


def test_echo_logprobs_streamed(server):
    body = {"prompt": IDS, "echo": True, "logprobs": 1, "max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(IDS)
    assert chunks[1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["prompt_tokens"] == len(IDS)


def test_max_tokens_zero_without_logprobs_and_bad_values(server):
    r = httpx.post(server.base_url + "/completions", json={"prompt": "Hello", "max_tokens": 0, "echo": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello" and r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(server.base_url + "/completions", json={"prompt": "Hello", "max_tokens": -1}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, timeout=60)
    assert r.status_code == 400  # chat has no prompt to score: at least one token
    long = list(range(1, 300)) * 2
    r = httpx.post(server.base_url + "/completions", json={"prompt": long, "echo": True, "logprobs": 1, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("text", [" = coro.send(None)", " x", "  two spaces", "plain"])
def test_output_text_keeps_the_first_tokens_space(demo_model, text):
    """A completion whose first token starts with a space reads with it (mlx-lm's BPE streaming
    detokenizer drops it); eval harnesses compare generated text exactly, one token at a time too."""
    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.engine.stopping import StopChecker

    tok = demo_model.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    for step in (len(ids), 1):  # all at once, and token by token
        checker = StopChecker(tok, SamplingParams(max_tokens=len(ids), ignore_eos=True))
        out = "".join(checker.feed(ids[i:i + step])[1] for i in range(0, len(ids), step))
        assert out == tok.decode(ids) == text
