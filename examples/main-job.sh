#!/usr/bin/env bash
# The main job: a real elastic training run on this machine, on embedded defaults.
# Runs examples/ddp_train.py (PyTorch DDP, gloo on CPU) as 2 workers under elastic-run,
# preempts it midway with SIGTERM (the agent drains: the workers agree on a step and save it),
# then resumes from the file:// checkpoint bucket and trains to the end, with no step lost.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash tests/services/setup.sh
export PATH="$repo/.venv/bin:$PATH"
cargo build --quiet -p runtime --bin elastic-run
bin="$repo/target/debug/elastic-run"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
bucket="file://$work/bucket"
steps="${MAIN_JOB_STEPS:-300}"
# exec, so that the PID of a backgrounded run is the agent itself and SIGTERM reaches it.
run() {
  exec "$bin" --standalone --nproc-per-node 2 --rdzv-id main-job --checkpoint-url "$bucket" \
    --checkpoint-interval 10 --lr-scaling linear --base-world-size 2 --preemption-grace 30s \
    --staging-dir "$work/staging" -- python examples/ddp_train.py --steps "$steps" --step-sleep 0.05 "$@"
}
echo "== run 1: training, preempted with SIGTERM after a few seconds"
run & agent=$!
sleep "${MAIN_JOB_PREEMPT_AFTER_S:-6}"
kill -TERM "$agent"
wait "$agent" || echo "(run 1 exited with $?)"
echo "== run 2: resumes from $bucket and finishes"
(run)
echo "== checkpoints committed in $bucket:"
ls "$work/bucket" 2>/dev/null || true
