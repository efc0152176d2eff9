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
from .sampling import SamplingParams
from .sequence import new_sequence
from .speculative import batched_round, mtp_round, plain_step, prefill


def _prefilled(model: MTPModel, prompt: list, depth: int):
    """A dummy request, prefilled, that decodes for as long as it is stepped."""
    seq = new_sequence(model, prompt, SamplingParams(max_tokens=1 << 20, ignore_eos=True), depth)
    prefill(model, seq)
    return seq


def warm_up(model: MTPModel, depth: int, rounds: int = 2) -> float:
    """Plain steps, single-sequence MTP rounds and batched rounds (plain and
    drafting) on a short dummy prompt; returns the seconds it took."""
    t0 = time.perf_counter()
    depth = depth if model.has_mtp else 0
    seqs = []
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]):
        seq = _prefilled(model, prompt, depth)
        for _ in range(rounds):
            plain_step(model, seq)
            if depth:
                mtp_round(model, seq)
        seqs.append(seq)
    batch = Batch(seqs)
    for _ in range(rounds):
        for K in sorted({0, depth}):
            batched_round(model, batch, K)
    return time.perf_counter() - t0


def calibrate_blas_threads(model: MTPModel, steps: int = 6, rounds: int = 3, slow_step_s: float = 0.05) -> Optional[int]:
    """Time plain decode steps with OpenBLAS on one thread and on every core, and
    keep the faster for decode-sized matmuls. A model whose step takes longer than
    `slow_step_s` is bandwidth-bound and keeps every core without measuring.
    Returns the choice (None: every core)."""
    if not blas_threads_adjustable():
        return None
    seq = _prefilled(model, [1, 2, 3, 4, 5, 6, 7, 8], 0)
    t0 = time.perf_counter()
    plain_step(model, seq)
    if time.perf_counter() - t0 > slow_step_s:
        set_decode_blas_threads(None)
        return None
    best: dict = {}
    for _ in range(rounds):  # alternating, so a noisy moment does not decide alone
        for n in (1, None):
            set_decode_blas_threads(n)
            plain_step(model, seq)  # the switch itself
            t0 = time.perf_counter()
            for _ in range(steps):
                plain_step(model, seq)
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t0)
    choice = min(best, key=best.get)
    set_decode_blas_threads(choice)
    return choice
