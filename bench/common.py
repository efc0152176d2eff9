"""Helpers the benchmark scripts share: prompts, fp32 casting, run results, JSON output."""

from __future__ import annotations

import mtp_serve  # noqa: F401  (before mlx.core: OpenBLAS preload, fp32 on CPU)

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mtp_serve import BACKEND

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
pc = time.perf_counter


def fp32(model) -> None:
    model.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x, model.parameters()))


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def n_params(m) -> int:
    return sum(v.size for _, v in tree_flatten(m.parameters()))


def progress(items, label: str, total=None):
    """`items`, with a counter and the time left redrawn on stderr while a long run goes on;
    nothing extra when output is not a terminal (`MTP_PROGRESS=0/1` forces it)."""
    from mtp_serve.cli.progress import progress as shown

    return shown(items, label, total)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def timed_seconds(f, reps: int) -> list:
    """Seconds of each of `reps` timed calls of f, after one untimed call."""
    f()
    times = []
    for _ in range(reps):
        t0 = pc()
        f()
        times.append(pc() - t0)
    return times


def median_seconds(f, reps: int) -> float:
    """Median seconds of `reps` timed calls of f (a busy machine adds outliers)."""
    return statistics.median(timed_seconds(f, reps))


def load_prompts(model_dir: Path, tokenizer, n: int, length: int) -> tuple[list[tuple[str, list[int]]], str]:
    """Held-out code prompts: demo_acceptance's source when it applies, else stdlib files."""
    src = Path(os.__file__).parent
    if (model_dir / "heldout_files.json").exists():
        try:
            sys.path.insert(0, str(BENCH_DIR))
            from demo_acceptance import heldout_prompts

            prompts = heldout_prompts(model_dir, tokenizer, n, length, src)
            if len(prompts) >= min(n, 1):
                return prompts, "bench/demo_acceptance.py heldout_prompts (files held out of the demo model's training)"
        except Exception as e:  # fall back to plain stdlib text
            print(f"note: demo_acceptance prompts unavailable ({one_line(e)}); using stdlib files", file=sys.stderr)
    files = sorted(p for p in src.glob("*.py") if p.stat().st_size > 8000)
    out = []
    step = max(1, len(files) // max(n, 1))
    for p in files[::step]:
        ids = tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        if len(ids) < length + 16:
            continue
        start = min(len(ids) // 3, len(ids) - length - 1)
        out.append((p.name, ids[start : start + length]))
        if len(out) == n:
            break
    return out, f"Python stdlib files ({src}), {length} tokens from a third of the way in (not known to be held out)"



@dataclass
class RunResult:
    tokens: List[int]
    ttft_s: float
    decode_s: float  # first to last token
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


def environment(argv) -> dict:
    env = {"backend": BACKEND.note, "python": sys.version.split()[0], "platform": platform.platform(),
           "cpus": os.cpu_count(), "argv": argv}
    try:
        import importlib.metadata as md

        env["versions"] = {p: md.version(p) for p in ("mlx", "mlx-lm")}
        try:
            env["versions"]["mtplx"] = md.version("mtplx")
        except md.PackageNotFoundError:
            pass
    except Exception:
        pass
    return env


def stream_events(url: str, body: dict, timeout: float = 600):
    """POST `body` to a streaming (SSE) endpoint; yields each `data:` event, parsed, until [DONE]."""
    import httpx

    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def write_json(path, result: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=_json_default))
    print(f"\nwrote {out}")


def _json_default(o):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    return str(o)


class MaskTimes:
    """Every RowGrammar.mask call's time while in the block (patched on the class, for this
    process only): `times`, and their sum and count."""

    def __init__(self):
        self.times: List[float] = []

    @property
    def seconds(self) -> float:
        return sum(self.times)

    @property
    def calls(self) -> int:
        return len(self.times)

    def __enter__(self):
        from mtp_serve.engine import grammar

        self.orig = grammar.RowGrammar.mask
        timer = self

        def mask(row):
            t = pc()
            out = timer.orig(row)
            timer.times.append(pc() - t)
            return out

        grammar.RowGrammar.mask = mask
        return self

    def __exit__(self, *exc):
        from mtp_serve.engine import grammar

        grammar.RowGrammar.mask = self.orig
