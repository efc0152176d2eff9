"""Where the end-to-end tests find the agents installed from npm, and what they do without them.

`./install.sh --test` installs each under .work/<dir>/node_modules/.bin; $<NAME>_BIN
overrides. Without the binary a test skips, saying so, except in CI (CI=true), where it
fails. No tests here."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def npm_bin(binary: str, work_dir: str, env_var: str) -> str:
    candidates = [
        os.environ.get(env_var),
        str(REPO / f".work/{work_dir}/node_modules/.bin/{binary}"),
        f"node_modules/.bin/{binary}",
        str(REPO / f"node_modules/.bin/{binary}"),
    ]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(Path(c).absolute())
    reason = f"{binary} not installed: run ./install.sh --test or set {env_var}"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def metric(text: str, pattern: str) -> float:
    m = re.search(pattern + r" ([0-9.e+]+)", text)
    return float(m.group(1)) if m else 0.0


def failed_requests(text: str, endpoint: str) -> float:
    """Requests to `endpoint` answered with any status but 200 and 499 (the client went away
    itself: opencode drops its title request once the main reply is done)."""
    return sum(float(v) for status, v in re.findall(r'mtp_requests_total\{endpoint="%s",status="(\d+)"\} ([0-9.e+]+)' % re.escape(endpoint), text)
               if status not in ("200", "499"))
