#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs (tests/services/setup.sh),
# checks formatting and lints, runs every Rust test (the tch feature included) against real
# etcd, moto (S3), Azurite, fake-gcs-server and PyTorch, runs the Python worker-client tests,
# and prints the counts. Exits non-zero on any failure; a service that cannot start is a failure.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
start_s=$(date +%s)

bash tests/services/setup.sh
# The tch feature links the libtorch inside the worker environment's torch.
export PATH="$repo/.venv/bin:$PATH" LIBTORCH_USE_PYTORCH=1
export RUST_BACKTRACE=1

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings

logdir="$(mktemp -d)"
trap 'rm -rf "$logdir"' EXIT
status=0
echo "== cargo test (all features)"
# Each test binary's start time goes to $logdir/times, for the per-binary durations below.
cargo_started_s=$SECONDS
cargo test --workspace --all-features --no-fail-fast 2>&1 | while IFS= read -r line || [ -n "$line" ]; do
    printf '%s\n' "$line"
    case "$line" in
      "     Running "*|"   Doc-tests "*) printf '%s %s\n' "$SECONDS" "$line" >>"$logdir/times" ;;
    esac
  done | tee "$logdir/cargo.log" || status=1
cargo_ended_s=$SECONDS

py_passed=0; py_failed=0
if [ -d runtime/python/tests ]; then
  echo "== python worker-client tests"
  if ! .venv/bin/python -m unittest discover -s runtime/python/tests -t runtime/python -v 2>&1 | tee "$logdir/py.log"; then
    status=1
  fi
  py_run=$(sed -n 's/^Ran \([0-9]*\) tests\?.*/\1/p' "$logdir/py.log" | tail -1)
  py_failed=$(grep -cE '\.\.\. (FAIL|ERROR)$' "$logdir/py.log" || true)
  py_passed=$(( ${py_run:-0} - py_failed ))
fi

read -r rs_passed rs_failed rs_ignored < <(awk '/^test result:/ {
    for (i = 1; i <= NF; i++) {
      if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i
    } } END { print p+0, f+0, g+0 }' "$logdir/cargo.log")
echo
echo "test binaries taking 30 s or more (of $(( cargo_ended_s - cargo_started_s )) s of cargo test, build included):"
if [ -f "$logdir/times" ]; then
  awk -v end="$cargo_ended_s" '{ t[NR] = $1; $1 = ""; name[NR] = $0 }
    END { for (i = 1; i <= NR; i++) { d = (i < NR ? t[i+1] : end) - t[i]; if (d >= 30) printf "  %5d s %s\n", d, name[i] } }' "$logdir/times"
fi
echo "rust: ${rs_passed:-0} passed, ${rs_failed:-0} failed, ${rs_ignored:-0} ignored"
echo "python: ${py_passed} passed, ${py_failed} failed"
echo "wall time: $(( $(date +%s) - start_s )) s"
total_passed=$(( ${rs_passed:-0} + py_passed ))
total_failed=$(( ${rs_failed:-0} + py_failed ))
if [ "$status" -ne 0 ] && [ "$total_failed" -eq 0 ]; then total_failed=1; fi
echo "tests: ${total_passed} passed, ${total_failed} failed"
exit "$status"
