"""Before serving: run every decode path once, so the first request does not pay
for building compiled kernels (MLX JIT-compiles fused CPU kernels on first use
and caches them on disk: seconds on the first run on a machine, nothing after);
and measure how many OpenBLAS threads decode should use for this model."""

from __future__ import annotations

import time
from typing import Optional

from mtp_serve.backend import blas_threads_adjustable, set_decode_blas_threads
from mtp_serve.models.mtp_model import MTPModel

from .batch import Batch
from .prefill import prefill
from .sampling import SamplingParams
from .sequence import Sequence, new_sequence
from .speculative import run_round


def _prefilled(model: MTPModel, tokenizer, prompt: list, depth: int) -> Sequence:
    """A dummy request, prefilled, that decodes for as long as it is stepped."""
    seq = new_sequence(model, tokenizer, ("warm-up", len(prompt)), prompt, SamplingParams(max_tokens=1 << 20, ignore_eos=True), depth)
    prefill(model, seq)
    return seq


def warm_up(model: MTPModel, tokenizer, depth: int, rounds: int = 2) -> float:
    """Rounds at every depth up to `depth`, for one row and then for a batch of
    two, on short dummy prompts; returns the seconds it took."""
    t0 = time.perf_counter()
    depth = depth if model.has_mtp else 0
    batch = Batch()
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]):
        batch.add(_prefilled(model, tokenizer, prompt, depth))
        for _ in range(rounds):
            for K in range(depth + 1):
                run_round(model, batch, [K] * len(batch))
    return time.perf_counter() - t0


def calibrate_blas_threads(model: MTPModel, tokenizer, steps: int = 6, rounds: int = 3, slow_step_s: float = 0.05) -> Optional[int]:
    """Time plain decode steps with OpenBLAS on one thread and on every core, and
    keep the faster for decode-sized matmuls. A model whose step takes longer than
    `slow_step_s` is bandwidth-bound and keeps every core without measuring.
    Returns the choice (None: every core)."""
    if not blas_threads_adjustable():
        return None
    batch = Batch()
    batch.add(_prefilled(model, tokenizer, [1, 2, 3, 4, 5, 6, 7, 8], 0))
    step = lambda: run_round(model, batch, [0])  # noqa: E731
    t0 = time.perf_counter()
    step()
    if time.perf_counter() - t0 > slow_step_s:
        set_decode_blas_threads(None)
        return None
    best: dict = {}
    for _ in range(rounds):  # alternating, so a noisy moment does not decide alone
        for n in (1, None):
            set_decode_blas_threads(n)
            step()  # the switch itself
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t0)
    choice = min(best, key=best.get)
    set_decode_blas_threads(choice)
    return choice
