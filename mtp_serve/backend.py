"""Pick the fastest MLX path on this machine, before mlx.core is first imported.

On Linux the `mlx[cpu]` wheel links a slow reference BLAS. Loading Debian's
OpenBLAS (libopenblas0-pthread) with RTLD_GLOBAL before mlx.core is imported
makes its sgemm win symbol resolution: fp32 matmuls run ~50x faster (SPEC.md
section 4). fp32 is therefore the compute dtype on CPU.
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from . import skinny_gemm

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


@dataclass(frozen=True)
class Backend:
    device: str  # "gpu" or "cpu"
    blas: str  # path of the preloaded BLAS, "" when none
    note: str  # one line for start-up logs

    @property
    def compute_dtype(self) -> str:
        # bf16 and quantized matmuls are slow on CPU, and MoE gather_mm on CPU
        # supports float32 only: compute in fp32 there.
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def exact_windows(self) -> bool:
        """Every kernel of a verify window gives a position the bits of a single step, so greedy
        MTP output is plain decoding's token for token. On CPU mtp-serve's kernels make it so.
        MLX's CUDA kernels do not (MLX 0.32.4 on an H200, measured: `GPU_WINDOWS_NOTE`)."""
        return self.device == "cpu"


GPU_WINDOWS_NOTE = (
    "on MLX's GPU backend a verify window is not bit for bit T single steps: on CUDA, causal "
    "attention over several queries, unquantized matmuls of 2+ rows (cuBLAS) and quantized ones of 8+ "
    "rows round differently, so greedy MTP output can leave plain decoding's at near-ties "
    "(docs/quantized.md, \"MLX's CUDA backend\")"
)


_OPENBLAS: ctypes.CDLL | None = None

AVX512_CORE = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def openblas_coretype(flags: frozenset) -> str | None:
    """The OpenBLAS kernels (OPENBLAS_CORETYPE) for a CPU with these feature flags, or None to let
    OpenBLAS choose. OpenBLAS picks its kernels from a table of CPU models, and a model newer than
    its release falls back to SSE3 ("Prescott"): Debian's 0.3.21 does so on this project's Sapphire
    Rapids machines (CPU model 207), where a 1024 x 3584 x 1024 sgemm then takes 3-9x as long as on
    its AVX-512 kernels (docs/architecture.md, "The CPU kernels"). The choice goes by features
    instead: "SkylakeX" (the AVX-512 sgemm OpenBLAS itself uses on the AVX-512 CPUs it knows),
    "Haswell" (AVX2 and FMA)."""
    if AVX512_CORE <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def openblas_corename() -> str:
    """The kernels the preloaded OpenBLAS runs ("" when none is loaded)."""
    if _OPENBLAS is None or not hasattr(_OPENBLAS, "openblas_get_corename"):
        return ""
    _OPENBLAS.openblas_get_corename.restype = ctypes.c_char_p
    return (_OPENBLAS.openblas_get_corename() or b"").decode()


def _preload_openblas() -> str:
    global _OPENBLAS
    if sys.platform != "linux" or os.environ.get("MTP_SERVE_NO_OPENBLAS") == "1":
        return ""
    paths = [os.environ["MTP_SERVE_OPENBLAS"]] if os.environ.get("MTP_SERVE_OPENBLAS") else []
    core = openblas_coretype(skinny_gemm.cpu_flags())
    if core and not os.environ.get("OPENBLAS_CORETYPE"):  # read by OpenBLAS as it loads; the user's setting wins
        os.environ["OPENBLAS_CORETYPE"] = core
    for path in paths + list(OPENBLAS_CANDIDATES):
        if os.path.exists(path):
            shim = skinny_gemm.load_before_openblas()  # first in the global scope: MLX's sgemm calls reach it
            try:
                _OPENBLAS = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            if shim is not None:
                skinny_gemm.attach_fallback(shim, _OPENBLAS)
            return path
    return ""


# Matmuls with at most this many rows (decode steps, verify windows, drafts) run
# on `_decode_threads` OpenBLAS threads, larger ones (prefill) on every core.
# Which is faster for decode depends on the model: a small model's matrices sit
# in cache and one thread avoids the idle worker's spin-wait taking the core the
# MLX and Python threads need (demo model: 7-9 ms a step on one thread, 9-15 ms
# on two), while a large model's decode is bandwidth-bound and two threads read
# its weights faster (a [1024 x 6144] fp32 matvec: 3.2 ms on one, 1.5 ms on two).
# `engine.warmup.calibrate_blas_threads` measures it for the loaded model.
SMALL_MATMUL_ROWS = 64
_decode_threads: int | None = None  # None: every core, as OpenBLAS does by default
_blas_threads: int | None = None


def set_blas_threads(n: int | None) -> None:
    """OpenBLAS threads for the matmuls that follow (None: every core). A no-op
    without the preloaded OpenBLAS, or when OPENBLAS_NUM_THREADS was set by the user."""
    global _blas_threads
    if not blas_threads_adjustable():
        return
    n = n or os.cpu_count() or 1
    if n != _blas_threads:
        _OPENBLAS.openblas_set_num_threads(n)
        skinny_gemm.set_threads(n)
        from . import quantized_matmul  # here, not at the top: it imports mlx.core (after OpenBLAS's preload)

        quantized_matmul.set_threads(n)
        _blas_threads = n


@contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """OpenBLAS on `n` threads inside the block (None: leave it as it is), then as before."""
    before = _blas_threads
    if n is not None:
        set_blas_threads(n)
    try:
        yield
    finally:
        if n is not None:
            set_blas_threads(before)


def openblas_loaded() -> bool:
    """OpenBLAS was preloaded: MLX's fp32 matmuls run on it (and on the skinny sgemm shim in front)."""
    return _OPENBLAS is not None


def blas_threads_adjustable() -> bool:
    return _OPENBLAS is not None and not os.environ.get("OPENBLAS_NUM_THREADS") and (os.cpu_count() or 1) > 1


def set_decode_blas_threads(n: int | None) -> None:
    """Threads for decode-sized matmuls from now on (None: every core)."""
    global _decode_threads
    _decode_threads = n


def blas_threads_for(rows: int) -> None:
    """Pick OpenBLAS's thread count for a forward over `rows` tokens."""
    set_blas_threads(_decode_threads if rows <= SMALL_MATMUL_ROWS else None)


_BACKEND: Backend | None = None


def setup_backend() -> Backend:
    """Idempotent; must run before the first `import mlx.core` to take effect."""
    global _BACKEND
    if _BACKEND is not None:
        return _BACKEND
    mlx_already_loaded = "mlx.core" in sys.modules
    blas = "" if mlx_already_loaded else _preload_openblas()
    import mlx.core as mx

    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    if device == "gpu":
        note = "MLX GPU backend, bf16 compute"
    elif blas:
        note = f"MLX CPU backend, fp32 compute, OpenBLAS preloaded from {blas} ({openblas_corename()} kernels)"
        if skinny_gemm.active():
            note += " (decode-sized products on weights of 4 MB or more: mtp-serve's skinny sgemm"
            if skinny_gemm.row_invariant():
                note += "; smaller ones of up to 64 rows: its row-invariant kernel"
            note += ")"
    elif mlx_already_loaded:
        note = "MLX CPU backend, fp32 compute, reference BLAS (mlx.core was imported before mtp_serve: OpenBLAS not preloaded)"
    else:
        note = (
            "MLX CPU backend, fp32 compute, reference BLAS (slow: install Debian's "
            "libopenblas0-pthread or set MTP_SERVE_OPENBLAS)"
        )
    _BACKEND = Backend(device=device, blas=blas, note=note)
    return _BACKEND
