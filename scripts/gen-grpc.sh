#!/usr/bin/env bash
# Regenerate pagellm/server/grpc/pagellm_pb2*.py from pagellm.proto (needs grpcio-tools, a test dependency).
# tests/server/test_grpc.py fails when the committed modules differ from what this writes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. pagellm/server/grpc/pagellm.proto
