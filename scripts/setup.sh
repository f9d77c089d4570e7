#!/usr/bin/env bash
# Create ./.venv (once) with torch 2.13.0 and river-hf with its test/eval extras (editable).
# torch comes from PyTorch's CPU wheel index when that index answers (a plain `pip install torch`
# on Linux x86-64 gives a multi-GB CUDA build); otherwise from pip's configured index (PyPI or a
# mirror), pinned, which gives a CPU build only where that index serves one (macOS, Windows, a
# CPU-only mirror). TORCH_INDEX_URL=<url> picks another index (e.g. a CUDA one) instead.
# Idempotent: once torch 2.13.0 is installed a rerun asks no index about it and only checks river-hf.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  :  # torch 2.13.0 already installed (whichever build): keep it
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
elif .venv/bin/python -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
  "${PIP[@]}" --index-url "$CPU_INDEX" "torch==$TORCH_VERSION"
else
  echo "setup.sh: $CPU_INDEX did not answer; installing torch==$TORCH_VERSION from pip's configured index" \
       "(a CPU build only if that index serves one; TORCH_INDEX_URL=<url> to choose)" >&2
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" -e ".[dev]"
