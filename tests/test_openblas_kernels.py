"""OpenBLAS runs the vector kernels the CPU has, also on CPU models newer than its own table
(where it would fall back to SSE3), and a kernel choice the user made stays theirs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mtp_serve import BACKEND
from mtp_serve.backend import AVX512_CORE, openblas_coretype
from mtp_serve.skinny_gemm import cpu_flags

needs_openblas = pytest.mark.skipif(not BACKEND.blas, reason="no OpenBLAS preloaded here")

CORENAME = "from mtp_serve import backend; backend.setup_backend(); print(backend.openblas_corename())"


def _corename_in_fresh_process(**env_changes: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", CORENAME], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


def test_the_kernels_follow_the_cpus_features():
    assert openblas_coretype(AVX512_CORE | {"avx2", "fma"}) == "SkylakeX"
    assert openblas_coretype(frozenset({"avx2", "fma", "avx512f"})) == "Haswell"  # AVX-512 in part: AVX2's kernels
    assert openblas_coretype(frozenset({"avx", "sse4_2"})) is None  # older CPUs: OpenBLAS's own choice
    assert openblas_coretype(frozenset()) is None  # not x86-64


@needs_openblas
def test_openblas_loads_the_kernels_the_cpu_features_call_for():
    expected = openblas_coretype(cpu_flags())
    if expected is None:
        pytest.skip("a CPU without AVX2: OpenBLAS chooses for itself")
    assert _corename_in_fresh_process() == expected


@needs_openblas
def test_a_kernel_choice_the_user_set_is_kept():
    assert _corename_in_fresh_process(OPENBLAS_CORETYPE="Prescott") == "Prescott"
