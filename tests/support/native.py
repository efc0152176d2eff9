"""Skip marks for the tests of mtp-serve's native CPU kernels (mtp_serve/native/).

A machine that cannot run a kernel (no AVX2/FMA/F16C, MLX on a GPU, the kernel turned off by
MTP_SERVE_NO_QMM=1) skips its tests. A kernel that this machine could run but that did not build or
load (a compiler error, cmake or g++ missing) skips them too on a developer's machine, but under CI
(CI=true, where install.sh provides the tools) it fails them with the build's reason."""

from __future__ import annotations

import os

import pytest

from mtp_serve import quantized_matmul as qmm_ext

MACHINE_REASONS = ("disabled by MTP_SERVE_NO_QMM", "lacks AVX2", "runs on the GPU")
FAIL_MARK = "native_build_failed"  # tests/conftest.py fails a test carrying it


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def needs_native(available: bool, why: str) -> pytest.MarkDecorator:
    """Run where `available`; otherwise skip, or under CI fail when `why` is not the machine's own."""
    if available:
        return pytest.mark.skipif(False, reason="available")
    if in_ci() and not any(reason in why for reason in MACHINE_REASONS):
        return getattr(pytest.mark, FAIL_MARK)(f"the native kernel did not build in CI: {why}")
    return pytest.mark.skipif(True, reason=f"native kernel unavailable: {why}")


def needs_qmm_kernel() -> pytest.MarkDecorator:
    """The quantized-matmul extension (which also holds the recurrence, activations and attention)."""
    return needs_native(qmm_ext.load() is not None, qmm_ext.status())
