"""Stored and background Responses through the `openai` SDK: retrieve, delete, cancel,
background runs, output_text logprobs, and the message item of incomplete or empty replies."""

import time

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from support.server import SCRIPT

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

HI = SCRIPT[2][0]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def create(server, input="Hello, model.", **kw):
    kw.setdefault("max_output_tokens", 8)
    return client(server).responses.create(model="test-model", input=input, temperature=0, **kw)


def wait_for(server, rid: str, until, timeout: float = 60) -> list:
    """Poll GET /v1/responses/{id} until `until(status)`; the statuses seen, in order, without repeats."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        status = client(server).responses.retrieve(rid).status
        if not seen or seen[-1] != status:
            seen.append(status)
        if until(status):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"status still {seen[-1]} after {timeout}s")


def test_retrieve_and_delete_a_stored_response(server):
    c = client(server)
    r = create(server)
    got = c.responses.retrieve(r.id)
    assert (got.id, got.status, got.output_text, got.usage.output_tokens) == (r.id, r.status, r.output_text, 8)
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        c.responses.retrieve(create(server, store=False).id)


def test_background_response_runs_queued_to_completed(server):
    direct = create(server, max_output_tokens=24)
    r = create(server, max_output_tokens=24, background=True)
    assert r.status == "queued" and r.background and not r.output
    seen = wait_for(server, r.id, lambda s: s not in ("queued", "in_progress"))
    assert seen[-1] == "incomplete" and set(seen) <= {"queued", "in_progress", "incomplete"}  # cut at 24 tokens
    done = client(server).responses.retrieve(r.id)
    assert done.output_text == direct.output_text and done.usage.output_tokens == 24
    # Its conversation continues like any stored response's.
    assert create(server, input="More.", previous_response_id=r.id).status == "incomplete"
    with pytest.raises(openai.BadRequestError, match="store"):
        create(server, background=True, store=False)
    with pytest.raises(openai.BadRequestError, match="stream"):
        create(server, background=True, stream=True)


def test_background_response_can_be_cancelled(server):
    c = client(server)
    r = create(server, max_output_tokens=100_000, background=True, extra_body={"ignore_eos": True})
    assert wait_for(server, r.id, lambda s: s == "in_progress")[-1] == "in_progress"
    cancelled = c.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and c.responses.retrieve(r.id).status == "cancelled"
    assert c.responses.cancel(r.id).status == "cancelled"  # again: the same
    with pytest.raises(openai.BadRequestError, match="background"):  # only background responses
        c.responses.cancel(create(server).id)
    assert server_idle(server)


def server_idle(server, timeout: float = 10) -> bool:
    """The cancelled generation left the engine."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(server.root + "/health").json()["active"] == 0:
            return True
        time.sleep(0.05)
    return False


def test_include_output_text_logprobs(server):
    r = create(server, include=["message.output_text.logprobs"], top_logprobs=3)
    (part,) = r.output[0].content
    assert len(part.logprobs) == 8 and all(len(lp.top_logprobs) == 3 for lp in part.logprobs)
    assert all(lp.logprob == max(t.logprob for t in lp.top_logprobs) for lp in part.logprobs)  # greedy: the best one
    events = list(create(server, include=["message.output_text.logprobs"], top_logprobs=3, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert [lp.token for lp in events[-1].response.output[0].content[0].logprobs] == [lp.token for lp in part.logprobs]
    assert create(server).output[0].content[0].logprobs == []  # not asked for
    with pytest.raises(openai.BadRequestError, match="include"):
        create(server, include=["message.output_text.everything"])


def test_incomplete_and_empty_replies_keep_their_message_item(server, scripted, scripted_checkpoint):
    r = create(server, max_output_tokens=4)
    assert r.status == "incomplete" and r.output[-1].type == "message" and r.output[-1].status == "incomplete"
    events = list(create(server, max_output_tokens=4, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.status for i in done] == ["incomplete"] and events[-1].response.output[-1].status == "incomplete"
    # Cut off right after the reasoning: no text yet, the message is there, empty.
    tok = PreTrainedTokenizerFast.from_pretrained(str(scripted_checkpoint))
    n = len(tok.encode("Greet them briefly.\n</think>\n\n", add_special_tokens=False))
    for stream in (False, True):
        r = create(scripted, input=HI, reasoning={"effort": "high"}, max_output_tokens=n, stream=stream)
        r = list(r)[-1].response if stream else r
        assert [(i.type, i.status) for i in r.output] == [("reasoning", "completed"), ("message", "incomplete")]
        assert r.output[1].content[0].text == "" and r.output_text == ""
