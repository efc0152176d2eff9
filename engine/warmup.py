"""Before serving: run every decode path once, so the first request does not pay
for building compiled kernels (MLX JIT-compiles fused CPU kernels on first use
and caches them on disk: seconds on the first run on a machine, nothing after);
and measure how decode-sized matmuls should run for this model (threads, skinny sgemm)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from mtp_serve import quantized_matmul, skinny_gemm
from mtp_serve.backend import blas_threads_adjustable, set_decode_blas_threads
from mtp_serve.models.mtp_model import MTPModel
from mtp_serve.models.quantized_layers import KERNEL_LAYERS

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


def calibrate_blas_threads(model: MTPModel, tokenizer, depth: int = 0, steps: int = 6, rounds: int = 3,
                           slow_step_s: float = 0.05) -> Optional[int]:
    """Time decode rounds at `depth` (the round the server runs; 0: plain steps) under
    each way of computing decode-sized matmuls: OpenBLAS on one thread or on every
    core, each with and without mtp-serve's skinny sgemm (`skinny_gemm.py`; only for a
    model with weights large enough for it to take), and keep the fastest. Which wins depends on the model and the round: on the demo model
    (matrices in cache) OpenBLAS on every core decoded at depth 4 1.35x faster than on
    one thread, a choice plain steps alone had made (bench/bench_decode_matmuls.py). A
    model whose round takes longer than `slow_step_s` is bandwidth-bound and keeps
    every core and the skinny sgemm without measuring (it streams weights ~2x faster
    there: docs/architecture.md, "The CPU kernels").
    Quantized layers on mtp-serve's kernel (`quantized_matmul.py`) share the thread count;
    a model with such layers is timed whatever its step takes: that kernel unpacks
    weights in arithmetic, so one thread can beat two on a busy machine.
    Returns the thread choice (None: every core); `skinny_gemm.enabled()` tells the other."""
    depth = depth if model.has_mtp else 0
    batch = Batch()
    batch.add(_prefilled(model, tokenizer, [1, 2, 3, 4, 5, 6, 7, 8], depth))
    step = lambda: run_round(model, batch, [depth])  # noqa: E731
    skinny_options = (True, False) if skinny_gemm.active() and _has_skinny_sized_weights(model) else (False,)
    choices = [(n, skinny) for skinny in skinny_options for n in ((1, None) if blas_threads_adjustable() else (None,))]
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    quantized = _has_kernel_quantized_layers(model)
    if quantized:  # the quantized kernel is partly compute-bound: time its thread counts, in ~2 s per choice
        steps = max(1, min(steps, int(2.0 / (rounds * max(first, 1e-3)))))
    if first > slow_step_s and not quantized:
        choice = (None, skinny_options[0])
    elif len(choices) == 1:
        choice = choices[0]
    else:
        best: dict = {}
        for _ in range(rounds):  # alternating, so a noisy moment does not decide alone
            for c in choices:
                _use(c)
                step()  # the switch itself
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                best[c] = min(best.get(c, float("inf")), time.perf_counter() - t0)
        choice = min(best, key=best.get)
    _use(choice)
    return choice[0]


def kernel_cache_files() -> int:
    """Fused CPU kernels in MLX's on-disk cache ($TMPDIR/mlx/<version>/cpu), for start-up logs:
    how many a warm-up had to compile. 0 when the folder is not there (other backends)."""
    folder = Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"
    try:
        return sum(1 for f in folder.iterdir() if f.suffix == ".so")
    except OSError:
        return 0


def decode_matmuls_note(threads: Optional[int]) -> str:
    """The calibrated choice, for start-up logs and benchmark headers."""
    how = "OpenBLAS, mtp-serve's skinny sgemm for weights of 4 MB or more" if skinny_gemm.enabled() else "OpenBLAS"
    if quantized_matmul.active():
        how += "; quantized weights, GatedDeltaNet steps and activations: mtp-serve's native kernels"
    return f"decode matmuls: {how} on {threads or 'all'} thread(s)"


def _has_kernel_quantized_layers(model: MTPModel) -> bool:
    """Whether the model's quantized layers run on mtp-serve's quantized kernel."""
    modules = [model.model] + ([model.head] if model.has_mtp else [])
    return quantized_matmul.active() and any(type(m) in KERNEL_LAYERS for root in modules for _, m in root.named_modules())


def _has_skinny_sized_weights(model: MTPModel) -> bool:
    """Whether any fp32 weight matrix is large enough for the skinny sgemm to take its
    products; without one, both settings compute alike and need not be timed."""
    modules = [model.model] + ([model.head] if model.has_mtp else [])
    return any(w.ndim == 2 and w.dtype == mx.float32 and w.size >= skinny_gemm.DEFAULT_MIN_ELEMENTS
               for m in modules for _, w in tree_flatten(m.parameters()))


def _use(choice: tuple) -> None:
    threads, skinny = choice
    set_decode_blas_threads(threads)
    skinny_gemm.set_enabled(skinny)
