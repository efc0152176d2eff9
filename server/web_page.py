"""The web page: a playground, live charts and an MTP on/off comparison, served from the package.

    open http://127.0.0.1:8000/          # a browser (Accept: text/html) gets the page; other clients JSON
    open http://127.0.0.1:8000/ui        # the page, whatever the Accept header

Static files in `server/ui/` (no build step, no CDN: it works offline). The files themselves
are open; every call the page makes for data (`/v1/models`, `/v1/stats`,
`/v1/chat/completions`) goes through the API key like any client's. With `--api-key` the page
asks for the key once, keeps it in the browser's localStorage and sends it as
`Authorization: Bearer` on its fetches: a browser cannot add that header when it navigates to a
page, and a key in a cookie or the URL would leak into logs and other tabs' requests.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse

from mtp_serve.server.errors import APIError

UI_DIR = Path(__file__).resolve().parent / "ui"
ASSETS = {"app.js": "text/javascript", "charts.js": "text/javascript", "style.css": "text/css",
          "screenshot.png": "image/png"}
OPEN_PATHS = frozenset({"/ui", "/ui/"} | {f"/ui/{name}" for name in ASSETS})
ROOT_RESPONSES = {200: {"content": {"application/json": {}, "text/html": {}},
                        "description": "JSON describing the server, or the web page when the client accepts text/html"}}
NO_CACHE = {"Cache-Control": "no-cache"}  # a new version of the server serves its own page

router = APIRouter(include_in_schema=False)


def wants_html(request: Request) -> bool:
    """A browser navigating: its Accept header prefers text/html to JSON (RFC 9110 content
    negotiation: q-values, the most specific range, case-insensitive). curl, SDKs and agents send
    */*, JSON or nothing, and a tie goes to JSON."""
    ranges = accept_ranges(request.headers.get("accept", ""))
    return quality(ranges, "text", "html") > quality(ranges, "application", "json")


def accept_ranges(header: str) -> list:
    """[(type, subtype, q)] of an Accept header, lower-cased; malformed ranges are skipped."""
    out = []
    for item in header.split(","):
        media, *params = item.split(";")
        kind, _, sub = media.strip().lower().partition("/")
        if not kind or not sub:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = min(1.0, max(0.0, float(value.strip())))
                except ValueError:
                    q = 0.0
        out.append((kind, sub, q))
    return out


def quality(ranges: list, kind: str, sub: str) -> float:
    """The q the most specific matching range gives kind/sub (0 when none matches)."""
    best, best_rank = 0.0, -1
    for k, s, q in ranges:
        rank = 2 if (k, s) == (kind, sub) else 1 if (k == kind and s == "*") else 0 if (k, s) == ("*", "*") else -1
        if rank > best_rank:
            best, best_rank = q, rank
    return best


def index() -> HTMLResponse:
    return HTMLResponse((UI_DIR / "index.html").read_text(encoding="utf-8"), headers=NO_CACHE)


@router.get("/ui")
@router.get("/ui/")
async def ui():
    return index()


@router.get("/ui/{name}")
async def asset(name: str):
    if name not in ASSETS:
        raise APIError(404, f"no file '{name}' in the web page", code="not_found")
    return FileResponse(UI_DIR / name, media_type=ASSETS[name], headers=NO_CACHE)
