"""Progress a person can see, on a terminal only: nothing extra when output goes to a file or a pipe.

    for item in progress(items, "repeat 1/3"):          # a counter with elapsed time and an estimate
        ...
    with stage("warming up the decode paths"):          # a spinner with elapsed time while it runs
        warm_up(...)
    with tensor_writes():                               # each safetensors file as it is written
        convert(...)
    hub_progress()                                      # huggingface_hub's download bars: on a terminal only

Progress goes to stderr and is redrawn in place (`\\r`); the line is cleared when done, so what
stays on the screen is what the commands print anyway. `MTP_PROGRESS=0` turns it off, `=1` on
even without a terminal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")
SPIN = "|/-\\"


def enabled(stream=None) -> bool:
    forced = os.environ.get("MTP_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def _clock(s: float) -> str:
    return f"{s:.0f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


class _Line:
    """One status line redrawn in place."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()

    def show(self, text: str) -> None:
        with self.lock:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()

    def clear(self) -> None:
        self.show("")


def progress(items: Iterable[T], label: str, total: Optional[int] = None, stream=None) -> Iterator[T]:
    """`items`, with `label i/total, elapsed, ~left` redrawn after each one (on a terminal)."""
    stream = stream or sys.stderr
    if not enabled(stream):
        yield from items
        return
    if total is None:
        total = len(items) if hasattr(items, "__len__") else None
    line, t0 = _Line(stream), time.perf_counter()
    line.show(f"{label} 0/{total if total is not None else '?'}")
    try:
        for i, item in enumerate(items, 1):
            yield item
            spent = time.perf_counter() - t0
            left = f", ~{_clock(spent / i * (total - i))} left" if total else ""
            line.show(f"{label} {i}/{total if total is not None else '?'}, {_clock(spent)}{left}")
    finally:
        line.clear()


@contextmanager
def stage(label: str, stream=None):
    """A spinner and the elapsed time beside `label` while the block runs (on a terminal)."""
    stream = stream or sys.stderr
    if not enabled(stream):
        yield
        return
    line, t0, done = _Line(stream), time.perf_counter(), threading.Event()

    def spin():
        k = 0
        while not done.wait(0.25):
            k += 1
            line.show(f"{SPIN[k % len(SPIN)]} {label} ({_clock(time.perf_counter() - t0)})")

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        line.clear()


@contextmanager
def tensor_writes(stream=None):
    """Each safetensors file mlx writes (mlx-lm's shards, the head's shard) named with its size
    while it is written (on a terminal)."""
    stream = stream or sys.stderr
    if not enabled(stream):
        yield
        return
    import mlx.core as mx

    save = mx.save_safetensors

    def announced(path, arrays, *args, **kwargs):
        size = sum(a.nbytes for a in arrays.values())
        with stage(f"writing {os.path.basename(str(path))}: {len(arrays)} tensors, {size / 2**20:,.1f} MiB", stream):
            return save(path, arrays, *args, **kwargs)

    mx.save_safetensors = announced
    try:
        yield
    finally:
        mx.save_safetensors = save


def hub_progress(stream=None) -> None:
    """huggingface_hub's download bars on a terminal, none otherwise (unless its own
    HF_HUB_DISABLE_PROGRESS_BARS says)."""
    if "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    enable_progress_bars() if enabled(stream) else disable_progress_bars()
