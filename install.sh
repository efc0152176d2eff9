#!/usr/bin/env bash
# Installs mtp-serve and everything it needs on a fresh machine.
#   ./install.sh           the server (Python package, OpenBLAS on Linux)
#   ./install.sh --test    also the test tools (pytest, openai, scipy) and opencode from npm
set -euo pipefail
cd "$(dirname "$0")"
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

# Linux CPU fast path: MLX's CPU wheel links a slow reference BLAS; mtp-serve
# preloads Debian's OpenBLAS at import time when it is installed. MLX builds its
# fused kernels for mx.compile'd decode steps with g++ (without it they run unfused).
if [ "$(uname -s)" = Linux ]; then
  missing=""
  ldconfig -p 2>/dev/null | grep -q "libopenblas.so.0" || missing=" libopenblas0-pthread"
  command -v g++ >/dev/null || missing="$missing g++"
  if [ -n "$missing" ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    if command -v apt-get >/dev/null; then
      $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $missing >/dev/null
    else
      echo "install.sh: install$missing with your package manager (OpenBLAS: fast fp32 matmuls; g++: fused kernels)" >&2
    fi
  fi
fi

if [ "$want_test" = 1 ]; then
  python3 -m pip install -q -e ".[test]"
  if command -v npm >/dev/null; then
    mkdir -p .work/opencode
    (cd .work/opencode && [ -x node_modules/.bin/opencode ] || npm install --silent --no-audit --no-fund opencode-ai >/dev/null)
  else
    echo "install.sh: npm not found; the opencode end-to-end test will be skipped" >&2
  fi
else
  python3 -m pip install -q -e .
fi
