"""The web page in headless Chromium (Debian's `chromium`, driven by playwright; `install.sh --test`
installs both) against live servers: the demo model (the page loads with no console errors, a chat
turn streams in, the charts receive data, the side-by-side run reports identical texts; a
screenshot is saved) and the scripted model behind an API key (the page asks for the key; reasoning
and tool calls are shown apart).

    python3 -m pytest -q tests/test_web_page.py        # prints where the screenshot went
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from support.server import THINK, WEATHER_TOOL, serve

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parent.parent / ".work" / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # no connections beyond loopback


def chromium_path():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    exe = chromium_path()
    if sync_playwright is None or exe is None:
        why = "the browser tests need playwright and Debian's chromium (./install.sh --test installs both)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def demo():
    from mtp_serve.models.demo_model import default_model_path

    s = serve(default_model_path(), served_model_name="demo", mtp_depth=3)
    yield s
    s.stop()


def open_page(browser, server, errors):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.root + "/?poll=200")  # Chromium's own Accept header: the page, not the JSON
    return page


def series_max(page, chart: str) -> float:
    return page.evaluate(f"""Math.max(0, ...[...window.mtpPage.charts.{chart}.series.values()].flat()
                                          .filter((v) => v !== null))""")


def test_demo_model_chat_charts_and_side_by_side(browser, demo):
    errors = []
    page = open_page(browser, demo, errors)
    page.wait_for_selector("#conn.ok", timeout=15000)
    assert page.inner_text("#model") == "demo"
    assert "depth 3" in page.inner_text("#mtp-status")

    # A chat turn streams into the page, and its usage figures follow.
    page.fill("#max_tokens", "200")
    page.fill("#prompt", "def fibonacci(n):")
    page.click("#send")
    reply = page.wait_for_selector(".msg.assistant[data-done=true]", timeout=60000)
    assert "error" not in reply.get_attribute("class")
    assert int(reply.get_attribute("data-deltas")) > 10  # many pieces, not one body at the end
    usage = reply.query_selector(".usage")
    assert int(usage.get_attribute("data-completion-tokens")) > 10
    text = usage.inner_text()
    assert "depth 3" in text and "tokens/pass" in text and "acceptance by position" in text, text

    # The charts received the server's figures while it decoded.
    page.wait_for_function("window.mtpPage.state.polls >= 3")
    assert series_max(page, "tokS") > 0  # decode tok/s of the running row
    assert series_max(page, "perPass") > 1  # MTP: more than one token per backbone pass
    assert 0 < series_max(page, "acceptance") <= 1
    # the head drafted in some round, or copies from the context did its work (the row's depth is then 0)
    assert series_max(page, "depth") >= 1 or series_max(page, "sources") > 0
    assert series_max(page, "cacheBytes") > 0
    points = page.evaluate("Object.fromEntries(Object.entries(window.mtpPage.charts).map(([k, c]) => [k, c.points]))")
    assert all(n > 0 for n in points.values()), points
    assert "completion tokens" in page.inner_text("#totals")
    assert "accepted by source" in page.inner_text("#totals")  # head, copied, grammar-forced

    # Side by side: the same prompt greedy with MTP off and on gives the same text.
    page.fill("#prompt", "import os\n\ndef read(path):")
    page.click("#compare")
    result = page.wait_for_selector("#compare-result[data-state=done]", timeout=120000)
    verdict = result.inner_text()
    assert result.get_attribute("data-identical") == "true", verdict
    assert "identical texts" in verdict and "MTP off" in verdict and "MTP depth 3" in verdict
    assert float(result.get_attribute("data-speedup")) > 0

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "web_page.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot of the page: {shot}")
    assert shot.stat().st_size > 10_000
    assert errors == []
    page.close()


def test_api_key_reasoning_and_tool_calls(browser, scripted_checkpoint):
    """Behind --api-key: the page's files load, it asks for the key, then chats; the scripted
    model's reply shows its reasoning apart and its two tool calls as calls."""
    with serve(scripted_checkpoint, api_key="sekrit") as s:
        errors = []
        page = open_page(browser, s, errors)
        page.wait_for_selector("#key-form:not([hidden])", timeout=15000)
        assert not any("TypeError" in e or "ReferenceError" in e for e in errors), errors  # only the 401s
        page.fill("#key", "sekrit")
        page.click("#key-form button")
        page.wait_for_selector("#conn.ok", timeout=15000)
        assert page.inner_text("#model") == "test-model"
        assert page.evaluate("localStorage.getItem('mtp-serve-api-key')") == "sekrit"

        page.check("#thinking") if THINK["enable_thinking"] else page.uncheck("#thinking")
        page.fill("#tools", json.dumps([WEATHER_TOOL]))
        page.fill("#max_tokens", "400")
        page.fill("#prompt", "Weather in Paris and Tokyo?")
        page.click("#send")
        reply = page.wait_for_selector(".msg.assistant[data-done=true]", timeout=60000)
        assert "error" not in reply.get_attribute("class"), reply.inner_text()
        assert "The user wants the weather." in reply.query_selector(".reasoning").text_content()
        calls = [c.inner_text() for c in reply.query_selector_all(".tool-call")]
        assert len(calls) == 2 and all(c.startswith("get_weather(") for c in calls), calls
        assert json.loads(calls[0][len("get_weather("):-1]) == {"city": "Paris", "days": 3}
        assert "<tool_call>" not in reply.query_selector(".content").inner_text()
        page.close()
