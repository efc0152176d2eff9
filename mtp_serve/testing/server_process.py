"""`mtp-serve` as users start it, in its own process on loopback (tests and benchmarks).

    with ServerProcess(["--enable-mtp", "--prompt-cache-dir", d]) as server:
        httpx.post(server.base_url + "/chat/completions", json=...)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: List[str], env: Optional[Dict[str, str]] = None, start_timeout: float = 180.0):
        import httpx

        self.port = free_port()
        self._log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would stall the server
        self.proc = subprocess.Popen([sys.executable, "-m", "mtp_serve.cli.serve", "--port", str(self.port), *map(str, args)],
                                     stdout=self._log, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **(env or {})))
        deadline = time.time() + start_timeout
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.root + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("mtp-serve did not start:\n" + self.stop())

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def stop(self) -> str:
        """Ctrl-C, as a user stops it (a clean shutdown); returns everything it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.seek(0)
        return self._log.read()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
