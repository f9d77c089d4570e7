#!/usr/bin/env bash
# Create ./.venv (once; $VENV names another folder) with torch 2.13.0 and river-hf with its test/eval/serve extras and the ARK and
# onnxruntime CPU kernels (editable; see pyproject.toml for why ARK is installed here and not a plain dependency).
# torch comes from pip's configured index (PyPI or a mirror), pinned. On Linux x86-64 PyPI serves a
# multi-GB CUDA build; for the CPU build set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# (or any other torch index). No other index is contacted unless asked for.
# Idempotent: once torch 2.13.0 is installed a rerun asks no index about it and only checks river-hf.
# TRANSFORMERS_VERSION=X.Y.Z pins transformers (CI's second venv tests the oldest version pyproject.toml allows).
# Each step says what it does (one line, on stderr) before it starts: pip runs quietly and a torch
# download can take minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
say() { echo "[setup] $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $("$PY" --version 2>&1) ..."
  "$PY" -m venv "$VENV"
else
  say "using the existing $VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  say "torch $TORCH_VERSION is already installed: kept"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  say "installing torch $TORCH_VERSION from $TORCH_INDEX_URL (a large download: this can take minutes) ..."
  "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
  say "installing torch $TORCH_VERSION from pip's configured index (on Linux x86-64 PyPI serves a multi-GB CUDA" \
      "build: this can take many minutes; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU build) ..."
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
say "installing river-hf (editable), its dependencies (transformers${TRANSFORMERS_VERSION:+ $TRANSFORMERS_VERSION}, optimum-quanto, ...), the test, eval and serve extras (pytest, datasets, fastapi, uvicorn, ...) and the ARK and onnxruntime CPU kernels ..."
"${PIP[@]}" -e ".[dev]" ${TRANSFORMERS_VERSION:+"transformers[serving]==$TRANSFORMERS_VERSION"}
if ! "$VENV/bin/python" -c "import auto_round_kernel" 2>/dev/null; then
  say "note: the ARK kernels (auto-round-lib) are not installed: it ships wheels only for Linux x86-64 and" \
      "CPython >= 3.11; the int4/int8 choices measure torch's and quanto's kernels instead (slower prompt passes" \
      "on the exit path; docs/river.md)"
fi
say "done: $VENV/bin/river-hf and $VENV/bin/python -m pytest are ready (transformers $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("transformers"))'))"
