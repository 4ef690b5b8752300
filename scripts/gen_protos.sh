#!/usr/bin/env bash
# Regenerate the Python stubs of every contract in protos/ into libs/protos/src (package forge-protos).
#
#   scripts/gen_protos.sh            # uses .venv/bin/python; override with PYTHON=...
#
# Output per proto file forge/<area>/v1/<area>.proto: <area>_pb2.py, <area>_pb2.pyi,
# <area>_pb2_grpc.py, <area>_pb2_grpc.pyi, importable as `from forge.<area>.v1 import <area>_pb2`.
# Everything under libs/protos/src/forge is generated: it is deleted first so that removed protos
# vanish, and CI fails if a regeneration differs from what is committed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PROTO_ROOT="protos"
OUT="libs/protos/src"
PKG="$OUT/forge"

# protoc-gen-mypy and protoc-gen-mypy_grpc are installed next to the interpreter.
export PATH="$(dirname "$PYTHON"):$PATH"

# The google/protobuf/*.proto well-known types ship inside grpc_tools.
WKT_INCLUDE="$("$PYTHON" -c 'import os, grpc_tools; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')"

mapfile -t PROTOS < <(cd "$PROTO_ROOT" && find forge -name '*.proto' | LC_ALL=C sort)
if [ "${#PROTOS[@]}" -eq 0 ]; then
  echo "gen_protos: no .proto files under $PROTO_ROOT/forge" >&2
  exit 1
fi

rm -rf "$PKG"
mkdir -p "$PKG"

"$PYTHON" -m grpc_tools.protoc \
  -I "$PROTO_ROOT" \
  -I "$WKT_INCLUDE" \
  --python_out="$OUT" \
  --grpc_python_out="$OUT" \
  --mypy_out="quiet:$OUT" \
  --mypy_grpc_out="quiet:$OUT" \
  "${PROTOS[@]}"

# Regular packages (not namespace packages) all the way down, and a PEP 561 marker.
find "$PKG" -type d | while read -r dir; do
  : > "$dir/__init__.py"
done
: > "$PKG/py.typed"

echo "gen_protos: generated stubs for ${#PROTOS[@]} proto files into $PKG"
