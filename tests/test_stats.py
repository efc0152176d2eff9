"""`GET /v1/stats` (the web page's data): its schema, its values against `/metrics` at the same
moment, live figures while a request decodes; the Grafana dashboard names only exported metrics;
`GET /` answers a browser with the page and every other client with JSON, with and without an
API key."""

import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtp_serve.server.stats_api import Stats
from support.server import serve

pytestmark = pytest.mark.e2e  # live servers on loopback

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "mtp-serve.json"
HTML = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}  # what Chromium sends


@pytest.fixture(scope="module")
def live(checkpoint_dir, tmp_path_factory):
    """MTP depth 2 on the agreeable synthetic model, with the prompt cache's disk tier."""
    s = serve(checkpoint_dir("qwen3_5", agreeable=True), mtp_depth=2, fixed_depth=True,
              prompt_cache_dir=str(tmp_path_factory.mktemp("prompt-cache")))
    client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "one two three"}]
    first = client.chat.completions.create(model="test-model", messages=messages, max_tokens=24, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "four"}]
    client.chat.completions.create(model="test-model", messages=messages, max_tokens=24, temperature=0)  # a cache hit
    client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "off"}], max_tokens=8,
                                   temperature=0, extra_body={"mtp_depth": 0})
    yield s
    s.stop()


def scrape(server) -> dict:
    """/metrics as {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(server.root + "/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def per(m: dict, name: str, label: str) -> dict:
    return {dict(k)[label]: v for (n, k), v in m.items() if n == name}


def positions(m: dict, name: str) -> list:
    by = per(m, name, "position")
    return [by[p] for p in sorted(by, key=int)]


def test_schema(live):
    body = httpx.get(live.root + "/v1/stats").json()
    Stats.model_validate(body)
    assert body["object"] == "stats" and body["model"] == "test-model"
    assert set(body["engine"]) == {"queue_depth", "active_sequences", "running_sequences", "batch_capacity", "decode_rounds"}
    assert set(body["decode"]) == {"tokens_per_second", "tokens_per_pass", "acceptance_per_position", "row_depths"}
    assert set(body["totals"]) == {"requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "backbone_passes",
                                   "drafted_per_position", "accepted_per_position", "drafted_by_source",
                                   "accepted_by_source", "max_tokens_lowered"}
    assert set(body["totals"]["accepted_by_source"]) == {"mtp", "copy", "forced"}
    pc = body["prompt_cache"]
    assert pc["enabled"] and set(pc["bytes"]) == {"ram", "disk"}
    for key in ("bytes", "budget_bytes", "snapshots", "hits", "reused_tokens", "evictions"):
        assert set(pc[key]) == {"ram", "disk"} and all(isinstance(v, int) for v in pc[key].values()), key
    assert body["mtp"]["depth_cap"] == 2 and body["engine"]["batch_capacity"] == 8
    assert len(body["totals"]["drafted_per_position"]) == 2 and len(body["policy"]["acceptance_per_position"]) == 2
    assert "/v1/stats" in httpx.get(live.root + "/openapi.json").json()["paths"]


def test_values_agree_with_metrics(live):
    """The engine is idle: a poll and a scrape see the same numbers."""
    body = httpx.get(live.root + "/v1/stats").json()
    m = scrape(live)
    one = lambda name: m[(name, ())]  # noqa: E731
    tot = body["totals"]
    assert tot["completion_tokens"] == one("mtp_completion_tokens_total") > 0
    assert tot["prompt_tokens"] == one("mtp_prompt_tokens_total") > 0
    assert tot["cached_prompt_tokens"] == one("mtp_cached_prompt_tokens_total") > 0
    assert tot["backbone_passes"] == one("mtp_backbone_passes_total") > 0
    assert tot["drafted_per_position"] == positions(m, "mtp_draft_tokens_total")
    assert tot["accepted_per_position"] == positions(m, "mtp_accepted_tokens_total")
    assert sum(tot["accepted_per_position"]) > 0
    assert tot["requests"] == sum(v for (n, _), v in m.items() if n == "mtp_requests_total") == 3  # generation requests
    assert body["engine"]["decode_rounds"] == one("mtp_decode_rounds_total") > 0
    assert body["engine"]["batch_capacity"] == one("mtp_batch_capacity")
    assert body["engine"]["running_sequences"] == one("mtp_running_sequences") == 0
    assert body["mtp"]["depth_cap"] == one("mtp_depth_cap")
    assert body["policy"]["acceptance_per_position"] == pytest.approx(positions(m, "mtp_policy_acceptance"), abs=1e-4)
    assert body["decode"] == {"tokens_per_second": 0, "tokens_per_pass": 0.0, "acceptance_per_position": [], "row_depths": []}
    pc = body["prompt_cache"]
    for key, name in [("bytes", "mtp_prompt_cache_bytes"), ("budget_bytes", "mtp_prompt_cache_budget_bytes"),
                      ("snapshots", "mtp_prompt_cache_snapshots"), ("hits", "mtp_prompt_cache_hits_total"),
                      ("reused_tokens", "mtp_prompt_cache_reused_tokens_total"),
                      ("evictions", "mtp_prompt_cache_evictions_total")]:
        assert pc[key] == per(m, name, "tier"), key
    assert pc["misses"] == one("mtp_prompt_cache_misses_total") and pc["stored"] == one("mtp_prompt_cache_stored_total")
    assert pc["bytes"]["ram"] > 0 and sum(pc["hits"].values()) >= 1 and sum(pc["reused_tokens"].values()) > 0
    # totals against what the requests themselves reported are checked by the usage tests; here: tokens per pass
    assert 1.0 < tot["completion_tokens"] / tot["backbone_passes"] <= 3.0


def test_live_figures_while_a_request_decodes(live):
    done = threading.Event()

    def long_request():
        try:
            httpx.post(live.base_url + "/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "count"}], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                # The head's drafts alone: a round then emits at most depth + 1 = 3 tokens (a copied
                # chain can emit more).
                "speculative": {"copy": False}})
        finally:
            done.set()

    threading.Thread(target=long_request, daemon=True).start()
    seen = None
    while not done.is_set():
        body = httpx.get(live.root + "/v1/stats").json()
        if body["engine"]["running_sequences"] == 1 and body["decode"]["tokens_per_second"] > 0:
            seen = body
            break
        time.sleep(0.02)
    done.wait(120)
    assert seen is not None, "no poll saw the request decoding"
    assert seen["decode"]["row_depths"] in ([], [0], [1], [2])  # [] only before the row's first round
    assert 1.0 <= seen["decode"]["tokens_per_pass"] <= 3.0 or seen["decode"]["tokens_per_pass"] == 0.0
    assert all(0.0 <= a <= 1.0 for a in seen["decode"]["acceptance_per_position"])
    after = httpx.get(live.root + "/v1/stats").json()
    assert after["engine"]["running_sequences"] == 0 and after["totals"]["completion_tokens"] >= 1500


def exported_names(m_text: str) -> set:
    """Every series name /metrics can carry, including a labelled family with no series yet."""
    names = set()
    for family in text_string_to_metric_families(m_text):
        names |= {s.name for s in family.samples}
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def test_grafana_dashboard_names_only_exported_metrics(live):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 8 and all(p["type"] == "timeseries" for p in dash["panels"])
    used = {n for e in exprs for n in re.findall(r"\bmtp_[a-z0-9_]+", e)}
    exported = exported_names(httpx.get(live.root + "/metrics").text)
    assert used and used <= exported, used - exported
    # the page's charts have their panels
    for name in ("mtp_running_decode_tokens_per_second", "mtp_running_tokens_per_pass", "mtp_policy_acceptance",
                 "mtp_row_depth", "mtp_running_sequences", "mtp_prompt_cache_bytes", "mtp_prompt_cache_hits_total",
                 "mtp_prompt_cache_reused_tokens_total"):
        assert name in used, name
    # every panel and target reads the dashboard's datasource variable
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {"${datasource}"}


def test_root_answers_browsers_with_the_page_and_clients_with_json(live):
    assert httpx.get(live.root + "/").json()["object"] == "server"
    assert httpx.get(live.root + "/", headers={"Accept": "application/json"}).json()["object"] == "server"
    assert httpx.head(live.root + "/").status_code == 200
    page = httpx.get(live.root + "/", headers=HTML)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/ui/app.js" in page.text and "http" not in page.text.replace("http-equiv", "")  # nothing from outside
    assert httpx.get(live.root + "/ui").text == page.text
    for name, kind in [("app.js", "text/javascript"), ("charts.js", "text/javascript"), ("style.css", "text/css")]:
        r = httpx.get(live.root + "/ui/" + name)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert "://" not in r.text.replace("http://127.0.0.1", ""), name  # no CDN
    assert httpx.get(live.root + "/ui/nope.js").status_code == 404


def test_with_an_api_key_the_page_is_open_and_its_data_keyed(checkpoint_dir):
    with serve(checkpoint_dir("qwen3_5", agreeable=True), api_key="sekrit") as s:
        assert httpx.get(s.root + "/", headers=HTML).headers["content-type"].startswith("text/html")
        assert httpx.get(s.root + "/").json()["object"] == "server"  # agents' probe, without the key
        assert httpx.head(s.root + "/").status_code == 200
        for path in ("/ui", "/ui/app.js", "/ui/charts.js", "/ui/style.css"):
            assert httpx.get(s.root + path).status_code == 200, path
        assert httpx.get(s.root + "/v1/stats").status_code == 401
        assert httpx.get(s.root + "/v1/stats", headers={"Authorization": "Bearer sekrit"}).json()["object"] == "stats"
        assert httpx.get(s.root + "/ui/nope.js").status_code == 401  # only the page's own files are open
