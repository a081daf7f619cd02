#!/usr/bin/env bash
# elastic-run's benchmark suite, side by side with what users would pick instead (PyTorch DCP,
# torch.save, raw object_store, torchrun). See BENCHMARKS.md for what each benchmark compares.
#
#   bench/run.sh [--reps N] [--sizes 0.25,1] [--s3-sizes 0.25] [--members 10,100,1000] [NAME...]
#   bench/run.sh --help
#
# NAMEs: stall durable restore recovery scale overhead fsdp export (default: all; `lostwork` = recovery).
# Installs nothing beyond tests/services/setup.sh (the project's venv, etcd, moto) and the
# release builds of bench/build.sh; torchrun's etcd-v2 backend additionally pip-installs
# python-etcd into the venv the first time it runs (if PyPI has it).
# Writes bench/results/<date-time>/results.{json,md} (or --out DIR) and prints the tables.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    exec python3 bench/suite.py --help
  fi
done
bash tests/services/setup.sh
export ELASTIC_VENV="${ELASTIC_VENV:-$repo/.venv}"
export PATH="$ELASTIC_VENV/bin:$PATH" LIBTORCH_USE_PYTORCH="${LIBTORCH_USE_PYTORCH:-1}"
echo "[bench] building (release) ..." >&2
while IFS='=' read -r k v; do
  export "$k=$v"
done < <(bench/build.sh)
exec "$ELASTIC_VENV/bin/python" bench/suite.py "$@"
