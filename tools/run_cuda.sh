#!/usr/bin/env bash
# On a GPU machine: the CUDA tests, then the CUDA benchmark table, in one go.
#   bash tools/run_cuda.sh [--sizes-gib 8 32] [--out DIR]
# Uses the python on PATH (torch with CUDA, executorch 1.5.1 and ptdstream importable).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pytest -q -p no:cacheprovider -m cuda tests/sources/test_cuda.py tests/hooks/test_cuda_backend.py tests/hooks/test_cuda_twins.py
python3 benchmarks/bench_cuda.py "$@"
