"""Several models behind one server: routing by name and alias on every API, the
404 in each API's shape, /v1/models, lazy loading and LRU unloading under --max-loaded-bytes,
pinned models, a model too big for the budget, concurrent streams to two models (each
greedy-identical to its model served alone, with MTP), one model's failure leaving the other
alone, and the TOML config (the example in examples/ served end to end)."""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from support.server import LiveServer, free_port

import uvicorn

from mtp_serve.cli import models_config
from mtp_serve.cli.serve import several_models, spec
from mtp_serve.models.loader import load_model
from mtp_serve.server.app import ServerConfig, create_app
from mtp_serve.server.models_registry import ModelSpec, Models, estimated_bytes, weights_bytes

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
HI = "Say hello to the user please."
CFG = dict(prompt_cache_bytes=0, max_context=512)


class MultiServer(LiveServer):
    """`create_app` with a `Models` registry, served by uvicorn on loopback."""

    def __init__(self, models: Models):
        e = models.default
        self.app = create_app(e.service.loaded, e.service.config, models=models)
        self.service = self.app.state.service
        self.models = models
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture(scope="module")
def dense(checkpoint_dir):
    return checkpoint_dir("qwen3_5", agreeable=True)


@pytest.fixture(scope="module")
def moe(checkpoint_dir):
    return checkpoint_dir("qwen3_5_moe", agreeable=True, seed=1)


def cfg(name, **kw):
    return ServerConfig(served_model_name=name, mtp_depth=2, **{**CFG, **kw})


def extra(name, path, aliases=(), pinned=False, **kw) -> ModelSpec:
    return ModelSpec(name, str(path), cfg(name, **kw), aliases=aliases, enable_mtp=True, mtp_depth=2, pinned=pinned)


def two_models(dense, moe, **kw) -> MultiServer:
    """Each model with its own prompt cache (32 MiB of memory)."""
    loaded = load_model(str(dense))
    models = Models.serving(loaded, cfg("main", prompt_cache_bytes=32 << 20), aliases=("claude-sonnet-4-5",),
                            more=[extra("fast", moe, aliases=("claude-haiku-4-5",), prompt_cache_bytes=32 << 20)], **kw)
    return MultiServer(models).start()


@pytest.fixture(scope="module")
def both(dense, moe):
    with two_models(dense, moe) as s:
        yield s


def test_prompt_size_is_checked_against_the_routed_models_context(dense):
    """A prompt whose text alone is too long for the default model's context (refused before it is
    tokenized) is served by a second model whose context holds it."""
    models = Models.serving(load_model(str(dense)), cfg("main", max_context=64),
                            more=[extra("long", dense, max_context=4096)])
    with MultiServer(models).start() as s:
        text = "a " * (s.service.max_token_bytes * 64 // 2 + 1)  # its bytes alone are over 64 tokens' worth
        r = post(s, "chat", "main", text=text, max_tokens=1)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "bytes of text" in err["message"], err
        r = post(s, "chat", "long", text=text, max_tokens=1)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["prompt_tokens"] > 64


def request(api: str, model, text: str = HI, max_tokens: int = 12, stream: bool = False) -> tuple:
    msgs = [{"role": "user", "content": text}]
    m = {} if model is None else {"model": model}
    if api == "chat":
        return "/v1/chat/completions", {**m, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "completions":
        return "/v1/completions", {**m, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "messages":
        return "/v1/messages", {**m, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "count_tokens":
        return "/v1/messages/count_tokens", {**m, "messages": msgs}
    return "/v1/responses", {**m, "input": text, "max_output_tokens": max_tokens, "temperature": 0, "stream": stream}


def post(server, api, model, **kw) -> httpx.Response:
    path, body = request(api, model, **kw)
    return httpx.post(server.root + path, json=body, timeout=120)


def text_of(api: str, r: httpx.Response) -> str:
    j = r.json()
    if api == "chat":
        return j["choices"][0]["message"]["content"] or ""
    if api == "completions":
        return j["choices"][0]["text"]
    if api == "messages":
        return "".join(b.get("text", "") for b in j["content"])
    return "".join(p["text"] for item in j["output"] if item["type"] == "message" for p in item["content"])


def streamed_text(server, model: str, text: str = HI, max_tokens: int = 24) -> str:
    path, body = request("completions", model, text, max_tokens, stream=True)
    out = []
    with httpx.stream("POST", server.root + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json

                out.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(out)


def metric(server, name: str, model: str) -> float:
    for line in httpx.get(server.root + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for {model} not in /metrics")


def cards(server) -> dict:
    return {c["id"]: c for c in httpx.get(server.root + "/v1/models", timeout=30).json()["data"]}


# ---------------------------------------------------------------- routing


def test_models_listed_loaded_or_not_then_lazy_load(dense, moe):
    with two_models(dense, moe) as s:
        c = cards(s)
        assert list(c) == ["main", "fast"]
        assert c["main"]["loaded"] and c["main"]["pinned"] and c["main"]["mtp"]["enabled"] and c["main"]["max_model_len"] == 512
        assert not c["fast"]["loaded"] and c["fast"]["aliases"] == ["claude-haiku-4-5"]
        assert c["fast"]["max_model_len"] == 512 and c["fast"]["mtp"]["status"] == "not loaded"
        assert c["fast"]["weights_bytes"] == estimated_bytes(str(moe))
        assert metric(s, "mtp_model_loaded", "fast") == 0
        ok = 'mtp_requests_total{endpoint="/v1/chat/completions",status="200"}'
        r = post(s, "chat", "fast")
        assert r.status_code == 200 and r.json()["model"] == "fast"
        assert ok + " 1.0" in httpx.get(s.root + "/metrics").text  # HTTP counts are server-wide
        c = cards(s)["fast"]
        assert c["loaded"] and c["mtp"]["enabled"] and c["mtp"]["depth_cap"] == 2
        assert metric(s, "mtp_model_loads_total", "fast") == 1 and metric(s, "mtp_model_load_seconds_total", "fast") > 0
        assert httpx.get(s.root + "/v1/models/claude-haiku-4-5").json()["id"] == "fast"
        again = post(s, "chat", "fast").json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert again > 0  # the fast model's own prompt cache
        assert s.models.lookup("fast").service.engine.prompt_cache is not s.service.engine.prompt_cache
        assert post(s, "chat", "main").json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "count_tokens", "responses"])
def test_routing_by_name_and_alias(both, api):
    texts = {}
    for model, served in (("main", "main"), ("claude-sonnet-4-5", "main"), (None, "main"),
                          ("fast", "fast"), ("claude-haiku-4-5", "fast")):
        before = metric(both, "mtp_model_requests_total", served)
        r = post(both, api, model)
        assert r.status_code == 200, r.text
        assert metric(both, "mtp_model_requests_total", served) == before + 1
        if api == "count_tokens":
            assert r.json()["input_tokens"] > 0
            continue
        assert r.json()["model"] == served
        texts.setdefault(served, set()).add(text_of(api, r))
    if api != "count_tokens":
        assert len(texts["main"]) == 1 and len(texts["fast"]) == 1  # greedy: the same text by name, alias or default


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "count_tokens", "responses"])
def test_unknown_model_is_404_in_the_apis_shape(both, api):
    r = post(both, api, "no-such-model")
    assert r.status_code == 404
    j = r.json()
    if api in ("messages", "count_tokens"):
        assert j["type"] == "error" and j["error"]["type"] == "not_found_error"
        message = j["error"]["message"]
    else:
        assert j["error"]["code"] == "model_not_found" and j["error"]["param"] == "model"
        message = j["error"]["message"]
    for name in ("'main'", "'fast'", "'claude-haiku-4-5'", "'claude-sonnet-4-5'"):
        assert name in message


def test_concurrent_streams_greedy_identical_to_each_model_alone(both, dense, moe):
    """Both models stream at once; each one's text is what it gives served alone (with MTP)."""
    alone = {}
    for name, path in (("main", dense), ("fast", moe)):
        with LiveServer(load_model(str(path)), cfg(name)).start() as s:
            alone[name] = streamed_text(s, name)
    got, errors = {}, []

    def run(name):
        try:
            got[name] = [streamed_text(both, name) for _ in range(2)]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("main", "fast", "main")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for name in ("main", "fast"):
        assert got[name] == [alone[name]] * 2, (name, got[name], alone[name])
    assert alone["main"] != alone["fast"]  # two different models answered


def test_one_models_failure_leaves_the_other(both):
    assert post(both, "chat", "fast").status_code == 200
    fast = both.models.lookup("fast").service
    model = fast.loaded.model
    forward = model.forward

    def broken(*a, **kw):
        raise RuntimeError("injected fault in the fast model")

    model.forward = broken
    try:
        r = post(both, "chat", "fast", text="A different prompt, not cached.")
        assert r.status_code == 500, r.text
        r = post(both, "messages", "main")
        assert r.status_code == 200, r.text
    finally:
        model.forward = forward
    assert post(both, "chat", "fast").status_code == 200  # its engine goes on after the failed step
    assert httpx.get(both.root + "/health").json()["status"] == "ok"


# ---------------------------------------------------------------- memory


def test_lru_unload_pinned_stays_and_too_big_is_refused(dense, moe, checkpoint_dir, tmp_path):
    big = checkpoint_dir("qwen3_5", hidden_size=256, intermediate_size=1024, seed=3)
    a, b = load_model(str(dense)), load_model(str(moe))
    budget = weights_bytes(a) * 2 + weights_bytes(b) * 3 // 2  # main + pinned + one of b1/b2
    assert estimated_bytes(str(big)) > budget
    models = Models.serving(a, cfg("main"), max_loaded_bytes=budget,
                            more=[extra("pinned", dense, pinned=True), extra("b2", moe), extra("big", big),
                                  extra("b1", moe, prompt_cache_bytes=32 << 20, prompt_cache_dir=str(tmp_path))])
    with MultiServer(models).start() as s:
        loaded = lambda: [n for n, c in cards(s).items() if c["loaded"]]  # noqa: E731
        assert loaded() == ["main", "pinned"]  # the pinned one loaded at start
        r = post(s, "chat", "b1")
        first = text_of("chat", r)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert loaded() == ["main", "pinned", "b1"]
        assert post(s, "chat", "b2").status_code == 200
        assert loaded() == ["main", "pinned", "b2"]  # b1, idle and unpinned, made room
        assert metric(s, "mtp_model_unloads_total", "b1") == 1
        r = post(s, "chat", "b1")
        assert text_of("chat", r) == first  # reloaded: the same output
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its snapshots stayed on disk
        assert loaded() == ["main", "pinned", "b1"] and metric(s, "mtp_model_loads_total", "b1") == 2
        for api in ("chat", "messages"):
            r = post(s, api, "big")
            assert r.status_code == 400, r.text
            assert "--max-loaded-bytes" in r.text and "cannot be loaded" in r.text
        assert loaded() == ["main", "pinned", "b1"]  # nothing unloaded for a model that cannot fit
        assert post(s, "chat", "pinned").status_code == 200


def test_waiting_for_a_load(dense, moe):
    """Requests that arrive while their model loads wait for it (one load, all answered)."""
    with two_models(dense, moe) as s:
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(s, "chat", "fast").status_code)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == [200] * 3
        assert metric(s, "mtp_model_loads_total", "fast") == 1


# ---------------------------------------------------------------- the config file


def test_config_parses_and_refuses_mistakes():
    f = models_config.read_config(str(ROOT / "examples" / "claude_code_two_models.toml"))
    assert [m["name"] for m in f.models] == ["main", "fast"]
    assert "claude-haiku-4-5" in f.models[1]["aliases"] and f.models[0]["mtp"] and not f.models[1]["mtp"]
    assert f.max_loaded_bytes == 16 << 30 and f.prompt_cache_bytes == 4 << 30
    assert models_config.prompt_cache_parts(f.models, 4 << 30) == [3 << 30, 1 << 30]
    for bad, why in (('[[model]]\nname = "a"\ncolour = 1', "unknown key 'colour'"),
                     ('[[model]]\nprompt_cache_share = 0.8\n[[model]]\nprompt_cache_share = 0.5', "more than 1"),
                     ('[server]\nmax_loaded_bytes = "lots"\n[[model]]', "not a size"),
                     ('[[model]]\nmtp_depth = 12', "between 1 and 8"),
                     ('[[model]]\ndraft_head_bits = 3', "draft_head_bits: 0 (the head as stored), 4 or 8"),
                     ("[server]", "no [[model]]")):
        with pytest.raises(models_config.ConfigError, match=__import__("re").escape(why)):
            models_config.parse_config(bad)


def test_example_config_served_end_to_end(dense, moe, tmp_path):
    """examples/claude_code_two_models.toml with the synthetic checkpoints as its paths, through
    the CLI's own steps: Claude Code's model names reach the two models."""
    text = (ROOT / "examples" / "claude_code_two_models.toml").read_text()
    text = text.replace('name = "main"', f'name = "main"\npath = "{dense}"').replace('name = "fast"', f'name = "fast"\npath = "{moe}"')
    (tmp_path / "two.toml").write_text(text)
    args = argparse.Namespace(config=str(tmp_path / "two.toml"), model=None, max_loaded_bytes=None, prompt_cache_bytes=None,
                              served_model_name=None, enable_mtp=False, mtp_depth=None, draft_vocab=None,
                              draft_head_bits=None, max_context=None, max_batch_size=8, max_queue=64)
    more = several_models(args)
    assert args.model == str(dense) and args.served_model_name == "main" and args.enable_mtp and args.mtp_depth == 3
    assert args.max_batch_size == 4 and args.prompt_cache_bytes == 3 << 30 and args.max_loaded_bytes == 16 << 30
    loaded = load_model(args.model, enable_mtp=args.enable_mtp)
    config = ServerConfig(served_model_name=args.served_model_name, mtp_depth=args.mtp_depth, max_active=args.max_batch_size,
                          prompt_cache_bytes=0)  # (the cache's share is checked above; none here keeps the test small)
    specs = [spec(m, config) for m in more]
    assert specs[0].config.max_context == 8192 and specs[0].config.max_active == 8 and not specs[0].enable_mtp
    assert specs[0].config.prompt_cache_bytes == 1 << 30
    specs[0].config = replace(specs[0].config, prompt_cache_bytes=0)
    models = Models.serving(loaded, config, more=specs, aliases=args.aliases, max_loaded_bytes=args.max_loaded_bytes)
    with MultiServer(models).start() as s:
        c = cards(s)
        assert c["main"]["mtp"]["depth_cap"] == 3 and c["fast"]["max_model_len"] == 8192
        for model, served in (("claude-sonnet-4-5-20250929", "main"), ("claude-haiku-4-5-20251001", "fast")):
            r = post(s, "messages", model)
            assert r.status_code == 200 and r.json()["model"] == served, r.text
        assert metric(s, "mtp_model_requests_total", "main") == 1 and metric(s, "mtp_model_requests_total", "fast") == 1
        assert cards(s)["fast"]["mtp"]["enabled"] is False


def test_model_flag_twice(dense, moe):
    """--model A --model B: the first is the default (its flags as given), the second takes the
    flags as defaults and its folder's name; a name given twice is refused."""
    def ns(**kw):
        return argparse.Namespace(**{**dict(config=None, max_loaded_bytes=None, prompt_cache_bytes=0, served_model_name="a",
                                            enable_mtp=True, mtp_depth=2, draft_vocab=None, draft_head_bits=None,
                                            max_context=None, max_batch_size=8, max_queue=64), **kw})

    args = ns(model=[str(dense), str(moe)])
    more = several_models(args)
    assert args.model == str(dense) and args.served_model_name == "a" and args.aliases == ()
    assert [(m["name"], m["path"], m["mtp"], m["mtp_depth"]) for m in more] == [(moe.name, str(moe), True, 2)]
    one = ns(model=[str(dense)])
    assert several_models(one) == [] and one.model == str(dense)
    twice = ns(model=[str(dense), str(dense)], served_model_name=None)
    more = several_models(twice)
    with pytest.raises(ValueError, match="given twice"):
        Models([ModelSpec(dense.name, str(dense), cfg("x")), *[spec(m, cfg("x")) for m in more]])
    with pytest.raises(ValueError, match="one place"):
        several_models(ns(model=[str(dense)], config="x.toml"))


# ---------------------------------------------------------------- Claude Code


@pytest.mark.agents
def test_claude_code_main_and_fast_models(checkpoint_dir, tmp_path):
    """Claude Code with ANTHROPIC_MODEL and ANTHROPIC_SMALL_FAST_MODEL set to two served
    models: two turns complete, and both models answer (counted per model in /metrics). In
    `-p` mode this Claude Code sends no small-fast request of its own, so the second turn
    continues the conversation on the fast model by one of its aliases (`--model`). A one-line
    system prompt and no tools: the routing is the claim here (Claude Code's full prompt, 13-17k
    tokens a prefill, runs in test_agents.py)."""
    from support.npm_clients import npm_bin

    from test_agents import clean_env

    bin_ = npm_bin("claude", "claude", "CLAUDE_BIN")
    main = checkpoint_dir("qwen3_5", agreeable=True, likely_eos=True)
    fast = checkpoint_dir("qwen3_5_moe", agreeable=True, likely_eos=True, seed=1)
    models = Models.serving(load_model(str(main)), cfg("main", max_context=65536, prompt_cache_bytes=256 << 20),
                            aliases=("claude-sonnet-4-5",),
                            more=[extra("fast", fast, aliases=("claude-haiku-4-5",), max_context=65536,
                                        prompt_cache_bytes=256 << 20)])
    project = tmp_path / "project"
    project.mkdir()
    env = clean_env(tmp_path / "home", "ANTHROPIC_", "CLAUDE")
    with MultiServer(models).start() as s:
        env.update(ANTHROPIC_BASE_URL=s.root, ANTHROPIC_API_KEY="none", ANTHROPIC_MODEL="main",
                   ANTHROPIC_SMALL_FAST_MODEL="fast", ANTHROPIC_DEFAULT_HAIKU_MODEL="fast")

        def turn(*a):
            r = subprocess.run([bin_, "-p", "--tools", "", "--system-prompt", "You are a helpful assistant.", *a],
                               cwd=project, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=420)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

        turn("Say hello")
        assert metric(s, "mtp_model_requests_total", "main") >= 1
        turn("--continue", "--model", "claude-haiku-4-5", "And again")
        assert metric(s, "mtp_model_requests_total", "fast") >= 1
        # The fast model's prompt is the whole conversation so far: turn 1's and more.
        assert metric(s, "mtp_model_prompt_tokens_total", "fast") > metric(s, "mtp_model_prompt_tokens_total", "main") > 0
        text = httpx.get(s.root + "/metrics").text
        assert 'mtp_requests_total{endpoint="/v1/messages",status="200"}' in text
        assert not [ln for ln in text.splitlines() if ln.startswith('mtp_requests_total{endpoint="/v1/messages"')
                    and 'status="200"' not in ln and 'status="499"' not in ln]
