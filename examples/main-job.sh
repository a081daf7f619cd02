#!/usr/bin/env bash
# The main job: a real elastic training run on this machine, on embedded defaults.
# Three simulated nodes (elastic-run agents with distinct node ids) x two PyTorch gloo workers
# train examples/ddp_train.py, coordinated through a local etcd that this command starts and
# stops, checkpointing to a file:// bucket. One node is preempted (SIGTERM), another killed
# (SIGKILL); the job goes on and finishes, and a summary shows generations, world sizes,
# learning rates, checkpoints and lost steps. See examples/main_job.rs.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash tests/services/setup.sh
export PATH="$repo/.venv/bin:$PATH"
cargo build --quiet -p runtime --bins
cargo build --quiet --example main_job
exec "$repo/target/debug/examples/main_job"
