"""Hardening: grammars compiled off the engine thread within a budget,
no 500 from constraints or tool schemas, special-token text in constraints, the disk writer
under write errors, and a clean stop. A real uvicorn server on loopback (the shared agreeable
synthetic model), the engine itself, and `mtp-serve` in its own process for the stop."""

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from mtp_serve.engine.grammar import Constraint, GrammarCompiler, GrammarError
from support.server import WEATHER_TOOL

MSG = [{"role": "user", "content": "Hello, model."}]
CHAT, COMPLETIONS, MESSAGES, RESPONSES, COUNT = ("/v1/chat/completions", "/v1/completions", "/v1/messages",
                                                 "/v1/responses", "/v1/messages/count_tokens")


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    body = {"model": "test-model", **body}
    if not body.get("stream"):
        return httpx.post(server.root + path, json=body, timeout=timeout)
    with httpx.stream("POST", server.root + path, json=body, timeout=timeout) as r:
        r.read()
        return r


def assert_400(r: httpx.Response, *words: str) -> str:
    """A 400 in the API's own shape (before any stream starts) whose message names `words`."""
    assert r.status_code == 400, (r.status_code, r.text[:600])
    body = r.json()
    err = body["error"]
    if body.get("type") == "error":  # Anthropic's shape
        assert err["type"] == "invalid_request_error", body
    assert err["message"], body
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err["message"]


def sse_events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def chat_text(r: httpx.Response, stream: bool) -> str:
    assert r.status_code == 200, r.text[:600]
    if not stream:
        return r.json()["choices"][0]["message"]["content"] or ""
    events = sse_events(r.text)
    assert not any("error" in e for e in events), events
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def completion_text(r: httpx.Response, stream: bool) -> str:
    assert r.status_code == 200, r.text[:600]
    if not stream:
        return r.json()["choices"][0]["text"]
    events = sse_events(r.text)
    assert not any("error" in e for e in events), events
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def responses_text(r: httpx.Response, stream: bool) -> str:
    assert r.status_code == 200, r.text[:600]
    if not stream:
        return r.json()["output"][-1]["content"][0]["text"]
    done = [e for e in sse_events(r.text) if e.get("type") == "response.completed"]
    assert done, r.text[-600:]
    return done[0]["response"]["output"][-1]["content"][0]["text"]


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
E2E = pytest.mark.e2e  # a live server (conftest.py: test tiers); the engine and disk tests are the fast tier


# ---------------------------------------------------------------- 1. compiling off the engine thread


@E2E
def test_a_pathological_constraint_does_not_stall_other_requests(server):
    """Constraints that take seconds to compile (or to find broken) are compiled on the tokenizer
    pool, never on the engine thread: a stream running beside them keeps its pace, and small
    requests answer within a bound."""
    small = {"messages": MSG, "max_tokens": 4}
    for _ in range(2):
        assert post(server, CHAT, small).status_code == 200  # warm
    alone = []
    for _ in range(5):
        t = time.perf_counter()
        assert post(server, CHAT, small).status_code == 200
        alone.append(time.perf_counter() - t)
    latencies, arrivals, done, started = [], [], threading.Event(), threading.Event()

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            assert post(server, CHAT, small).status_code == 200
            latencies.append(time.perf_counter() - t)

    def stream():
        body = {"model": "test-model", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.root + CHAT, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
                    started.set()
                if done.is_set():
                    return

    threads = [threading.Thread(target=poll), threading.Thread(target=stream)]
    for th in threads:
        th.start()
    started.wait(60)
    slow = []
    try:
        t0 = time.perf_counter()
        r = post(server, CHAT, {"messages": MSG, "max_tokens": 8, "guided_regex": "(a{1000}){1000}"})
        slow.append(time.perf_counter() - t0)
        msg = assert_400(r)  # llguidance's limit, or the compile's deadline on a busy machine
        assert "too many expressions" in msg or "took longer than" in msg, msg
        t = time.perf_counter()
        options = [f"option number {i}" for i in range(50000)]
        r = post(server, CHAT, {"messages": MSG, "max_tokens": 40, "guided_choice": options, "temperature": 0})
        slow.append(time.perf_counter() - t)
        assert chat_text(r, False) in options
        t1 = time.perf_counter()
    finally:
        done.set()
        for th in threads:
            th.join()
    during = [a for a in arrivals if t0 <= a <= t1]
    gaps = [b - a for a, b in zip(during, during[1:])]
    print(f"\nsmall request alone: median {sorted(alone)[2]:.3f}s; beside the constraints: {len(latencies)} requests, "
          f"max {max(latencies):.3f}s; stream: {len(during)} chunks, longest gap {max(gaps):.3f}s; the constrained "
          f"requests took {', '.join(f'{s:.2f}s' for s in slow)}")
    assert len(during) > 20 and max(gaps) < 1.0, (max(gaps), len(during), slow)
    assert len(latencies) >= 3 and max(latencies) < 2.5, (alone, latencies, slow)


def test_the_engine_uses_the_matcher_the_check_compiled(demo_model):
    """`check` leaves the compiled matcher on the constraint (and in a small cache); the engine's
    `matcher` copies it (no compiling on the engine thread)."""
    from mtp_serve.models.mlx_lm_compat import hf_tokenizer

    gc = GrammarCompiler(hf_tokenizer(demo_model.tokenizer), demo_model.model.vocab_size, demo_model.tokenizer.eos_token_ids)
    c = Constraint.choice([f"option number {i}" for i in range(50000)])
    t = time.perf_counter()
    gc.check(c)
    compile_s = time.perf_counter() - t
    assert c.prepared() is not None
    t = time.perf_counter()
    rows = [gc.matcher(c) for _ in range(4)]
    masks = [r.mask() for r in rows]
    copy_s = (time.perf_counter() - t) / 4
    assert copy_s < 0.05 and copy_s < compile_s, (copy_s, compile_s)
    rows[0].consume(gc.tokenizer.tokenize_str("option"))
    assert rows[1].consumed == 0 and all(bool((m == masks[0]).all()) for m in masks)  # copies are independent
    plain = Constraint(c.kind, c.source).carry(c)
    assert plain.prepared() is c.prepared()


def test_a_rendered_prompt_carries_its_engine_constraint_compiled(demo_model):
    """`Service.render` (run on the tokenizer threads) builds what the engine enforces and compiles it:
    the prompt's engine_constraint arrives prepared, with or without an open think block."""
    from mtp_serve.server.service import ServerConfig, Service

    svc = Service(demo_model, ServerConfig(served_model_name="demo", prompt_cache_bytes=0))
    output = Constraint.choice(["yes", "no"])
    for thinking in (False, True):
        prompt = svc.render([{"role": "user", "content": "Yes or no?"}], output=output,
                            template_kwargs={"enable_thinking": thinking})
        assert prompt.opens_reasoning == thinking and prompt.constraint is output
        assert prompt.engine_constraint.prepared() is not None, thinking
        assert (prompt.engine_constraint.source == output.source) == (not prompt.opens_reasoning)


def test_the_budget_refuses_oversized_constraints(demo_model):
    from mtp_serve.engine.grammar import GrammarBudget
    from mtp_serve.models.mlx_lm_compat import hf_tokenizer

    gc = GrammarCompiler(hf_tokenizer(demo_model.tokenizer), demo_model.model.vocab_size, demo_model.tokenizer.eos_token_ids,
                         budget=GrammarBudget(max_source_bytes=1000, max_seconds=0.0))
    with pytest.raises(GrammarError, match="the limit is 1000 bytes"):
        gc.check(Constraint("regex", "a" * 2000))
    with pytest.raises(GrammarError, match=r"the limit is 0s"):
        gc.check(Constraint("regex", "[a-z]{3}"))


# ---------------------------------------------------------------- 2. limits of the grammar engine: 400 before, never 500


@E2E
@STREAM
def test_grammar_engine_limits_are_400_up_front(server, stream):
    rec_schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    cases = [
        (CHAT, {"messages": MSG, "guided_grammar": 'start: a\na: "x" a'}, "Too many items"),
        (COMPLETIONS, {"prompt": "Hi", "guided_grammar": 'start: a\na: "x" a'}, "Too many items"),
        (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": rec_schema}}},
         "Too many items"),
        (RESPONSES, {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "r", "schema": rec_schema}}},
         "Too many items"),
    ]
    for path, body, words in cases:
        key = "max_output_tokens" if path == RESPONSES else "max_tokens"
        assert_400(post(server, path, {**body, key: 8, "stream": stream}), words)


@E2E
@STREAM
def test_a_choice_past_the_row_limit_is_served(server, stream):
    """2,001 options (llguidance's row limit is 2,000 items): one lexeme, answered."""
    options = [f"opt{i}" for i in range(2001)]
    body = {"max_tokens": 30, "temperature": 0, "stream": stream, "guided_choice": options}
    assert chat_text(post(server, CHAT, {**body, "messages": MSG}), stream) in options
    assert completion_text(post(server, COMPLETIONS, {**body, "prompt": "Pick:"}), stream) in options


@E2E
def test_a_grammar_failing_late_fails_its_own_row_only(server):
    """A grammar whose limit shows only after the probe's first tokens: the engine ends that row, whose
    client gets a 400 in the API's shape naming the constraint, and the row beside it completes."""
    late = 'start: /[a-z]{24}/ a\na: "x" a'

    async def main():
        async with httpx.AsyncClient(base_url=server.root, timeout=120) as c:
            bad = c.post(CHAT, json={"model": "test-model", "messages": MSG, "max_tokens": 40, "guided_grammar": late})
            good = c.post(CHAT, json={"model": "test-model", "messages": MSG, "max_tokens": 30, "ignore_eos": True})
            return await asyncio.gather(bad, good)

    bad, good = asyncio.run(main())
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 30, good.text[:300]
    assert bad.status_code == 400, bad.text[:300]  # the request's own grammar: a 400 naming it, not a 500
    err = bad.json()["error"]
    assert err["code"] == "invalid_constraint" and "the output constraint failed" in err["message"], err


def test_engine_ends_a_failed_grammar_row_alone(demo_model):
    """At the engine: two rows in one batch, one with a grammar that fails after the probe; that
    request gets an EngineError naming the constraint, the other its whole output."""
    from mtp_serve.engine.engine_loop import EngineError, EngineLoop
    from mtp_serve.engine.sampling import SamplingParams

    engine = EngineLoop(demo_model.model, demo_model.tokenizer, max_active=4).start()
    try:
        late = Constraint("lark", 'start: /[a-z]{24}/ a\na: "x" a')
        engine.check_constraint(late)  # passes: the failure is 24 characters in

        async def main():
            ids = demo_model.tokenizer.encode("def add(a, b):")
            bad = engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=60, constraint=late), 2)
            good = engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), 2)

            async def drain(h):
                out = []
                try:
                    async for chunk in h:
                        out += chunk.token_ids
                except EngineError as e:
                    return out, e
                return out, None

            return await asyncio.gather(drain(bad), drain(good))

        (bad_tokens, bad_err), (good_tokens, good_err) = asyncio.run(main())
    finally:
        engine.stop()
    assert isinstance(bad_err, EngineError) and "the output constraint failed" in str(bad_err), (bad_tokens, bad_err)
    assert good_err is None and len(good_tokens) == 40


# ---------------------------------------------------------------- 3. special-token text


@E2E
@STREAM
def test_special_token_text_in_constraints_is_text(server, stream):
    body = {"max_tokens": 30, "temperature": 0, "stream": stream}
    assert chat_text(post(server, CHAT, {**body, "messages": MSG, "guided_regex": "</tool_call>"}), stream) == "</tool_call>"
    out = chat_text(post(server, CHAT, {**body, "messages": MSG, "guided_json": {"const": "<|im_end|>"}}), stream)
    assert json.loads(out) == "<|im_end|>"
    out = completion_text(post(server, COMPLETIONS, {**body, "prompt": "Hi", "guided_choice": ["<think>", "</think>"]}), stream)
    assert out in ("<think>", "</think>")
    fmt = {"type": "json_schema", "name": "s", "schema": {"enum": ["<|im_end|>", "<tool_call>"]}}
    out = responses_text(post(server, RESPONSES, {"input": "Hi", "max_output_tokens": 30, "temperature": 0, "stream": stream,
                                                  "text": {"format": fmt}}), stream)
    assert json.loads(out) in ("<|im_end|>", "<tool_call>")


def special_tools():
    def tool(name="get_weather", prop="city", enum=None):
        params = {"type": "object", "properties": {prop: {"type": "string", **({"enum": enum} if enum else {})}}, "required": [prop]}
        return {"name": name, "parameters": params}
    return {
        "name": (tool(name="get</tool_call>weather"), "</tool_call>"),
        "parameter": (tool(prop="city<|im_end|>"), "<|im_end|>"),
        "enum": (tool(enum=["Paris", "<think>"]), "<think>"),
    }


@E2E
@STREAM
@pytest.mark.parametrize("case", ["name", "parameter", "enum"])
def test_special_token_text_in_a_forced_tool_call_is_400(server, case, stream):
    fn, token = special_tools()[case]
    openai_tool = {"type": "function", "function": fn}
    anthropic_tool = {"name": fn["name"], "input_schema": fn["parameters"]}
    responses_tool = {"type": "function", **fn}
    assert_400(post(server, CHAT, {"messages": MSG, "max_tokens": 8, "stream": stream, "tools": [openai_tool],
                                   "tool_choice": "required"}), token)
    assert_400(post(server, MESSAGES, {"messages": MSG, "max_tokens": 8, "stream": stream, "tools": [anthropic_tool],
                                       "tool_choice": {"type": "any"}}), token)
    assert_400(post(server, RESPONSES, {"input": "Hi", "max_output_tokens": 8, "stream": stream, "tools": [responses_tool],
                                        "tool_choice": "required"}), token)
    if not stream:
        assert_400(post(server, COUNT, {"messages": MSG, "tools": [anthropic_tool], "tool_choice": {"type": "any"}}), token)
        # Not forced: the tools reach the template as text and the request is served.
        r = post(server, CHAT, {"messages": MSG, "max_tokens": 4, "tools": [openai_tool]})
        assert r.status_code == 200, r.text[:300]


# ---------------------------------------------------------------- 4. tool schemas: JSON Schema's metaschema


MALFORMED = {
    "properties list": ({"type": "object", "properties": [1, 2]}, "properties"),
    "required number": ({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5}, "required"),
    "enum number": ({"type": "object", "properties": {"a": {"type": "string", "enum": 5}}}, "enum"),
    "pattern number": ({"type": "object", "properties": {"a": {"type": "string", "pattern": 5}}}, "pattern"),
    "not a schema": (5, "not of type"),
}


@E2E
@STREAM
@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("forced", [True, False], ids=["forced", "auto"])
def test_malformed_tool_schemas_are_400_on_every_api(server, case, forced, stream):
    schema, word = MALFORMED[case]
    fn = {"name": "broken", "parameters": schema}
    chat = {"messages": MSG, "max_tokens": 4, "stream": stream, "tools": [{"type": "function", "function": fn}]}
    messages = {"messages": MSG, "max_tokens": 4, "stream": stream, "tools": [{"name": "broken", "input_schema": schema}]}
    responses = {"input": "Hi", "max_output_tokens": 4, "stream": stream, "tools": [{"type": "function", **fn}]}
    if forced:
        chat["tool_choice"] = responses["tool_choice"] = "required"
        messages["tool_choice"] = {"type": "any"}
    calls = [(CHAT, chat), (MESSAGES, messages), (RESPONSES, responses)]
    if not stream:
        calls.append((COUNT, {k: v for k, v in messages.items() if k not in ("max_tokens", "stream")}))
    for path, body in calls:
        r = post(server, path, body)
        if case == "not a schema":  # the API's request model refuses it first ("Input should be a valid dictionary")
            assert_400(r, "valid dictionary")
        else:
            assert_400(r, "broken", "not a valid JSON schema", word)


@E2E
def test_a_well_formed_tool_schema_is_still_served(server):
    r = post(server, CHAT, {"messages": MSG, "max_tokens": 40, "tools": [WEATHER_TOOL], "tool_choice": "required"})
    assert r.status_code == 200, r.text[:300]


# ---------------------------------------------------------------- 6. the disk writer under write errors


def _eperm(*args, **kw):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 1, kind: PermissionDenied, message: "Operation not permitted" })')


def _enospc(tensors, path, metadata=None):
    import errno
    import os

    with open(path, "wb") as f:  # part of the file, then the disk is full
        f.write(b"\0" * 100)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.mark.parametrize("failure", [_eperm, _enospc], ids=["EPERM", "ENOSPC"])
def test_the_disk_writer_survives_write_errors(loaded, tmp_path, monkeypatch, failure, caplog):
    """Every write fails (safetensors' own error on EPERM; an OSError after a partial file on
    ENOSPC): each counts as dropped, one warning per cause, nothing stays queued, no partial file
    stays, and once the disk works again (after the back-off) writes resume; close is prompt."""
    from mtp_serve.engine.prompt_cache import PromptCache, disk, files
    from test_prompt_cache import SHARED, disk_tier, run

    lm = loaded("qwen3_5", agreeable=True)
    monkeypatch.setattr(disk, "BACKOFF_SECONDS", (0.2, 0.4))
    cache = PromptCache(interval=0, disk=disk_tier(lm, tmp_path))
    monkeypatch.setattr(files, "save_file", failure)
    for i in range(6):
        run(lm, SHARED + [i] * 40, cache, max_tokens=1)
        cache.disk.flush(5)
    d = cache.disk
    assert d.stats["dropped_writes"] >= 6 and d.stats["writes"] == 0, d.stats
    assert d._writer is not None and d._writer.is_alive()
    assert d._queued_bytes == 0 and not d._queued and not list(d.dir.glob("*.tmp"))
    warnings = [r for r in caplog.records if "cannot write to" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per cause
    monkeypatch.undo()
    time.sleep(0.5)  # past the back-off
    run(lm, SHARED + [99] * 40, cache, max_tokens=1)
    d.flush(10)
    assert d.stats["writes"] > 0, d.stats
    t = time.perf_counter()
    cache.close()
    assert time.perf_counter() - t < 2


def test_close_never_waits_past_its_bound(loaded, tmp_path, monkeypatch):
    """A disk that takes a second per file: close(1.0) returns after about a second, the rest dropped."""
    from safetensors.numpy import save_file

    from mtp_serve.engine.prompt_cache import PromptCache, files
    from test_prompt_cache import SHARED, disk_tier, run

    def slow(*args, **kw):
        time.sleep(1.0)
        return save_file(*args, **kw)

    lm = loaded("qwen3_5", agreeable=True)
    monkeypatch.setattr(files, "save_file", slow)
    cache = PromptCache(interval=0, disk=disk_tier(lm, tmp_path))
    for i in range(4):
        run(lm, SHARED + [i] * 40, cache, max_tokens=1)
    t = time.perf_counter()
    cache.disk.close(timeout=1.0)
    took = time.perf_counter() - t
    assert took < 2.5, took
    assert cache.disk.stats["writes"] + cache.disk.stats["dropped_writes"] <= 8


def test_a_lookup_survives_a_corrupt_file_that_cannot_be_removed(loaded, tmp_path, monkeypatch, caplog):
    import pathlib

    from mtp_serve.engine.prompt_cache import PromptCache
    from test_prompt_cache import CONV_A, CONV_B, SHARED, disk_tier, run

    lm = loaded("qwen3_5", agreeable=True)
    first = PromptCache(interval=0, disk=disk_tier(lm, tmp_path))
    run(lm, CONV_A, first, max_tokens=1)
    first.close()
    for f in first.disk.dir.glob("*-s-*.safetensors"):
        data = f.read_bytes()
        f.write_bytes(data[:-64] + bytes(b ^ 0xFF for b in data[-64:]))  # corrupt every snapshot (same size: listed)
    real_unlink = pathlib.Path.unlink

    def refuse(self, missing_ok=False):
        if self.suffix == ".safetensors":
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)
    again = PromptCache(interval=0, disk=disk_tier(lm, tmp_path))
    out, stats = run(lm, CONV_B, again)  # the lookup finds the corrupt file, cannot remove it, prefills
    cold, _ = run(lm, CONV_B, PromptCache(interval=0))
    assert out == cold and stats.cached_tokens == 0
    assert any("cannot remove" in r.getMessage() for r in caplog.records)
    assert not any("lookup failed" in r.getMessage() for r in caplog.records)  # nothing escaped the lookup
    again.close()


# ---------------------------------------------------------------- 8. a clean stop


# Both signals reach one handler (cli/serve.py), so each runs once: one with the disk tier, one without.
@pytest.mark.parametrize("sig,disk", [("SIGINT", False), ("SIGTERM", True)])
@E2E
def test_ctrl_c_and_sigterm_exit_0_after_draining(sig, disk, tmp_path):
    """`mtp-serve` on the demo model, a request streaming when the signal comes: it drains, the
    disk cache saves its index, and the process exits 0 without a C++ abort. (A short
    --shutdown-grace: the request outlasts any grace, and test_hardening3 times the grace itself.)"""
    from mtp_serve.testing.server_process import ServerProcess

    args = ["--shutdown-grace", 1] + (["--prompt-cache-dir", tmp_path / "cache"] if disk else [])
    s = ServerProcess(args)
    try:
        body = {"model": "", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.base_url + "/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break  # streaming: now stop the server under it
            t = time.perf_counter()
            s.proc.send_signal(getattr(signal, sig))
            try:
                for _ in lines:
                    pass
            except httpx.HTTPError:
                pass
        rc = s.proc.wait(60)
        took = time.perf_counter() - t
    finally:
        out = s.stop()
    assert rc == 0, (rc, out[-2000:])
    assert "terminate called" not in out and "Traceback" not in out, out[-2000:]
    assert "Application shutdown complete" in out and took < 30, (took, out[-1000:])
    if disk:
        assert list((tmp_path / "cache").glob("*/index.json")), list((tmp_path / "cache").rglob("*"))
