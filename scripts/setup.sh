#!/usr/bin/env bash
# Idempotent set-up: .venv with CPU torch, the project (editable), dev tools, and the default model.
# Fast when already done: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.conveyor-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
# Our C++ CPU kernels (attention, GGUF linears, fused ops): compiled once per content of their sources into
# ~/.cache/conveyor/cpu_ext/ (~2 min cold on 2 cores; a clone of the same sources reuses the build).
.venv/bin/python -m conveyor.kernels.cpu_ext
# The Prometheus server the metrics tests start (Debian package; idempotent).
if ! command -v prometheus >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq prometheus
fi
if [ "${CONVEYOR_SKIP_MODEL:-0}" != "1" ]; then
  .venv/bin/conveyor model pull smollm2
fi
