#!/usr/bin/env bash
# Regenerate ptdstream/format/{program_fb,flat_tensor_fb}/ and ptdstream/format/fb_tables.py
# from the schema files of the INSTALLED executorch package (program.fbs, scalar_type.fbs,
# flat_tensor.fbs, XNNPACK's runtime_schema.fbs), with the flatc executorch ships
# (executorch/data/bin/flatc). No .fbs file is copied into the repository.
#
#   tools/gen_format_schema.sh [OUT_DIR]   (default: ptdstream/format; the test writes a temp dir)
#
# flatc names generated modules after the schema namespace (executorch_flatbuffer.X);
# their imports are rewritten to the package they are committed in. fb_tables.py is
# written by tools/gen_fb_tables.py from flatc's binary schemas (-b --schema): the
# field slots, types and struct layouts the bounds-checked verifier walks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-ptdstream/format}
ET=$("$PY" -c "import importlib.util as u; print(u.find_spec('executorch').submodule_search_locations[0])")
FLATC="$ET/data/bin/flatc"
PROGRAM="$ET/schema/program.fbs"
SCALAR_TYPE="$ET/schema/scalar_type.fbs"
FLAT_TENSOR="$ET/extension/flat_tensor/serialize/flat_tensor.fbs"
XNNPACK="$ET/backends/xnnpack/serialization/runtime_schema.fbs"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$FLATC" --python -o "$tmp/py" "$PROGRAM" "$SCALAR_TYPE" "$FLAT_TENSOR"
"$FLATC" -b --schema -o "$tmp/bfbs" "$PROGRAM" "$FLAT_TENSOR" "$XNNPACK"
mkdir -p "$OUT"
for pair in executorch_flatbuffer:program_fb flat_tensor_flatbuffer:flat_tensor_fb; do
  ns=${pair%%:*}; dest=${pair##*:}
  rm -rf "${OUT:?}/$dest"
  mkdir -p "$OUT/$dest"
  for f in "$tmp/py/$ns"/*.py; do
    sed -e "s/^\(\s*\)from $ns\./\1from ptdstream.format.$dest./" "$f" > "$OUT/$dest/$(basename "$f")"
  done
done
"$PY" tools/gen_fb_tables.py "$OUT/fb_tables.py" \
  program="$tmp/bfbs/program.bfbs" flat_tensor="$tmp/bfbs/flat_tensor.bfbs" xnnpack="$tmp/bfbs/runtime_schema.bfbs"
echo "generated $OUT/{program_fb,flat_tensor_fb,fb_tables.py} with $("$FLATC" --version)"
