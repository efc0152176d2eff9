"""Benchmark-harness-only shim that lets MTPLX (PyPI `mtplx`) import on Linux.

MTPLX is the peer `bench/bench_speed.py` compares against. Nothing of it goes
into the product and it is not a dependency of this package: install it by
hand (`pip install --no-deps mtplx`; see bench_speed.py) to get its row.

On import, `mtplx.route_tape` does

    _libsystem = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
    _libsystem.mach_timebase_info(ctypes.byref(_TB))
    _libsystem.mach_continuous_time.restype = ctypes.c_uint64

which raises OSError anywhere but macOS, and `mtplx.generation` imports that
module, so nothing of MTPLX's generation API imports. `import_mtplx()` imports
`mtplx.route_tape` once with `ctypes.CDLL` patched for exactly that library
path (a stand-in whose `mach_timebase_info` reports 1/1 and whose
`mach_continuous_time` is `time.monotonic_ns`), then restores `ctypes.CDLL`.
Every other CDLL call in MTPLX is untouched (they sit behind platform checks
or try/except and take their non-macOS branches).

`import mtp_serve` must already have run in the process (OpenBLAS preload
before the first `import mlx.core`); importing this module does that first.
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (before mlx.core, which mtplx imports)

import ctypes
import sys
import time
from types import ModuleType

MACOS_LIBSYSTEM = "/usr/lib/libSystem.B.dylib"


class _Fn:
    """A callable with settable ctypes-style attributes (restype, argtypes)."""

    def __init__(self, fn):
        self._fn = fn
        self.restype = None
        self.argtypes = None

    def __call__(self, *args):
        return self._fn(*args)


def _timebase_info(ref) -> int:
    info = getattr(ref, "_obj", ref)  # ctypes.byref(...) -> CArgObject wrapping the struct
    info.numer = 1
    info.denom = 1
    return 0


class _FakeLibSystem:
    """The two libSystem functions route_tape uses, on the host's monotonic clock."""

    def __init__(self):
        self.mach_timebase_info = _Fn(_timebase_info)
        self.mach_continuous_time = _Fn(time.monotonic_ns)


def import_mtplx() -> ModuleType:
    """Import `mtplx` with route_tape's macOS-only CDLL call shimmed; returns the package.

    On macOS nothing is patched. Raises ImportError when mtplx is not installed.
    """
    if sys.platform == "darwin" or "mtplx.route_tape" in sys.modules:
        import mtplx

        return mtplx
    real_cdll = ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if name == MACOS_LIBSYSTEM:
            return _FakeLibSystem()
        return real_cdll(name, *args, **kwargs)

    ctypes.CDLL = cdll
    try:
        import mtplx
        import mtplx.route_tape  # noqa: F401  (the module with the module-level CDLL call)
    finally:
        ctypes.CDLL = real_cdll
    return mtplx
