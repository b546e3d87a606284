#!/usr/bin/env bash
# Regenerate ptdstream/manifest/manifest_fb/ from schema/manifest.fbs with the flatc that
# executorch ships (executorch/data/bin/flatc), so the generated code matches the
# flatbuffers runtime executorch is tested with.
#   bash tools/gen_manifest_schema.sh [OUT_ROOT]   (default: the repo; tests pass a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ROOT=${1:-.}
FLATC=$("$PY" -c "import os, executorch; print(os.path.join(os.path.dirname(executorch.__path__[0] + '/'), 'data', 'bin', 'flatc'))")
out=$(mktemp -d)
"$FLATC" --python --gen-object-api -o "$out" schema/manifest.fbs
mkdir -p "$ROOT/ptdstream/manifest"
rm -rf "$ROOT/ptdstream/manifest/manifest_fb"
mv "$out/ptdstream/manifest/manifest_fb" "$ROOT/ptdstream/manifest/manifest_fb"
rm -rf "$out"
echo "generated $ROOT/ptdstream/manifest/manifest_fb with $("$FLATC" --version)"
