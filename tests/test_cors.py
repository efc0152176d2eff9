"""CORS for browser clients on other origins: opt-in with --cors-origins (none by default),
preflights answered before the API key is asked for, Access-Control-Allow-Origin on the
listed origins' responses (errors included), nothing for other origins."""

import argparse

import httpx
import openai
import pytest

from mtp_serve.cli.common import origins
from support.server import serve

APP = "http://app.example:5173"
KEY = "sekrit"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3_5", agreeable=True)


@pytest.mark.e2e  # a live server (conftest.py: test tiers)
def test_listed_origins_get_preflights_and_allow_origin(model_dir):
    s = serve(model_dir, api_key=KEY, cors_origins=(APP, "https://other.example"))
    try:
        url = s.base_url + "/chat/completions"
        pre = httpx.options(url, headers={"Origin": APP, **PREFLIGHT})  # no key: a browser sends none here
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == APP
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        assert "POST" in pre.headers["access-control-allow-methods"]
        c = openai.OpenAI(base_url=s.base_url, api_key=KEY, max_retries=0, default_headers={"Origin": APP})
        r = c.chat.completions.with_raw_response.create(model="test-model", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=2)
        assert r.headers["access-control-allow-origin"] == APP and r.parse().choices[0].message.content is not None
        # The page can read an error too (here: no key).
        bad = httpx.post(url, headers={"Origin": APP}, json={"messages": []})
        assert bad.status_code == 401 and bad.headers["access-control-allow-origin"] == APP
        # Another origin: refused preflight, no header on its responses.
        other = httpx.options(url, headers={"Origin": "http://evil.example", **PREFLIGHT})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        assert "access-control-allow-origin" not in httpx.get(s.root + "/health", headers={"Origin": "http://evil.example"}).headers
    finally:
        s.stop()


@pytest.mark.e2e
def test_no_cors_by_default(model_dir):
    s = serve(model_dir, api_key=KEY)
    try:
        pre = httpx.options(s.base_url + "/chat/completions", headers={"Origin": APP, **PREFLIGHT})
        assert pre.status_code == 401 and "access-control-allow-origin" not in pre.headers
        h = httpx.get(s.base_url + "/models", headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
        assert h.status_code == 200 and "access-control-allow-origin" not in h.headers
    finally:
        s.stop()


def test_cors_origins_argument():
    assert origins("http://localhost:5173, https://app.example/") == ["http://localhost:5173", "https://app.example"]
    assert origins("*") == ["*"]
    for bad in ("localhost:5173", "http://a.example/path"):
        with pytest.raises(argparse.ArgumentTypeError):
            origins(bad)
