#!/usr/bin/env bash
# Set up ./.venv with the CPU build of torch, executorch 1.5.1 and ptdstream (+ test extras).
# Safe to run again: an existing, complete venv is reused.
#   --hf  also install the `hf` extra (optimum-executorch, transformers) for the tests marked hf.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="test"
for arg in "$@"; do
  case "$arg" in
    --hf) EXTRAS="test,hf" ;;
    *) echo "usage: tools/setup.sh [--hf]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build first: a bare "torch" requirement would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
# The torch installed above satisfies every extra: pip keeps it (no CUDA build is pulled).
python -m pip install -q -e ".[$EXTRAS]"
python -c "import torch, executorch, ptdstream; print('ptdstream', ptdstream.__version__, '| torch', torch.__version__, '| executorch 1.5.1 ready')"
if [ "$EXTRAS" = "test,hf" ]; then
  python -c "from importlib.metadata import version as v; import optimum.exporters.executorch; print('optimum-executorch', v('optimum-executorch'), '| transformers', v('transformers'), 'ready')"
fi
