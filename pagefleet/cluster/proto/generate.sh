#!/usr/bin/env bash
# Regenerates pagefleet_pb2.py, pagefleet_pb2.pyi and pagefleet_pb2_grpc.py from
# pagefleet.proto (needs grpcio-tools: pip install -e '.[test]'). Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. pagefleet.proto
# protoc writes `import pagefleet_pb2`, which only works with this folder on sys.path;
# the package import is what the installed project needs.
sed -i 's/^import pagefleet_pb2 as/from pagefleet.cluster.proto import pagefleet_pb2 as/' pagefleet_pb2_grpc.py
# The stub is what mypy reads; bring it to the project's lint rules (X | None etc.).
# (pyproject excludes generated code from ruff even when named, hence the two flags.)
ruff check --fix --quiet --no-force-exclude --exclude '' pagefleet_pb2.pyi
ruff format --quiet --no-force-exclude --exclude '' pagefleet_pb2.pyi
