"""Copy drafts through the server: on by default with MTP, reported in usage
(`speculative.copy_drafted` / `copy_accepted`), /v1/stats (`accepted_by_source`) and
/metrics; off per request with `"speculative": {"copy": false}` on every API, off per
server with `copy_max` 0 (`--copy-drafts 0`); the output is the same either way."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from support.server import serve

pytestmark = pytest.mark.e2e

P = [5, 17, 99, 3, 42, 7, 250, 11, 64, 30]


@pytest.fixture(scope="module")
def copy_server(checkpoint_dir):
    s = serve(checkpoint_dir("qwen3_5", agreeable=True), mtp_depth=2, fixed_depth=True)
    yield s
    s.stop()


def completion(client, prompt, **extra):
    return client.completions.create(model="test-model", prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


def test_copies_are_reported_and_switch_off_per_request(copy_server):
    client = OpenAI(base_url=copy_server.base_url, api_key="none")
    first = completion(client, P, speculative={"copy": False})
    assert first.usage.speculative["copy_drafted"] == 0
    # P, what the model writes after it, then P again: copies land after the second P.
    lm = copy_server.service.loaded
    follows = [t for c in generate(lm.model, lm.tokenizer, P, SamplingParams(max_tokens=24, ignore_eos=True), copy_max=0)
               for t in c.token_ids]
    prompt = P + follows + P
    on = completion(client, prompt)
    off = completion(client, prompt, speculative={"copy": False})
    assert on.choices[0].text == off.choices[0].text
    assert on.usage.speculative["copy_accepted"] > 0 and off.usage.speculative["copy_drafted"] == 0
    totals = httpx.get(copy_server.root + "/v1/stats").json()["totals"]
    assert totals["accepted_by_source"]["copy"] >= on.usage.speculative["copy_accepted"]
    assert 'mtp_certain_accepted_tokens_total{source="copy"}' in httpx.get(copy_server.root + "/metrics").text


@pytest.mark.parametrize("path,body", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/responses", {"input": "hi"}),
])
def test_every_api_takes_the_switch_and_refuses_unknown_keys(copy_server, path, body):
    url = copy_server.base_url + path
    body = {"model": "test-model", "max_tokens": 4, **body} if path != "/responses" else {"model": "test-model", **body}
    r = httpx.post(url, json={**body, "speculative": {"copy": False}}, timeout=60)
    assert r.status_code == 200, r.text
    bad = httpx.post(url, json={**body, "speculative": {"copies": False}}, timeout=60)
    assert bad.status_code == 400 and "speculative" in bad.text, bad.text


def test_server_without_copy_drafts_never_copies(checkpoint_dir):
    s = serve(checkpoint_dir("qwen3_5", agreeable=True), mtp_depth=2, fixed_depth=True, copy_max=0)
    try:
        client = OpenAI(base_url=s.base_url, api_key="none")
        prompt = P + P + P
        assert completion(client, prompt).usage.speculative["copy_drafted"] == 0
    finally:
        s.stop()
