#!/usr/bin/env bash
# The gates .ci/run runs before the tests, run the same way here:
#   1) ruff check . (pycodestyle, pyflakes, import order, bugbear, pyupgrade, blind except,
#      noqa hygiene; [tool.ruff] in pyproject.toml),
#   2) mypy (the package; strict on format/, sources/, store.py, write/, system/; [tool.mypy]),
#   3) every `# noqa: CODE` and `# type: ignore[code]` says why on its line
#      (`# noqa: BLE001 - why`, `# type: ignore[code]  # why`).
# All three run; the exit status is 1 when any failed.
# Usage: bash tools/lint.sh   (PYTHON=/path/to/python picks the interpreter; default .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
failed=0
gate() {  # gate NAME CMD...: run CMD, print its wall time, remember a failure
  local name=$1 start=$SECONDS
  shift
  echo "== $name"
  if "$@"; then echo "-- $name passed ($((SECONDS - start)) s)"; else echo "-- $name FAILED ($((SECONDS - start)) s)"; failed=1; fi
}
unexplained() {  # suppressions with no reason after their codes (flatc's generated *_fb/ excluded)
  ! git ls-files -z -- '*.py' ':!:*_fb/*' | xargs -0 grep -HnE \
    -e '#[[:space:]]*noqa(:[[:space:]]*[A-Z]+[0-9]+([[:space:]]*,[[:space:]]*[A-Z]+[0-9]+)*)?[[:space:]]*$' \
    -e '#[[:space:]]*type:[[:space:]]*ignore(\[[^]]*\])?[[:space:]]*$'
}
gate ruff "$PY" -m ruff check --output-format concise .
gate mypy "$PY" -m mypy
gate "noqa/type-ignore reasons" unexplained
exit $failed
