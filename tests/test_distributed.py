"""Serving across ranks, launched as users launch it:
`mlx.launch -n 2 --backend ring mtp-serve --model X --enable-mtp --parallel tensor|pipeline`
on localhost, with a synthetic checkpoint whose word tokenizer lets the client
read the token ids back from the text, and the OpenAI client.

- Greedy output equals single-process plain greedy output, MTP at depths 1-3,
  one request and a batch of four (after a client left mid-stream), tensor and
  pipeline parallel; the prompt cache is off across ranks (a next turn
  reuses nothing and is still exact). Tie rule as in
  test_greedy_identity: a divergence is tolerated only where the reference's
  top-two logits are within 1e-4 (tensor parallel sums each layer's output over
  the ranks, so logits can differ in the last bits; a pipeline runs one
  process's operations).
- Seeded sampling gives the same tokens as single-process plain sampling with
  that seed (per-position noise: the token depends on the seed, the position and
  the distribution only).
- Constrained output (a regex, a JSON schema; greedy and seeded) equals the
  single-process constrained output: every rank keeps the row's matcher.
- A rank killed mid-stream: rank 0 fails the in-flight requests with 503 (the
  stream's error event, a non-streaming request's status) and exits non-zero,
  and the launcher ends; bounded in time.

Tensor parallel runs the dense family (MTP head whole on every rank) and the MoE
family (MTP head split too); pipeline runs Qwen3-Next (the head on rank 0 only).
Constraints need a byte-level tokenizer (llguidance's): they run on the MoE
family with its byte tokenizer, tensor parallel with the head split, so the
ranks' drafts must follow the same masks for the split head to see the same
inputs.
"""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from test_greedy_identity import assert_identical_or_near_tie

from mtp_serve.cli.ranks import prompt_cache_refusal
from mtp_serve.engine.generator import generate
from mtp_serve.engine.grammar import Constraint
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.sharding import ShardingError, Split
from mtp_serve.testing.launch import LaunchedServer
from mtp_serve.testing.synthetic import word_ids

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 130, 3)), [200] * 5 + [201, 202], [9, 8, 7, 6, 5, 4]]
N_TOKENS = 24
SAMPLED = {"temperature": 1.0, "top_p": 0.95}


def reference(lm, prompt, n=N_TOKENS, **sampling):
    """Single-process plain decoding: (tokens, gap between the top two log-probs per token)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2, **sampling)
    tokens, gaps = [], []
    for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth=0):
        tokens += chunk.token_ids
        gaps += [lp.top[0][1] - lp.top[1][1] for lp in chunk.logprobs]
    return tokens, gaps


def completion(server, prompt, depth, n=N_TOKENS, extra=None, **sampling):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    return client.completions.create(model="test-model", prompt=prompt, max_tokens=n, **{"temperature": 0, **sampling},
                                     extra_body={"ignore_eos": True, "mtp_depth": depth, **(extra or {})})


def complete(server, prompt, depth, n=N_TOKENS, **sampling):
    """One completion over HTTP: (token ids, usage.speculative)."""
    r = completion(server, prompt, depth, n, **sampling)
    return word_ids(r.choices[0].text), r.model_dump()["usage"]["speculative"]


def launch(ckpt, *args) -> LaunchedServer:
    return LaunchedServer(ckpt, ranks=2, args=["--served-model-name", "test-model", "--enable-mtp", *args])


# Three launches: tensor parallel on the dense family (MTP head whole on each rank, the
# default) and on the MoE family with the MTP head split too; pipeline parallel on
# Qwen3-Next (whose rank 1 the last test kills).
SETUPS = {
    "tensor": ("qwen3_5", ["--parallel", "tensor"]),
    "tensor-moe": ("qwen3_5_moe", ["--parallel", "tensor", "--shard-mtp-head"]),
    "pipeline": ("qwen3_next", ["--parallel", "pipeline"]),
    "constrained": ("qwen3_5_moe", ["--parallel", "tensor", "--shard-mtp-head"]),
}
WORDS = {"constrained": False}  # the others read token ids back from a word tokenizer's text


@pytest.fixture(scope="module")
def servers(checkpoint_dir):
    """One launch at a time: an idle launch still costs CPU (the launcher polls its ranks' pipes,
    the ranks wait in the ring), so starting another stops the last one. The module-scoped
    parameters group each mode's tests together, so each mode starts once."""
    live = {}

    def get(mode):
        if mode not in live:
            for s in live.values():
                s.stop()
            live.clear()
            family, args = SETUPS[mode]
            live[mode] = launch(checkpoint_dir(family, agreeable=True, words=WORDS.get(mode, True)), *args, "--mtp-depth", "3",
                                "--fixed-depth", "--rank-timeout", "30").start()
            live[mode].mode = mode
        return live[mode]

    yield get
    for s in live.values():
        s.stop()


def single(loaded, mode):
    return loaded(SETUPS[mode][0], agreeable=True, words=WORDS.get(mode, True))


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
CONSTRAINTS = [({"guided_regex": "[a-f]{3}-[0-9]{2}"}, Constraint("regex", "[a-f]{3}-[0-9]{2}")),
               ({"guided_json": PERSON}, Constraint.json_schema(PERSON))]


def test_constrained_output_equals_single_process(servers, loaded):
    server, lm = servers("constrained"), single(loaded, "constrained")
    prompt = lm.tokenizer.encode("Answer:")
    for (extra, constraint), sampling in zip(CONSTRAINTS * 2, [{}, {}, {"seed": 3, **SAMPLED}, {"seed": 4, **SAMPLED}]):
        params = SamplingParams(max_tokens=40, constraint=constraint, **sampling)
        expected = lm.tokenizer.decode([t for c in generate(lm.model, lm.tokenizer, prompt, params, depth=0)
                                        for t in c.token_ids if t not in lm.tokenizer.eos_token_ids])
        r = completion(server, prompt, 3, 40, extra={**extra, "ignore_eos": False}, **sampling)
        assert r.choices[0].text == expected, (extra, sampling)
        assert r.choices[0].finish_reason == "stop" and r.usage.model_extra["speculative"]["drafted"] > 0


@pytest.mark.parametrize("mode", ["tensor", "tensor-moe", "pipeline"], scope="module")
def test_greedy_output_equals_single_process(mode, servers, loaded):
    server, lm = servers(mode), single(loaded, mode)
    refs = [reference(lm, p) for p in PROMPTS]
    for depth in (1, 2, 3):
        ids, spec = complete(server, PROMPTS[0], depth)
        assert_identical_or_near_tie(ids, *refs[0], f"{mode} parallel, depth {depth}")
        assert 0 < spec["accepted"] < spec["drafted"], f"depth {depth}: {spec}: accept and reject paths must both run"
    # A client that goes away mid-stream: rank 0 cancels it, the other ranks drop it too.
    body = {"model": "test-model", "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "mtp_depth": 2}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    depths = (1, 2, 3, 3)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # a batch of four: rows join and leave across ranks
        results = list(pool.map(lambda pd: complete(server, *pd), zip(PROMPTS, depths)))
    for i, (ids, spec) in enumerate(results):
        assert_identical_or_near_tie(ids, *refs[i], f"{mode} parallel, batch row {i} (depth {depths[i]})")
        assert spec["drafted"] > 0
    # The next turn of a conversation: no prompt cache across ranks, the same tokens.
    tokens, gaps = refs[0]
    r = completion(server, PROMPTS[0] + tokens[:12], 2, 12)
    assert not (r.usage.prompt_tokens_details and r.usage.prompt_tokens_details.cached_tokens)
    assert_identical_or_near_tie(word_ids(r.choices[0].text), tokens[12:24], gaps[12:24], f"{mode} parallel, next turn")


@pytest.mark.parametrize("mode", ["tensor", "pipeline"], scope="module")
def test_seeded_sampling_equals_single_process(mode, servers, loaded):
    server, lm = servers(mode), single(loaded, mode)
    seeds = (7, 1234)
    expected = [reference(lm, PROMPTS[i], seed=s, **SAMPLED)[0] for i, s in enumerate(seeds)]
    assert expected[0] != reference(lm, PROMPTS[0], seed=8, **SAMPLED)[0]  # the seed matters
    assert complete(server, PROMPTS[0], 2, seed=seeds[0], **SAMPLED)[0] == expected[0]
    with ThreadPoolExecutor(2) as pool:  # and in a batch, at other depths
        got = list(pool.map(lambda i: complete(server, PROMPTS[i], 3 - i, seed=seeds[i], **SAMPLED)[0], range(2)))
    assert got == expected


def test_killed_rank_gives_503_and_rank_0_exits(servers):
    """Rank 1 of the pipeline server (the first layers) is killed mid-stream. (Last: it ends that server.)"""
    server = servers("pipeline")
    body = {"model": "test-model", "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(httpx.post, server.base_url + "/completions", json=body, timeout=120)
        events, killed = [], None
        with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                if len(events) == 5 and killed is None:
                    os.kill(server.pids[1], signal.SIGKILL)
                    killed = time.time()
        answered = time.time() - killed
        plain = in_flight.result()
    assert events[-1] == "[DONE]" and '"service_unavailable"' in events[-2], events[-3:]
    assert answered < 15, f"the stream ended {answered:.1f}s after the kill"
    assert plain.status_code == 503 and plain.json()["error"]["type"] == "service_unavailable", plain.text
    assert server.wait(60) is not None, "the launcher did not end after a rank died"
    assert server.exit_codes().get(0, 0) != 0, server.output[-3000:]


def test_splits_that_cannot_work_are_refused(loaded):
    lm = loaded("qwen3_5", agreeable=True)  # 4 attention heads, 2 KV and linear key heads
    three = SimpleNamespace(rank=lambda: 0, size=lambda: 3)
    parts = (lm.model.model, lm.model.text, None)
    with pytest.raises(ShardingError, match=r"num_attention_heads 4.*not divisible by 3.*--parallel pipeline"):
        Split(three, "tensor").apply("qwen3_5", *parts)
    eight = SimpleNamespace(rank=lambda: 0, size=lambda: 8)
    with pytest.raises(ShardingError, match="at least 8 layers; this model has 4"):
        Split(eight, "pipeline").apply("qwen3_5", *parts)
    asked = SimpleNamespace(prompt_cache_bytes=1 << 30, prompt_cache_dir="/tmp/snapshots")
    assert prompt_cache_refusal(asked).startswith("--prompt-cache-bytes and --prompt-cache-dir: the prompt cache is off across ranks")
    assert prompt_cache_refusal(SimpleNamespace(prompt_cache_bytes=0, prompt_cache_dir=None)) is None
    nxt = loaded("qwen3_next")
    two = SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    with pytest.raises(ShardingError, match="qwen3_next: mlx-lm .* no tensor-parallel split.*--parallel pipeline"):
        Split(two, "tensor").apply("qwen3_next", nxt.model.model, nxt.model.text, None)
