#!/usr/bin/env bash
# GPU checks, run on a machine with an NVIDIA GPU and PyTorch in `python3` (no etcd needed):
#  1. examples/ddp_train.py under elastic-run on NCCL: SIGTERM drain, then resume from the
#     file:// bucket with no step lost, without copies (--restore-no-copy: the load reads the
#     bucket's chunks straight into the GPU through pinned buffers);
#  2. device-to-host snapshot speed: elastic_run.save vs torch.save vs dcp.save of a GPU model;
#  3. restore into the GPU: the pinned path bitwise (model and Adam state), then its speed
#     against torch.load(map_location="cuda") and dcp.load;
#  4. the in-place client on NCCL: a group of one trains and votes; a group of two whose peer
#     never comes gives its all-reduce up within the timeout, aborts the communicator, exits;
#     both again through ip.ddp(model) (DDP's comm hook).
# Usage: tests/gpu/check.sh [OUT_DIR]   (elastic-run from target/debug or $ELASTIC_RUN)
# Each part prints its own verdict; the exit status is that of the last failure (0: all passed).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$repo/target/gpu-check}"
mkdir -p "$out"
bin="${ELASTIC_RUN:-$repo/target/debug/elastic-run}"
w="$(mktemp -d)"
rc=0
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
run() {
  exec "$bin" --standalone --nproc-per-node 1 --checkpoint-url "file://$w/ck" --checkpoint-interval 50 \
    --staging-dir "$w/st" --events-file "$out/events.jsonl" --preemption-grace 30s "${@:2}" \
    -- "$repo/examples/ddp_train.py" --steps "$1" --step-sleep 0.005
}
echo "== 1. NCCL training under elastic-run, SIGTERM drain after 20 s"
run 100000 > "$out/run1.log" 2>&1 & pid=$!
sleep 20
kill -TERM "$pid"; wait "$pid"; echo "run 1 exit: $?"
grep -E "backend|stopping at|done step" "$out/run1.log" | sed 's/^/   /'
stopped=$(grep -oE "stopping at step [0-9]+" "$out/run1.log" | grep -oE "[0-9]+$")
echo "== resume to step $((stopped + 100))"
( run $((stopped + 100)) --restore-no-copy ) > "$out/run2.log" 2>&1; echo "run 2 exit: $?"
grep -E "backend|resumed from|done step" "$out/run2.log" | sed 's/^/   /'
if grep -q "resumed from step $stopped " "$out/run2.log"; then echo "RESUME OK: no step lost"; else echo "RESUME FAILED"; rc=1; fi
if [ -f "$w/st/.restore/step-$stopped/rank-0/sources.json" ] && [ ! -e "$w/st/.restore/step-$stopped/rank-0/state.safetensors" ]; then
  echo "NO-COPY RESTORE OK: read from the bucket's chunks"
else echo "NO-COPY RESTORE FAILED: $(ls "$w/st/.restore/step-$stopped/rank-0" 2>&1)"; rc=1; fi
echo "== 2. device-to-host snapshot speed"
timeout 240 python3 "$repo/tests/gpu/snapshot_speed.py" --gib "${SNAPSHOT_GIB:-2}" --repeat 3 | tee "$out/snapshot.jsonl" || rc=1
echo "== 3. restore into the GPU through pinned buffers"
timeout 240 python3 "$repo/tests/gpu/restore_speed.py" --gib "${SNAPSHOT_GIB:-2}" --repeat 3 | tee "$out/restore.jsonl" || rc=1
echo "== 4. the in-place client on NCCL"
timeout 60 python3 "$repo/tests/gpu/nccl_inplace.py" one | tee "$out/nccl.jsonl" || { echo "NCCL GROUP OF ONE FAILED"; rc=1; }
timeout 120 python3 "$repo/tests/gpu/nccl_inplace.py" alone --timeout-s 5 | tee -a "$out/nccl.jsonl" || { echo "NCCL ABORT FAILED (rc ${PIPESTATUS[0]})"; rc=1; }
timeout 60 python3 "$repo/tests/gpu/nccl_inplace.py" one --ddp | tee -a "$out/nccl.jsonl" || { echo "NCCL DDP GROUP OF ONE FAILED"; rc=1; }
timeout 120 python3 "$repo/tests/gpu/nccl_inplace.py" alone --timeout-s 5 --ddp | tee -a "$out/nccl.jsonl" || { echo "NCCL DDP ABORT FAILED (rc ${PIPESTATUS[0]})"; rc=1; }
rm -rf "$w"
exit "$rc"
