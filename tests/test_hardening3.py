"""Hardening, third round: every expensive step of preparing a prompt is bounded and sized before
it is paid for, and no hostile request holds up a small one (trickling image hosts, huge tool
definitions, wide schemas); image URLs reach public addresses only; a stop drains open streams
with final events; config mistakes are one line and status 1; `GET /` negotiates by RFC 9110.
Real parts: local HTTP servers on loopback, a live server on the synthetic models, `mtp-serve`
in its own process."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from mtp_serve.server.errors import APIError
from mtp_serve.server.images import ImageRef, ImageSettings, fetch
from test_images_api import load_with_vision, png

E2E = pytest.mark.e2e
MSG = [{"role": "user", "content": "Hello, model."}]
SMALL_PNG = png(64, 64)
FETCH = ImageSettings(max_images=4, max_image_bytes=200_000, fetch_timeout=1.5, fetch_allow_hosts=("127.0.0.1",))


# ---------------------------------------------------------------- a hostile image host


class HostileHost:
    """http://127.0.0.1:PORT/: a PNG, a body trickled a byte at a time, headers trickled, a
    redirect to another loopback address, a redirect loop and a 404."""

    def __init__(self):
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def trickle(self, data: bytes) -> None:
                for i in range(len(data)):
                    try:
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                    except OSError:  # the fetch gave up: it shut its socket
                        return
                    time.sleep(0.2)

            def do_GET(self):
                host.hits.append(self.path)
                if self.path == "/small.png":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(SMALL_PNG)))
                    self.end_headers()
                    self.wfile.write(SMALL_PNG)
                elif self.path == "/trickle.png":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(SMALL_PNG)))
                    self.end_headers()
                    self.trickle(SMALL_PNG)
                elif self.path == "/trickle-headers.png":
                    self.trickle(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n" + b"X-Slow: " + b"x" * 400)
                elif self.path == "/inside":
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.2:{host.port}/small.png")
                    self.end_headers()
                elif self.path == "/loop":
                    self.send_response(302)
                    self.send_header("Location", "/loop")
                    self.end_headers()
                else:
                    self.send_error(404)

        self.hits = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def hostile():
    h = HostileHost()
    yield h
    h.close()


def fetch_error(url: str, settings: ImageSettings = FETCH) -> tuple:
    """(the 400's message, seconds the fetch took)."""
    t = time.monotonic()
    with pytest.raises(APIError) as e:
        fetch(ImageRef(url, "messages[0].content[0]"), settings)
    assert e.value.status == 400
    return e.value.message, time.monotonic() - t


# ---------------------------------------------------------------- 1. a total fetch deadline


@pytest.mark.parametrize("path", ["/trickle.png", "/trickle-headers.png"], ids=["body", "headers"])
def test_a_trickling_image_host_is_cut_at_the_fetch_deadline(hostile, path):
    """A byte every 0.2 s would take 10+ s: the fetch ends at --image-fetch-timeout in all."""
    msg, took = fetch_error(hostile.url + path)
    assert "could not fetch the image (timed out" in msg and "--image-fetch-timeout" in msg, msg
    assert FETCH.fetch_timeout - 0.1 < took < FETCH.fetch_timeout + 0.5, took


def test_an_allowed_host_is_fetched(hostile):
    assert fetch(ImageRef(hostile.url + "/small.png", "m"), FETCH) == SMALL_PNG


# ---------------------------------------------------------------- 4. addresses, redirects, generic errors

INSIDE = ["http://127.0.0.1:{port}/small.png", "http://localhost:{port}/small.png", "http://[::1]:{port}/small.png",
          "http://[::ffff:127.0.0.1]:{port}/small.png", "http://169.254.169.254/latest/meta-data",
          "http://10.0.0.1/x.png", "http://192.168.1.1/x.png", "http://224.0.0.1/x.png", "http://0.0.0.0:{port}/x.png"]


@pytest.mark.parametrize("url", INSIDE)
def test_image_urls_to_inside_addresses_are_refused_by_default(hostile, url):
    """Loopback (by address or by a name that resolves to it), link-local, private, multicast
    and unspecified addresses are refused before any connection: the host sees nothing."""
    before = len(hostile.hits)
    msg, took = fetch_error(url.format(port=hostile.port), ImageSettings(fetch_timeout=1.5))
    assert "could not fetch the image (its address is not allowed" in msg and "--image-fetch-allow-hosts" in msg, msg
    assert took < 0.5 and len(hostile.hits) == before


def test_a_redirect_to_an_inside_address_is_refused(hostile):
    """The allow list lets 127.0.0.1 through; its redirect to 127.0.0.2 is checked again."""
    msg, _ = fetch_error(hostile.url + "/inside")
    assert "its address is not allowed" in msg, msg
    assert "/small.png" not in hostile.hits[-1:]


def test_fetch_errors_do_not_tell_what_answers_where(hostile):
    """A closed port, an HTTP 404 and a redirect loop read the same: a reason class, no detail."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
    try:
        messages = {fetch_error(url)[0] for url in (f"http://127.0.0.1:{closed.getsockname()[1]}/x.png",
                                                    hostile.url + "/missing.png", hostile.url + "/loop")}
    finally:
        closed.close()
    assert len(messages) == 1, messages
    msg = messages.pop()
    assert "could not fetch the image (the request failed" in msg, msg
    assert "404" not in msg and "refused" not in msg.lower() and "127.0.0.1" not in msg


# ---------------------------------------------------------------- no request holds up a small one


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def small_request(server) -> None:
    r = httpx.post(server.root + "/v1/chat/completions", json={"model": "test-model", "messages": MSG, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text[:300]


def beside(server, hostile_calls, settle: float = 0.3) -> tuple:
    """Run `hostile_calls` (each returns its response) on threads; once they are under way, time
    a small request. Returns (the small request's seconds alone, beside them, the hostile responses)."""
    for _ in range(2):
        small_request(server)  # warm
    alone = sorted(timed(lambda: small_request(server)) for _ in range(3))[1]  # the median: this machine's pace now
    results = [None] * len(hostile_calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(hostile_calls)]
    for th in threads:
        th.start()
    time.sleep(settle)
    during = max(timed(lambda: small_request(server)) for _ in range(3))
    for th in threads:
        th.join(120)
    return alone, during, results


@pytest.fixture(scope="module")
def vision_server(checkpoint_dir):
    from support.server import LiveServer, ServerConfig

    path = checkpoint_dir("qwen3_5", vision=True, agreeable=True)
    with LiveServer(load_with_vision(path), ServerConfig(served_model_name="test-model", images=FETCH)) as s:
        yield s


@E2E
def test_trickling_image_urls_do_not_hold_up_a_small_request(vision_server, hostile):
    """Three requests whose images trickle: each is refused at the fetch deadline (the third
    after waiting for a heavy-lane thread: two per lane), and a one-token request beside them
    answers within a second of its time alone."""
    body = {"model": "test-model", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": hostile.url + "/trickle.png"}}]}]}

    def trickling():
        t = time.monotonic()
        r = httpx.post(vision_server.root + "/v1/chat/completions", json=body, timeout=60)
        return r, time.monotonic() - t

    alone, during, results = beside(vision_server, [trickling] * 3)
    for r, took in results:
        assert r.status_code == 400 and "timed out" in r.json()["error"]["message"], r.text
        assert took < 2 * FETCH.fetch_timeout + 1.5, took
    assert during < alone + 1.0, (alone, during)


@E2E
def test_a_huge_tool_definition_is_refused_before_tokenizing(server):
    """Tool definitions count in the quick size check: 1.2 MB of them (about 19 times what the
    4096-token context can hold) is a 400 without rendering or tokenizing, and a small request
    beside two of them stays fast."""
    tool = {"type": "function", "function": {"name": "big", "description": "x" * 100, "parameters": {
        "type": "object", "properties": {f"field_{i}": {"type": "string", "description": "d" * 40} for i in range(15_000)}}}}
    body = {"model": "test-model", "messages": MSG, "max_tokens": 4, "tools": [tool]}
    payload = json.dumps(body).encode()
    assert len(payload) > 1 << 20 and len(payload) > 16 * server.service.too_many_prompt_bytes

    def huge():
        t = time.monotonic()
        r = httpx.post(server.root + "/v1/chat/completions", content=payload,
                       headers={"Content-Type": "application/json"}, timeout=120)
        return r, time.monotonic() - t

    alone, during, results = beside(server, [huge, huge], settle=0.1)
    for r, took in results:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        assert took < 3, took  # parsing and a walk that stops once the text cannot fit: no rendering, no tokenizing
    assert during < alone + 1.0, (alone, during)


@E2E
def test_a_wide_json_schema_is_refused_before_compiling(server):
    """10,000 optional properties would cost the grammar compiler a minute: a 400 naming the
    bound, at once, and a small request beside two of them stays fast."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    body = {"model": "test-model", "messages": MSG, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}}

    def wide():
        t = time.monotonic()
        r = httpx.post(server.root + "/v1/chat/completions", json=body, timeout=120)
        return r, time.monotonic() - t

    alone, during, results = beside(server, [wide, wide], settle=0.1)
    for r, took in results:
        assert r.status_code == 400, r.text[:300]
        assert "properties in one object" in r.json()["error"]["message"] and took < 5, (took, r.text[:300])
    assert during < alone + 1.0, (alone, during)


def test_the_schema_bounds_hold_before_any_grammar_work():
    """Past the subschema bound or the per-object property bound: a 400 from a walk of the
    schema (milliseconds), never from the compiler."""
    from mtp_serve.server.schema_relax import MAX_PROPERTIES, MAX_SUBSCHEMAS, serve_schema

    deep = {"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(MAX_PROPERTIES)}} for j in range(MAX_SUBSCHEMAS // MAX_PROPERTIES + 1)}}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_PROPERTIES + 1)}}
    for schema, needle in ((deep, "subschemas"), (wide, "properties in one object")):
        t = time.perf_counter()
        with pytest.raises(APIError) as e:
            serve_schema(schema, param="response_format")
        assert e.value.status == 400 and needle in e.value.message, e.value.message
        assert time.perf_counter() - t < 0.5


def test_grammar_work_is_waited_on_within_its_budget():
    """Work the compiler cannot interrupt is refused when its budget ends, not when it does."""
    from mtp_serve.server.lanes import within

    t = time.perf_counter()
    with pytest.raises(TimeoutError):
        within(0.3, time.sleep, 3)
    assert time.perf_counter() - t < 0.6
    assert within(1.0, sum, [1, 2]) == 3


# ---------------------------------------------------------------- 5. a stop that drains

STREAMS = {  # API: (path, body)
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "Write a long story."}]}),
    "completions": ("/completions", {"prompt": "Once upon a time"}),
    "messages": ("/messages", {"messages": [{"role": "user", "content": "Write a long story."}]}),
    "responses": ("/responses", {"input": "Write a long story."}),
}


def final_event(api: str, lines: list) -> None:
    """The stream ended in its API's shape: an error event (and `[DONE]` where the API has one)."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data, lines[-5:]
    if api in ("chat", "completions"):
        assert data[-1] == "[DONE]" and "error" in json.loads(data[-2]), data[-3:]
    elif api == "messages":
        assert json.loads(data[-1])["type"] == "error", data[-3:]
    else:
        assert json.loads(data[-1])["type"] in ("response.failed", "error"), data[-3:]


def open_streams(s, apis) -> list:
    """One long stream per API, each read on its own thread once its first event came."""
    out = []
    for api in apis:
        path, body = STREAMS[api]
        body = {"model": "", "max_tokens": 4000, "ignore_eos": True, "stream": True, **body}
        cm = httpx.stream("POST", s.base_url + path, json=body, timeout=120)
        r = cm.__enter__()
        it = r.iter_lines()
        lines = []
        for line in it:
            lines.append(line)
            if line.startswith("data: "):
                break
        state = {"lines": lines, "error": None}

        def read(it=it, state=state, cm=cm):
            try:
                for line in it:
                    state["lines"].append(line)
            except httpx.HTTPError as e:
                state["error"] = e
            finally:
                cm.__exit__(None, None, None)

        th = threading.Thread(target=read)
        th.start()
        out.append((api, th, state))
    return out


@pytest.mark.parametrize("signals", [1, 2], ids=["grace", "second-signal"])
@E2E
def test_a_stop_ends_open_streams_with_final_events(signals, tmp_path):
    """SIGTERM with a stream open on every API: new connections are refused at once, the streams
    go on for --shutdown-grace, then each ends with its final events (never a cut body); a
    second signal ends them at once. The process exits 0."""
    from mtp_serve.testing.server_process import ServerProcess

    grace = 2.0 if signals == 1 else 60.0
    s = ServerProcess(["--shutdown-grace", grace])
    try:
        streams = open_streams(s, STREAMS)
        t = time.perf_counter()
        s.proc.send_signal(signal.SIGTERM)
        if signals == 2:
            time.sleep(0.5)
            s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.root + "/health", timeout=2)  # no longer accepting
        for _, th, _ in streams:
            th.join(60)
        took = time.perf_counter() - t
        rc = s.proc.wait(60)
    finally:
        out = s.stop()
    for api, _, state in streams:
        assert state["error"] is None, (api, state["error"], out[-1500:])
        final_event(api, state["lines"])
    if signals == 1:
        assert grace - 0.5 < took < grace + 8, took
    else:
        assert took < 8, took
    assert rc == 0 and "ASGI callable returned without completing response" not in out, out[-2000:]


# ---------------------------------------------------------------- 6. config errors


def serve_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtp_serve.cli.serve", "--port", "0", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def config_cases(tmp_path, demo: str) -> dict:
    (tmp_path / "a-file").write_text("not a checkpoint")
    (tmp_path / "no-config").mkdir()
    two = '[[model]]\nname = "main"\npath = "{demo}"\n[[model]]\nname = "other"\npath = "{path}"\n{extra}'
    return {  # case: (config text, what the one line names)
        "missing path": (two.format(demo=demo, path="/nonexistent/model", extra=""), ["('other').path", "no such folder"]),
        "a file as path": (two.format(demo=demo, path=tmp_path / "a-file", extra=""), ["('other').path", "is a file"]),
        "pinned, not first, no checkpoint": (two.format(demo=demo, path=tmp_path / "no-config", extra="pinned = true"),
                                             ["('other').path", "no config.json"]),
        "empty name": (f'[[model]]\nname = ""\npath = "{demo}"', ["[[model]] 1.name", "empty"]),
        "budget below the first model": (f'[server]\nmax_loaded_bytes = "1M"\n[[model]]\nname = "main"\npath = "{demo}"',
                                         ["[server].max_loaded_bytes", "'main' needs", "MiB"]),
    }


@E2E
@pytest.mark.parametrize("case", ["missing path", "a file as path", "pinned, not first, no checkpoint", "empty name",
                                  "budget below the first model"])
def test_config_errors_are_one_line_and_status_1(case, tmp_path):
    from mtp_serve.models.demo_model import default_model_path

    text, needles = config_cases(tmp_path, str(default_model_path()))[case]
    (tmp_path / "serve.toml").write_text(text)
    p = serve_cli("--config", tmp_path / "serve.toml")
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert p.returncode == 1 and len(errors) == 1, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and f"--config {tmp_path / 'serve.toml'}" in errors[0], errors
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def test_model_paths_are_checked_when_the_config_is_read(tmp_path):
    from mtp_serve.cli import models_config

    (tmp_path / "f").write_text("x")
    for path, why in (("/no/such/folder", "no such folder"), (str(tmp_path / "f"), "is a file"),
                      (str(tmp_path), "no config.json"), ("./relative/missing", "no such folder")):
        with pytest.raises(models_config.ConfigError, match=why):
            models_config.parse_config(f'[[model]]\nname = "m"\npath = "{path}"')
    assert models_config.parse_config('[[model]]\npath = "Qwen/Qwen3.5-2B"').models[0]["path"] == "Qwen/Qwen3.5-2B"
    with pytest.raises(models_config.ConfigError, match="max_loaded_bytes: must be more than 0"):
        models_config.parse_config('[server]\nmax_loaded_bytes = 0\n[[model]]\nname = "m"')


# ---------------------------------------------------------------- 7, 8. GET / and sizes in messages

ACCEPT = {
    "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8": "html",  # Chromium
    "TEXT/HTML": "html",
    "text/*": "html",
    "text/html;q=0": "json",
    "text/html; q=0.5, application/json; q=0.9": "json",
    "application/json, text/html": "json",  # a tie goes to JSON
    "*/*": "json",
    "": "json",
    "text/html;q=oops": "json",
}


@E2E
def test_the_root_negotiates_by_rfc_9110(server):
    for accept, want in ACCEPT.items():
        r = httpx.get(server.root + "/", headers={"Accept": accept} if accept else {}, timeout=30)
        assert r.status_code == 200
        got = "html" if r.headers["content-type"].startswith("text/html") else "json"
        assert got == want, (accept, got)


def test_byte_sizes_in_messages_use_a_unit_that_fits():
    from mtp_serve.server.models_registry import gib

    assert gib(3 << 30) == "3.00 GiB" and gib(27 << 20) == "27.00 MiB" and gib(1536) == "1.50 KiB" and gib(12) == "12 bytes"
