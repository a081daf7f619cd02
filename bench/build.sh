#!/usr/bin/env bash
# Builds what the benchmark suite runs (release): elastic-ckpt, elastic-run, elastic's `scale`
# example, and the `bench_store` example (examples/bench_store.rs). Prints nothing on success
# but the paths, one `NAME=PATH` a line, for bench/run.sh to read.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
target="${CARGO_TARGET_DIR:-$repo/target}"
log="$target/bench-build.log"
mkdir -p "$target"
: >"$log"
cargo build --release -p checkpoint --bin elastic-ckpt -p elastic --example scale -p runtime --bin elastic-run >>"$log" 2>&1 \
  || { tail -30 "$log" >&2; echo "bench/build.sh: cargo build failed (log: $log)" >&2; exit 1; }
echo "ELASTIC_CKPT=$target/release/elastic-ckpt"
echo "ELASTIC_RUN=$target/release/elastic-run"
echo "SCALE=$target/release/examples/scale"

cargo build --release --example bench_store >>"$log" 2>&1 \
  || { tail -30 "$log" >&2; echo "bench/build.sh: building bench_store failed (log: $log)" >&2; exit 1; }
echo "BENCH_STORE=$target/release/examples/bench_store"
