"""Run every decode path once before serving, so the first request does not pay
for building compiled kernels (MLX JIT-compiles fused CPU kernels on first use
and caches them on disk: seconds on the first run on a machine, nothing after)."""

from __future__ import annotations

import time

from mtp_serve.models.mtp_model import MTPModel

from .batch import Batch
from .sampling import SamplingParams
from .sequence import new_sequence
from .speculative import batched_round, mtp_round, plain_step, prefill


def warm_up(model: MTPModel, depth: int, rounds: int = 2) -> float:
    """Plain steps, single-sequence MTP rounds and batched rounds (plain and
    drafting) on a short dummy prompt; returns the seconds it took."""
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    depth = depth if model.has_mtp else 0
    seqs = []
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]):
        seq = new_sequence(model, prompt, params, depth)
        prefill(model, seq)
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
