#!/usr/bin/env bash
# Regenerate ptdstream/manifest_fb/ from schema/manifest.fbs with the flatc that
# executorch ships (executorch/data/bin/flatc), so the generated code matches the
# flatbuffers runtime executorch is tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
FLATC=$("$PY" -c "import os, executorch; print(os.path.join(os.path.dirname(executorch.__path__[0] + '/'), 'data', 'bin', 'flatc'))")
out=$(mktemp -d)
"$FLATC" --python --gen-object-api -o "$out" schema/manifest.fbs
rm -rf ptdstream/manifest_fb
mv "$out/ptdstream/manifest_fb" ptdstream/manifest_fb
rm -rf "$out"
echo "generated ptdstream/manifest_fb with $("$FLATC" --version)"
