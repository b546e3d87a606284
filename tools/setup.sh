#!/usr/bin/env bash
# Set up ./.venv with the CPU build of torch, executorch 1.5.1 and ptdstream (+ test extras).
# Safe to run again: an existing, complete venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build first: a bare "torch" requirement would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -c "import torch, executorch, ptdstream; print('ptdstream', ptdstream.__version__, '| torch', torch.__version__, '| executorch 1.5.1 ready')"
