"""Handing freed memory back to the operating system.

Freed memory stays with its allocator: MLX keeps freed buffers in its cache for
reuse, and the C heap keeps what tokenizers and Python freed. Both are released
when the engine goes idle, and the heap after a large prompt is tokenized, so a
burst of requests, or one huge rejected one, does not leave the process larger.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import mlx.core as mx

_name = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_name) if _name else None


def trim_heap() -> None:
    """Return the C heap's free pages (glibc's malloc_trim; a no-op elsewhere)."""
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def release_idle_memory() -> None:
    """MLX's buffer cache and the C heap's free pages (call when nothing is running)."""
    mx.clear_cache()
    trim_heap()
