#!/usr/bin/env bash
# Create ./.venv (once) with torch 2.13.0 and river-hf with its test/eval extras (editable).
# torch comes from pip's configured index (PyPI or a mirror), pinned. On Linux x86-64 PyPI serves a
# multi-GB CUDA build; for the CPU build set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# (or any other torch index). No other index is contacted unless asked for.
# Idempotent: once torch 2.13.0 is installed a rerun asks no index about it and only checks river-hf.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  :  # torch 2.13.0 already installed (whichever build): keep it
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" -e ".[dev]"
