#!/usr/bin/env bash
# Installs mtp-serve and everything it needs on a fresh machine.
#   ./install.sh           the server (Python package, OpenBLAS on Linux)
#   ./install.sh --test    also the test tools (pytest, openai, anthropic, scipy, schemathesis, playwright with
#                          Debian's chromium) and the agents the
#                          end-to-end tests drive, from npm: opencode, Claude Code, Codex CLI
set -euo pipefail
cd "$(dirname "$0")"
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

# Linux CPU fast path: MLX's CPU wheel links a slow reference BLAS; mtp-serve
# preloads Debian's OpenBLAS at import time when it is installed. MLX builds its
# fused kernels for mx.compile'd decode steps with g++ (without it they run unfused),
# and mtp-serve its sgemm for decode-sized products with the C compiler g++ brings
# (mtp_serve/native/skinny_sgemm.c; without it OpenBLAS computes them, slower). cmake and g++
# build its quantized decode matmul (mtp_serve/native/quantized_matmul.cpp; without them MLX's
# kernel computes quantized models' products, several times slower).
if [ "$(uname -s)" = Linux ]; then
  missing=""
  ldconfig -p 2>/dev/null | grep -q "libopenblas.so.0" || missing=" libopenblas0-pthread"
  command -v g++ >/dev/null || missing="$missing g++"
  command -v cmake >/dev/null || missing="$missing cmake"
  if [ -n "$missing" ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    if command -v apt-get >/dev/null; then
      $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $missing >/dev/null
    else
      echo "install.sh: install$missing with your package manager (OpenBLAS: fast fp32 matmuls; g++, cmake: fused and quantized kernels)" >&2
    fi
  fi
fi

if [ "$want_test" = 1 ]; then
  python3 -m pip install -q -e ".[test]"
  # mlx-vlm is tests/test_vision.py's reference vision tower; its own dependencies (datasets, opencv,
  # mlx-audio) are not needed for that, so it goes in without them.
  python3 -m pip install -q --no-deps mlx-vlm==0.7.10
  # The web page's tests drive Debian's chromium with playwright (pip); no browser is downloaded.
  if [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    if command -v apt-get >/dev/null; then
      $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
    else
      echo "install.sh: install chromium with your package manager for the web page's tests (tests/test_web_page.py)" >&2
    fi
  fi
  if command -v npm >/dev/null; then
    # One folder per agent under .work/ (where tests/support/npm_clients.py looks): dir, binary, package.
    for agent in "opencode opencode opencode-ai" "claude claude @anthropic-ai/claude-code" "codex codex @openai/codex"; do
      set -- $agent
      mkdir -p ".work/$1"
      (cd ".work/$1" && [ -x "node_modules/.bin/$2" ] || npm install --silent --no-audit --no-fund "$3" >/dev/null)
    done
  else
    echo "install.sh: npm not found; the agents' end-to-end tests (opencode, Claude Code, Codex) will be skipped" >&2
  fi
else
  python3 -m pip install -q -e .
fi
# Build the quantized decode matmul now rather than at the first quantized model's start (about a minute).
if [ "$(uname -s)" = Linux ]; then
  python3 -m mtp_serve.quantized_matmul || echo "install.sh: quantized matmul kernel not built; quantized models use MLX's kernel" >&2
fi
