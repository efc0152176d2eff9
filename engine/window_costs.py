"""Verify-window costs in plain steps, measured on the running machine.

A round that copies L tokens from the context verifies a window of L+1 tokens; whether
that pays depends on what such a window costs against a plain one-token step on this
machine and model (1.1-1.3 plain steps at 4 tokens, 2-5 at 32 on the project's CPU).
`mtp-tune` measures each window bucket the copy choice uses and stores the costs in the
model's `mtp_serve.json` (`window_costs`), so the depth policy knows them before its
first copy round (engine/policy.py); the server keeps measuring them as it serves.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

import mlx.core as mx

from mtp_serve.models.caches import keep_verified, set_capture

from .context_drafts import MAX_COPY
from .policy import window_bucket


def window_buckets(copy_max: int = MAX_COPY) -> List[int]:
    """The window buckets copies of up to `copy_max` tokens use: 4, 8, ... up to copy_max + 1's."""
    top, out, w = window_bucket(copy_max + 1), [], 4
    while w <= top:
        out.append(w)
        w *= 2
    return out


def prefilled_cache(model: Any, context: int) -> List[Any]:
    """A fresh cache after a prompt of `context` random tokens."""
    cache = model.make_cache()
    h, _ = model.forward(mx.random.randint(0, min(1000, model.vocab_size), (1, context)), cache, last_logits=True)
    mx.eval(h, [c.state for c in cache])
    return cache


def time_window(model: Any, cache: List[Any], T: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one backbone forward of T tokens over `cache` and its commit (a verify
    window that keeps one token, GatedDeltaNet state capture on for T > 1): the cache grows
    by one token, as after a round whose drafts were all rejected."""
    x = mx.random.randint(0, min(1000, model.vocab_size), (1, T))
    mx.eval(x)
    set_capture(cache, T > 1)
    t0 = clock()
    h, logits = model.forward(x, cache)
    set_capture(cache, False)
    if T > 1:
        keep_verified(cache, [1], T)
    mx.eval(h, logits, [c.state for c in cache])
    return clock() - t0


def measure_window_costs(model: Any, context: int = 256, reps: int = 3, copy_max: int = MAX_COPY) -> Dict[int, float]:
    """Window bucket -> cost of its longest window used (at most copy_max + 1 tokens) in plain
    steps (medians over `reps`, a plain step timed beside each window so load hits both
    alike), after a prompt of `context` random tokens. The first repetition only warms up."""
    buckets = window_buckets(copy_max)
    cache = prefilled_cache(model, context)
    ratios: Dict[int, List[float]] = {w: [] for w in buckets}
    for rep in range(reps + 1):
        for w in buckets:
            plain = time_window(model, cache, 1)
            window = time_window(model, cache, min(w, copy_max + 1))
            if rep:
                ratios[w].append(window / plain)
    return {w: round(statistics.median(r), 3) for w, r in ratios.items()}
