"""Build and load `native/quantized_matmul.cpp`: MLX custom primitives computing
decode-sized quantized matmuls on CPU (see the C++ file for how and why).

MLX 0.32's CPU `mx.quantized_matmul` costs 4-10x an fp32 matmul of the same shape
and grows linearly with the rows (SPEC section 6); this kernel reads each packed
weight once for all rows. Built at first use with the system cmake and g++ against
the installed MLX wheel and nanobind, into the user's cache (~/.cache/mtp-serve,
keyed by the sources and the versions of MLX, nanobind and Python), like the
skinny sgemm; `install.sh` builds it ahead (`python3 -m mtp_serve.quantized_matmul`).
Skipped (MLX's own kernel computes, as before) on CPUs without AVX2/FMA/F16C,
without cmake/g++/nanobind, off the CPU device, or with MTP_SERVE_NO_QMM=1;
`status()` says which, once, for the start-up log.

Two numerics (`set_numerics`, `--quantized-matmul` on mtp-serve and mtp-tune, or
MTP_SERVE_QUANTIZED_MATMUL): "exact" computes the dequantized product in fp32
(MLX's product up to summation order); "int8" quantizes each row of x to int8 per 32
values (llama.cpp's Q8_0 scheme) and sums in integers, W's rows in vector lanes and each
block of W unpacked once for every row of x (4 and 8 bits, 2 bits stay exact; the
extension's set_int8_group(False) keeps the earlier per-row form for benchmarks),
cheaper per row but x loses precision; `qmm_lanes` runs that form on weights repacked once
at load (`to_lanes`: no per-call transpose or unpacking, the same bits). Both give each row the same
bits whatever the rows beside it. Set it before the model's first step: compiled
steps keep the numerics they traced.

The default is int8 where every other decode-sized fp32 product gives a row the same
bits at any row count, exact elsewhere (`default_numerics`). int8 is 1.4-2.3x faster in
the kernel at 0.8B shapes, but it rounds x: a ~1e-7 difference between a verify window
and T single steps anywhere else becomes a flipped int8 step, ~1e-2 in the logits, and
greedy MTP leaves plain decoding's tokens. The preloaded OpenBLAS gave a small product's
row (attention's q.k and p.v) different bits at 1 row and at 4; the skinny sgemm shim
now takes those products on a row-invariant kernel (`skinny_gemm.row_invariant`), and
MLX's own sgemm (no OpenBLAS) is row-invariant, so int8 MTP is token-identical to int8
plain on every family (tests/test_quantized_matmul.py). With OpenBLAS but no
shim (MTP_SERVE_NO_SKINNY_GEMM=1, MTP_SERVE_NO_ROW_INVARIANT=1, a CPU without AVX2) the
default stays exact.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import reduce
from pathlib import Path
from types import ModuleType
from typing import Optional, Tuple

import mlx.core as mx

from .skinny_gemm import _cache_dir, _cpu_has_avx2_fma

NATIVE = Path(__file__).parent / "native"
SOURCES = (NATIVE / "quantized_matmul.cpp", NATIVE / "quantized_attention.cpp", NATIVE / "gated_delta.cpp",
           NATIVE / "activations.cpp", NATIVE / "qmm_common.h", NATIVE / "qmm_int8.inc", NATIVE / "qmm_group.inc",
           NATIVE / "qmm_lanes.inc", NATIVE / "qmm_amx.inc", NATIVE / "CMakeLists.txt")
MODULE = "_mtp_qmm"
SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
NUMERICS = ("exact", "int8")

log = logging.getLogger("mtp_serve.quantized_matmul")

_EXT: Optional[ModuleType] = None
_STATUS: Optional[str] = None  # None: not tried yet
_threads: Optional[int] = None
_numerics: Optional[str] = None  # None: the environment's, else default_numerics()


def _key() -> str:
    import nanobind

    h = hashlib.sha256()
    for path in SOURCES:
        h.update(path.read_bytes())
    h.update(f"{mx.__version__} {nanobind.__version__} {sys.version_info[:2]} {sys.platform}".encode())
    return h.hexdigest()[:16]


def _cmake_args(build: Path) -> list:
    import nanobind

    import mlx

    mlx_cmake = Path(mlx.__path__[0]) / "share" / "cmake" / "MLX"
    return ["cmake", "-S", str(NATIVE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            f"-DMLX_DIR={mlx_cmake}", f"-Dnanobind_DIR={nanobind.cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}"]


def _build() -> Tuple[Optional[Path], str]:
    """The built extension's path (building it if needed), or None and why not."""
    try:
        import nanobind  # noqa: F401
    except ImportError:
        return None, "nanobind is not installed (pip install nanobind)"
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if missing:
        return None, f"{' and '.join(missing)} not found (install.sh installs them)"
    key, last = _key(), ""
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "mtp-serve"):
        target = folder / f"qmm-{key}" / f"{MODULE}.so"
        if target.exists():
            return target, ""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.parent / "build.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others wait and load it
                if target.exists():
                    return target, ""
                log.warning("building mtp-serve's quantized matmul kernel into %s (once per version, about a minute)",
                            target.parent)
                with tempfile.TemporaryDirectory(dir=target.parent) as build:
                    subprocess.run(_cmake_args(Path(build)), check=True, capture_output=True, timeout=600)
                    subprocess.run(["cmake", "--build", build, "-j", str(os.cpu_count() or 1)], check=True,
                                   capture_output=True, timeout=1200)
                    built = next(Path(build).glob(f"{MODULE}*.so"))
                    os.replace(built, target)  # atomic: nobody loads a half-written file
                return target, ""
        except subprocess.CalledProcessError as e:
            tail = (e.stderr or e.stdout or b"").decode(errors="replace").strip().splitlines()[-3:]
            return None, "build failed: " + " | ".join(tail)
        except (OSError, subprocess.SubprocessError, StopIteration) as e:
            last = f"build failed: {type(e).__name__}: {e}"
            continue
    return None, last


def load() -> Optional[ModuleType]:
    """The extension (built at first call), or None when it cannot be used here."""
    global _EXT, _STATUS
    if _STATUS is not None:
        return _EXT
    why = ""
    if os.environ.get("MTP_SERVE_NO_QMM") == "1":
        why = "disabled by MTP_SERVE_NO_QMM=1"
    elif not _cpu_has_avx2_fma():
        why = "this CPU lacks AVX2/FMA"
    elif mx.default_device() != mx.cpu:
        why = "MLX runs on the GPU here"
    if not why:
        path, why = _build()
        if path is not None:
            try:
                spec = importlib.util.spec_from_file_location(MODULE, path)
                ext = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(ext)
                if ext.cpu_supported():
                    _EXT = ext
                    if os.environ.get("MTP_SERVE_NO_VNNI") == "1":
                        ext.set_vnni(False)  # the AVX2 form (the same bits, slower 8-bit windows)
                    # windows of 2+ rows on AMX tiles where the CPU has them (the same bits)
                    ext.set_amx(os.environ.get("MTP_SERVE_NO_AMX") != "1")
                    if os.environ.get("MTP_SERVE_NO_AVX_VNNI") == "1":
                        ext.set_avx_vnni(False)  # AVX2's maddubs/madd instead of AVX-VNNI (the same bits)
                    user = os.environ.get("OPENBLAS_NUM_THREADS", "")
                    ext.set_threads(_threads or (int(user) if user.isdigit() else os.cpu_count() or 1))
                else:
                    why = "this CPU lacks AVX2/FMA/F16C"
            except (ImportError, OSError) as e:
                why = f"cannot load {path}: {e}"
    if _EXT is not None:
        _STATUS = _kernel_line()
    else:
        _STATUS = f"quantized matmuls: MLX's kernel (mtp-serve's decode kernel off: {why})"
        log.warning("%s", _STATUS)
    return _EXT


def status() -> str:
    """One line for start-up logs (loads the extension if not tried yet)."""
    load()
    if _EXT is not None:  # the numerics may have been set after loading
        return _kernel_line() + _why_numerics()
    return _STATUS or ""


def _kernel_line() -> str:
    vnni = ""
    if numerics() == "int8":
        vnni = " on AVX-512 VNNI" if _EXT.vnni() else " on AVX-VNNI" if _EXT.avx_vnni() else ""
        if _EXT.vnni() and _EXT.amx():
            vnni += " (windows on AMX)"
    return f"quantized decode matmuls (up to 64 rows): mtp-serve's kernel, {numerics()} numerics{vnni}"


def _why_numerics() -> str:
    if _numerics is not None or os.environ.get("MTP_SERVE_QUANTIZED_MATMUL"):
        return ""
    if default_numerics() == "int8":
        return " (the default: the other decode products are row-invariant, so greedy MTP = plain)"
    return " (the default here: OpenBLAS computes the small products, int8 would let MTP leave plain's tokens)"


def numerics() -> str:
    """"exact" or "int8": how the kernel computes (set_numerics, else MTP_SERVE_QUANTIZED_MATMUL, else the default)."""
    if _numerics is not None:
        return _numerics
    env = os.environ.get("MTP_SERVE_QUANTIZED_MATMUL", "").strip().lower()
    if env and env not in NUMERICS:
        raise ValueError(f"MTP_SERVE_QUANTIZED_MATMUL={env!r}: expected one of {', '.join(NUMERICS)}")
    return env or default_numerics()


def default_numerics() -> str:
    """int8 where a verify window's fp32 products give each row a single step's bits (the
    shim's row-invariant small products, or no OpenBLAS at all), else exact (see the note above)."""
    from . import backend, skinny_gemm

    return "int8" if skinny_gemm.row_invariant() or not backend.openblas_loaded() else "exact"


def set_numerics(mode: Optional[str]) -> None:
    """Choose the kernel's numerics (None: back to the environment's or default_numerics())."""
    global _numerics
    if mode is not None and mode not in NUMERICS:
        raise ValueError(f"quantized matmul numerics {mode!r}: expected one of {', '.join(NUMERICS)}")
    _numerics = mode


def active() -> bool:
    return _EXT is not None


def set_threads(n: int) -> None:
    """Threads for the kernel (the same knob as the skinny sgemm's: backend.set_blas_threads)."""
    global _threads
    _threads = n
    if _EXT is not None:
        _EXT.set_threads(n)


def calls() -> int:
    """Products the kernel has computed in this process (tests check it is on the path)."""
    return _EXT.calls() if _EXT is not None else 0


def seconds() -> float:
    """Seconds spent inside the kernel in this process (benchmarks: its share of a step)."""
    return _EXT.seconds() if _EXT is not None else 0.0


def supports(bits: int, group_size: int, mode: str, K: int, scales_dtype: mx.Dtype) -> bool:
    """The kernel can compute this layer's products (when loaded)."""
    return (
        _EXT is not None
        and mode == "affine"
        and bits in SUPPORTED_BITS
        and group_size in SUPPORTED_GROUP_SIZES
        and K % (8 * 32 // bits) == 0
        and K % group_size == 0
        and scales_dtype in (mx.float32, mx.bfloat16, mx.float16)
    )


def _rows(shape) -> int:
    return reduce(lambda a, b: a * b, shape, 1)


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)` on the kernel: x [..., K]."""
    y = _EXT.qmm_rows(x if x.dtype == mx.float32 else x.astype(mx.float32), w, scales, biases, group_size, bits,
                      numerics() == "int8")
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def qmm_multi(x: mx.array, weights: list, group_size: int, bits: int) -> list:
    """`qmm` of one x against several (w, scales, biases) of one K, group size, bits and scale
    dtype: one node and one dispatch to the threads, each result the bits of its own `qmm`."""
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    ys = _EXT.qmm_rows_multi(xf, [tuple(t) for t in weights], group_size, bits, numerics() == "int8")
    return ys if x.dtype == mx.float32 else [y.astype(x.dtype) for y in ys]


# Rows of W a block of the lane layout (the AVX-512 form's vector lanes).
LANES = 16


def lanes_supported(bits: int) -> bool:
    """Weights of these bits can be repacked to the lane layout (int8 numerics' group form)."""
    return _EXT is not None and hasattr(_EXT, "qmm_lanes") and bits in (4, 8)


def to_lanes(a: mx.array) -> mx.array:
    """[N, C] (a packed weight's uint32 words, or its scales or biases) -> [ceil(N/16), C, 16]: per block
    of 16 rows, column c of each row side by side; the last block padded with copies of row N-1."""
    N, C = a.shape
    pad = -N % LANES
    if pad:
        a = mx.concatenate([a, mx.broadcast_to(a[N - 1:N], (pad, C))], axis=0)
    return mx.contiguous(a.reshape(-1, LANES, C).transpose(0, 2, 1))


def from_lanes(a: mx.array, n0: int, n1: int) -> mx.array:
    """Rows [n0, n1) of the original [N, C] array from its lane layout (a copy of those rows only)."""
    b0, b1 = n0 // LANES, -(-n1 // LANES)
    rows = a[b0:b1].transpose(0, 2, 1).reshape(-1, a.shape[1])
    return rows[n0 - b0 * LANES:n1 - b0 * LANES]


def take_lanes(a: mx.array, ids: mx.array) -> mx.array:
    """Rows `ids` (any shape) of the original [N, C] array from its lane layout -> [*ids.shape, C]."""
    C = a.shape[1]
    flat = ids.reshape(-1, 1).astype(mx.uint32)
    # element (r, c) sits at (r // 16) * C * 16 + c * 16 + r % 16: one index per element taken
    at = (flat // LANES) * (C * LANES) + flat % LANES + mx.arange(0, C * LANES, LANES, dtype=mx.uint32)
    return mx.take(a.reshape(-1), at).reshape(*ids.shape, C)


def qmm_lanes(x: mx.array, weights: list, group_size: int, bits: int) -> list:
    """`qmm` (int8 numerics) of one x against weights in the lane layout, each (w, scales, biases, N) as
    `to_lanes` made them: one node, each row the bits the group form gives it on the original layout."""
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    ys = _EXT.qmm_lanes(xf, [tuple(t) for t in weights], group_size, bits)
    return ys if x.dtype == mx.float32 else [y.astype(x.dtype) for y in ys]


def gather_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, indices: mx.array,
               group_size: int, bits: int) -> mx.array:
    """`mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, ...)` on the kernel:
    x [..., M, K], w [E, N, K*bits/32], indices broadcastable with x's batch dimensions."""
    *xbatch, M, K = x.shape
    batch = tuple(_broadcast_shapes(tuple(xbatch), tuple(indices.shape)))
    pairs = _rows(batch)
    xb = mx.broadcast_to(x, (*batch, M, K)).reshape(pairs * M, K)
    if xb.dtype != mx.float32:
        xb = xb.astype(mx.float32)
    ib = mx.broadcast_to(indices, batch).reshape(pairs)
    y = _EXT.gather_qmm_rows(xb, w, scales, biases, ib, M, group_size, bits, numerics() == "int8")
    y = y.reshape(*batch, M, w.shape[1])
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def _broadcast_shapes(a: tuple, b: tuple) -> list:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for p, q in zip(a, b):
        if p != q and 1 not in (p, q):
            raise ValueError(f"gather_qmm: shapes {a} and {b} do not broadcast")
        out.append(max(p, q))
    return out


if __name__ == "__main__":  # install.sh: build ahead of the first start
    import mtp_serve  # noqa: F401  (backend set-up first, as at run time)

    print(status())
    sys.exit(0 if active() else 1)
