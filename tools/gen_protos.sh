#!/usr/bin/env bash
# Regenerates libs/sluice-protos/src/sluice from protos/ (or into $1, for the drift check).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/libs/sluice-protos/src}
py=$root/libs/sluice-protos/.venv/bin/python
rm -rf "$out/sluice"
mkdir -p "$out"
cd "$root/protos"
files=$(find sluice -name '*.proto' | sort)
"$py" -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" $files
# Package markers so that the generated modules import as sluice.<domain>.v1.
find "$out/sluice" -type d -exec touch {}/__init__.py \;
