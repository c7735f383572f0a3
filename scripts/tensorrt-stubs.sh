#!/usr/bin/env bash
# Put tensorrt-stubs' .pyi files under .typings/ for mypy (MYPYPATH), without installing the wheel: installed,
# it makes an empty `tensorrt` namespace package that looks like a TensorRT install. Its one syntax error (a
# syntax errors are mended: parameters named `in` (a Python keyword) become `in_`, and add_scale_nd's
# `channel_axis` after defaulted parameters gets a default of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=10.13.0.35.1
TARGET=.typings
[ -f "$TARGET/.version-$VERSION" ] && exit 0
PYTHON=${PYTHON:-.venv/bin/python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m pip download -q --no-deps "tensorrt-stubs==$VERSION" -d "$scratch" 2>/dev/null ||
    { echo "error: could not download tensorrt-stubs==$VERSION from the package index" >&2; exit 1; }
"$PYTHON" - "$scratch"/tensorrt_stubs-*.whl "$scratch/unpacked" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
rm -rf "$TARGET" && mkdir -p "$TARGET"
cp -r "$scratch/unpacked/tensorrt" "$scratch/unpacked/tensorrt_bindings" "$TARGET/"
sed -i -E -e '/^ *def /s/([(,] ?)in: /\1in_: /g' -e 's/, channel_axis: int\)/, channel_axis: int = ...)/' \
    "$TARGET/tensorrt_bindings/tensorrt.pyi"
touch "$TARGET/.version-$VERSION"
