"""Run a program on several local ranks the way users do, with MLX's own launcher:

    with LaunchedServer("/path/to/model", ranks=2, args=["--enable-mtp"]) as server:
        openai.OpenAI(base_url=server.base_url, api_key="none")...
        os.kill(server.pids[1], signal.SIGKILL)                    # a rank dies

`mlx.launch -n N --backend ring` starts local ranks without ssh; the ring's
ports are picked free here, so several runs can share a machine. For tests
and benchmarks.

The launcher polls its ranks' pipes without sleeping (its `select` always finds
a rank's stdin writable), about one core of a 2-core machine; once the ranks
are started its threads are moved to the lowest CPU priority, so the ranks get
the cores they would have if started apart (the ranks keep theirs).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import httpx

REPORT_LINE = re.compile(r"rank (\d+) on (\S+) \(pid (\d+)\)")
EXIT_LINE = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")


def program(name: str) -> str:
    """A console script of this environment (next to its Python), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of n consecutive free ports (the ring backend listens on start .. start+n-1)."""
    for _ in range(200):
        start = random.randint(20000, 60000 - n)
        try:
            socks = []
            for p in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports found")


def launch_command(ranks: int, argv: Sequence[str]) -> List[str]:
    """`mlx.launch` starting `argv` on `ranks` local ranks over the ring backend."""
    return [program("mlx.launch"), "-n", str(ranks), "--backend", "ring",
            "--starting-port", str(free_port_run(ranks)), *argv]


def run_launched(command: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a launch command to its end; on timeout every rank is killed too (they share
    the launcher's process group), then TimeoutExpired is raised."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    ranks = int(command[command.index("-n") + 1]) if "-n" in command else 0
    threading.Thread(target=lower_launcher_priority, args=(proc, ranks), daemon=True).start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _children(pid: int) -> List[int]:
    kids: List[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def lower_launcher_priority(proc: subprocess.Popen, ranks: int, timeout: float = 60.0) -> bool:
    """Once the launcher has started its `ranks` children, set each of its own threads to
    nice 19 (Linux niceness is per thread; the ranks, started at the launcher's priority
    before this, keep it). False where it could not (no /proc, the launcher gone, no ranks)."""
    if not hasattr(os, "setpriority") or not Path(f"/proc/{proc.pid}/task").exists():
        return False
    deadline = time.time() + timeout
    while len(_children(proc.pid)) < ranks:
        if proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.05)
    for task in Path(f"/proc/{proc.pid}/task").glob("*"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
        except OSError:
            pass
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Loopback:
    """The URLs of a server on 127.0.0.1:`port`."""

    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LaunchedServer(Loopback):
    """`mtp-serve` on `ranks` local ranks; rank 0 serves HTTP on a free port."""

    def __init__(self, model: str, ranks: int = 2, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None):
        self.port = free_port()
        self.command = launch_command(ranks, [program("mtp-serve"), "--model", str(model), "--port", str(self.port),
                                              "--log-level", "warning", *args])
        self.ranks = ranks
        self.env = {**os.environ, **(env or {})}
        self._log = tempfile.NamedTemporaryFile("w+", prefix="mtp-ranks-", suffix=".log", delete=False)
        self.process: Optional[subprocess.Popen] = None
        self.pids: Dict[int, int] = {}

    @property
    def output(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def reported_pids(self) -> Dict[int, int]:
        """Rank -> PID, from the start-up lines the launcher has relayed so far."""
        return {int(r): int(p) for r, _, p in REPORT_LINE.findall(self.output)}

    def start(self, timeout: float = 240.0) -> "LaunchedServer":
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        lower_launcher_priority(self.process, self.ranks)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the ranks exited before serving:\n{self.output[-4000:]}")
            try:
                if httpx.get(self.root + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"the ranks did not start serving in {timeout:.0f}s:\n{self.output[-4000:]}")
        # The launcher relays the ranks' start-up lines at low priority: on a busy machine rank 0 can
        # serve before its line has reached the log.
        while True:
            self.pids = self.reported_pids()
            if len(self.pids) == self.ranks or time.time() > deadline:
                break
            time.sleep(0.2)
        if len(self.pids) != self.ranks:
            raise RuntimeError(f"the start-up report names ranks {sorted(self.pids)}:\n{self.output[-4000:]}")
        return self

    def wait(self, timeout: float) -> Optional[int]:
        """The launcher's exit status once it exits within `timeout`, else None."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def exit_codes(self) -> Dict[int, int]:
        """Ranks that exited non-zero, as the launcher reported them."""
        return {int(r): int(c) for r, c in EXIT_LINE.findall(self.output)}

    def stop(self, timeout: float = 30.0) -> None:
        """Stop as an operator would: SIGTERM to rank 0 (it tells the others to stop)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.pids = self.pids or self.reported_pids()
        _signal(self.pids.get(0), signal.SIGTERM)
        if self.wait(timeout) is None:  # the launcher and every rank
            _kill_group(self.process)
            self.process.wait(10)

    def __enter__(self) -> "LaunchedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal(pid: Optional[int], sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
