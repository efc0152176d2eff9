"""Build and load `native/skinny_sgemm.c`: a `cblas_sgemm` that takes decode steps' and
verify windows' products (at most 64 rows) off OpenBLAS onto a row-invariant kernel, which
gives a row the same bits whatever the rows beside it (see the C file for why).

Built once per source version with the system C compiler into the user's cache
(~/.cache/mtp-serve), like MLX's own compiled kernels, and loaded with
RTLD_GLOBAL before OpenBLAS so that MLX's `cblas_sgemm` calls reach it first.
Skipped (OpenBLAS alone, as before) on CPUs without AVX2 and FMA, without a C
compiler, or with MTP_SERVE_NO_SKINNY_GEMM=1.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).parent / "native" / "skinny_sgemm.c"

_LIB: Optional[ctypes.CDLL] = None

# Weights smaller than this (4 MB in fp32) sit in cache, where streaming speed does not
# matter and OpenBLAS's gemm kernels won (demo model: depth-4 MTP 1.2x faster on OpenBLAS,
# bench/bench_decode_matmuls.py); larger ones are bandwidth-bound, where this sgemm wins.
DEFAULT_MIN_ELEMENTS = 1 << 20


def cpu_flags() -> frozenset:
    """The x86-64 CPU's feature flags as Linux lists them (empty elsewhere)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        return frozenset(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mtp-serve"


def _build() -> Optional[Path]:
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    name = f"skinny_sgemm-{hashlib.sha256(source).hexdigest()[:16]}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "mtp-serve"):
        target = folder / name
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f"{name}.{os.getpid()}.tmp"
            subprocess.run([compiler, "-O3", "-funroll-loops", "-fPIC", "-shared", "-pthread", str(SOURCE),
                            "-o", str(partial), "-ldl"], check=True, capture_output=True, timeout=120)
            os.replace(partial, target)  # atomic: concurrent processes never load a half-written file
            return target
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def load_before_openblas() -> Optional[ctypes.CDLL]:
    """Load the shim into the global symbol scope (call before OpenBLAS is loaded); None when skipped."""
    global _LIB
    if _LIB is not None:
        return _LIB
    if os.environ.get("MTP_SERVE_NO_SKINNY_GEMM") == "1" or not _cpu_has_avx2_fma():
        return None
    path = _build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    if not lib.mtp_skinny_supported():
        return None
    lib.mtp_skinny_set_threads.argtypes = [ctypes.c_int]
    lib.mtp_skinny_set_min.argtypes = [ctypes.c_long]
    lib.mtp_skinny_calls.restype = ctypes.c_long
    lib.mtp_skinny_small_calls.restype = ctypes.c_long
    lib.mtp_skinny_set_small.argtypes = [ctypes.c_int, ctypes.c_long]
    lib.mtp_skinny_set_wide.argtypes = [ctypes.c_int]
    lib.mtp_skinny_set_max_rows.argtypes = [ctypes.c_int]
    lib.mtp_skinny_peak_fma.argtypes = [ctypes.c_long]
    lib.mtp_skinny_peak_fma.restype = ctypes.c_double
    lib.mtp_skinny_set_small(os.environ.get("MTP_SERVE_NO_ROW_INVARIANT") != "1", DEFAULT_MIN_ELEMENTS)
    lib.mtp_skinny_set_min(DEFAULT_MIN_ELEMENTS)
    user_threads = os.environ.get("OPENBLAS_NUM_THREADS", "")
    lib.mtp_skinny_set_threads(int(user_threads) if user_threads.isdigit() else os.cpu_count() or 1)
    _LIB = lib
    return lib


def attach_fallback(lib: ctypes.CDLL, openblas: ctypes.CDLL) -> None:
    """Products the shim does not take go to OpenBLAS's own cblas_sgemm."""
    lib.mtp_skinny_set_fallback(ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p))


def active() -> bool:
    """Loaded (it can take decode-sized products)."""
    return _LIB is not None


_enabled = True


def set_enabled(on: bool, min_elements: int = DEFAULT_MIN_ELEMENTS) -> None:
    """On: products of at most 64 rows whose W has `min_elements` or more (0: all of
    them, as tests and benchmarks use it); off: every product goes to OpenBLAS."""
    global _enabled
    if _LIB is not None:
        _LIB.mtp_skinny_set_min(min_elements if on else 1 << 62)
        _enabled = on


def enabled() -> bool:
    return _LIB is not None and _enabled


def set_threads(n: int) -> None:
    if _LIB is not None:
        _LIB.mtp_skinny_set_threads(n)


def calls() -> int:
    """Products the shim has computed in this process (tests check it is on the path)."""
    return _LIB.mtp_skinny_calls() if _LIB is not None else 0


def set_row_invariant(on: bool) -> None:
    """On (the default): products of at most 64 rows whose W is under 4 MB (the skinny threshold)
    (attention's q.k and p.v, small weights) run on the shim's row-invariant kernel, which gives
    a row the same bits whatever the rows beside it; off: OpenBLAS computes them."""
    if _LIB is not None:
        _LIB.mtp_skinny_set_small(int(on), DEFAULT_MIN_ELEMENTS)


def row_invariant() -> bool:
    """Every decode-sized fp32 product gives a row the same bits at any row count: with the shim,
    or without OpenBLAS (MLX's own sgemm is row-invariant). False: OpenBLAS takes the small ones."""
    return _LIB is not None and bool(_LIB.mtp_skinny_small_on())


def set_wide_rows(min_rows: int) -> bool:
    """Products of `min_rows` rows or more on the AVX-512 form (0: never; tests compare the forms
    bit for bit). Returns whether this CPU has it."""
    return bool(_LIB.mtp_skinny_set_wide(min_rows)) if _LIB is not None else False


def set_max_rows(rows: int = 64) -> None:
    """Large products of at most `rows` rows on the shim, more on OpenBLAS (benchmarks: 8 is how
    verify windows past 8 tokens were computed before the shim took windows of up to 64)."""
    if _LIB is not None:
        _LIB.mtp_skinny_set_max_rows(rows)


def peak_fma(iters: int) -> float:
    """Multiply-adds per second the calling thread issues in `iters` rounds of independent FMA chains
    in registers, on the widest form the kernels use (benchmarks' arithmetic ceiling); nan unloaded.
    Releases the GIL (ctypes): threads calling it at once measure every core."""
    return _LIB.mtp_skinny_peak_fma(iters) if _LIB is not None else float("nan")


def small_calls() -> int:
    """Small products the row-invariant kernel has computed in this process."""
    return _LIB.mtp_skinny_small_calls() if _LIB is not None else 0
