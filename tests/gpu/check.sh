#!/usr/bin/env bash
# GPU checks, run on a machine with an NVIDIA GPU and PyTorch in `python3` (no etcd needed):
#  1. examples/ddp_train.py under elastic-run on NCCL: SIGTERM drain, then resume from the
#     file:// bucket with no step lost;
#  2. device-to-host snapshot speed: elastic_run.save vs torch.save vs dcp.save of a GPU model.
# Usage: tests/gpu/check.sh [OUT_DIR]   (elastic-run from target/debug or $ELASTIC_RUN)
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$repo/target/gpu-check}"
mkdir -p "$out"
bin="${ELASTIC_RUN:-$repo/target/debug/elastic-run}"
w="$(mktemp -d)"
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
run() {
  "$bin" --standalone --nproc-per-node 1 --checkpoint-url "file://$w/ck" --checkpoint-interval 50 \
    --staging-dir "$w/st" --events-file "$out/events.jsonl" --preemption-grace 30s \
    -- "$repo/examples/ddp_train.py" --steps "$1" --step-sleep 0.005
}
echo "== 1. NCCL training under elastic-run, SIGTERM drain after 20 s"
run 100000 > "$out/run1.log" 2>&1 & pid=$!
sleep 20
kill -TERM "$pid"; wait "$pid"; echo "run 1 exit: $?"
grep -E "backend|stopping at|done step" "$out/run1.log" | sed 's/^/   /'
stopped=$(grep -oE "stopping at step [0-9]+" "$out/run1.log" | grep -oE "[0-9]+$")
echo "== resume to step $((stopped + 100))"
run $((stopped + 100)) > "$out/run2.log" 2>&1; echo "run 2 exit: $?"
grep -E "backend|resumed from|done step" "$out/run2.log" | sed 's/^/   /'
if grep -q "resumed from step $stopped " "$out/run2.log"; then echo "RESUME OK: no step lost"; else echo "RESUME FAILED"; fi
echo "== 2. device-to-host snapshot speed"
python3 "$repo/tests/gpu/snapshot_speed.py" --gib "${SNAPSHOT_GIB:-2}" --repeat 3 | tee "$out/snapshot.jsonl"
rm -rf "$w"
