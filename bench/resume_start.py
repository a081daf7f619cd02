"""A job that resumes from its checkpoints, from the launcher's start to its first step done,
side by side: `elastic-run --standalone` as it is, with `--warm-standby` (the standbys import
torch while the agent restores) and with `--restore-no-copy`, and `torchrun --standalone` with
`dcp.load`.

    python bench/resume_start.py --hidden 11000 --nproc 2 --reps 5

The job is `examples/ddp_train.py` (an MLP whose two hidden layers are --hidden wide, SGD with
momentum: about 8 * hidden^2 bytes of state; 11000 is 0.9 GiB) on gloo, each worker with one
thread. Untimed, once: elastic-run trains 2 steps and commits step 2 to a `file://` store on
/tmp (each resume runs on a copy of it, made untimed); the torchrun worker (this file,
`--dcp-worker save`) does the same and `dcp.save`s step 2 to /tmp. Timed, per repetition in rotated order, each from the launcher's start until rank 0
prints step 3:
- `elastic-run`: the agent restores step 2 into `/dev/shm`, then starts the workers, whose
  `elastic_run.load` reads it;
- `elastic-run --warm-standby`: the same, its workers started in standbys that the agent
  started before it restored;
- `elastic-run --restore-no-copy`: the agent checks the step's raw chunks where they lie and
  writes only where its bytes lie (`sources.json`); `elastic_run.load` reads them there;
- `torchrun` + `dcp.load`: the workers start, build the model, and `dcp.load` step 2 through
  `get_state_dict`/`set_state_dict`.
Each row also gives what the agent's log says of its restore (`ms`) and how many workers
started in a standby; `import_torch_s` is `python -c "import torch"` alone. Each elastic-run
resume checks that it resumed from step 2 (its log line); each torchrun one loads step 2.

Rust tools come from $ELASTIC_RUN (bench/build.sh). Prints one JSON object per measurement.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402 (bench/common.py, beside this file)

REPO = common.REPO
PY = os.path.join(common.VENV, "bin", "python")
# The longest one launch may take (a 1 GiB save or resume on 2 cores takes seconds).
RUN_TIMEOUT_S = 600
STEP_LINE = re.compile(r"\bstep (\d+) loss ")
# The agent's line once the resume step is restored (not the store's own lines before it).
RESTORED_MS = re.compile(r": restored step=\d+ dir=.*\bms=(\d+)")


def env_of():
    return common.worker_env(GLOO_SOCKET_IFNAME="lo", NO_COLOR="1")


def launch(argv, first_step, cwd):
    """Runs `argv` to its end; returns (seconds until a line says step `first_step`, its
    output, its error output)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_of(), cwd=cwd)
    err = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    out, seen = [], None
    timer = threading.Timer(RUN_TIMEOUT_S, p.kill)
    timer.start()
    try:
        for raw in p.stdout:
            line = raw.decode(errors="replace")
            out.append(line)
            m = STEP_LINE.search(line)
            if seen is None and m and int(m.group(1)) == first_step:
                seen = time.perf_counter() - t0
        rc = p.wait()
    finally:
        timer.cancel()
    reader.join()
    out, err = "".join(out), b"".join(err).decode(errors="replace")
    if rc != 0 or seen is None:
        raise RuntimeError(f"{argv[0]} exited {rc} (first step seen: {seen}):\n{out[-3000:]}\n{err[-3000:]}")
    return seen, out, err


def elastic_argv(a, store, steps, flags=()):
    binary = os.environ.get("ELASTIC_RUN") or os.path.join(REPO, "target", "release", "elastic-run")
    return [binary, "--standalone", "--nproc-per-node", str(a.nproc), "--checkpoint-url", store, *flags, "--",
            PY, "examples/ddp_train.py", "--hidden", str(a.hidden), "--steps", str(steps)]


def torchrun_argv(a, mode, ckpt):
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
            os.path.join(HERE, "resume_start.py"), "--dcp-worker", mode, "--dcp-dir", ckpt,
            "--hidden", str(a.hidden)]


def dcp_worker(a):
    """torchrun's worker: the model and optimizer of examples/ddp_train.py; `save` trains 2
    steps and `dcp.save`s step 2, `load` loads it with `dcp.load` and trains step 3."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    sys.path.insert(0, os.path.join(REPO, "examples"))
    import ddp_train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(ddp_train.N_FEATURES, a.hidden), torch.nn.Tanh(),
        torch.nn.Linear(a.hidden, a.hidden), torch.nn.Tanh(),
        torch.nn.Linear(a.hidden, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x_all, y_all = ddp_train.dataset(0, 8192)

    def train(step):
        idx = torch.arange(32) + 32 * (step * dist.get_world_size() + rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x_all[idx]), y_all[idx])
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    if a.dcp_worker == "save":
        for step in (1, 2):
            train(step)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=a.dcp_dir)
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "step": 0}
        dcp.load(sd, checkpoint_id=a.dcp_dir)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if sd["step"] != 2:
            raise SystemExit(f"dcp.load gave step {sd['step']}, not 2")
        train(3)
    dist.destroy_process_group()
    # This worker's interpreter may hang at exit after a dcp.save of ~1 GiB (torch 2.13, gloo):
    # it leaves at once, its output flushed.
    sys.stdout.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=11000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--dcp-worker", choices=["save", "load"], help=argparse.SUPPRESS)
    p.add_argument("--dcp-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.dcp_worker:
        return dcp_worker(a)
    tmp = tempfile.mkdtemp(prefix="resume-start-", dir="/tmp")
    try:
        # Each resume commits step 3 as it ends: it runs on a copy of the store holding step 2.
        saved, store = os.path.join(tmp, "saved"), os.path.join(tmp, "store")
        dcp_dir = os.path.join(tmp, "dcp")
        launch(elastic_argv(a, "file://" + saved, 2), 2, REPO)
        launch(torchrun_argv(a, "save", dcp_dir), 2, REPO)
        t = time.perf_counter()
        subprocess.run([PY, "-c", "import torch"], env=env_of(), check=True)
        print(json.dumps({"import_torch_s": round(time.perf_counter() - t, 3)}), flush=True)
        systems = ["elastic-run", "elastic-run --warm-standby", "elastic-run --restore-no-copy",
                   "torchrun + dcp.load"]
        for rep in range(a.reps):
            for system in systems[rep % len(systems):] + systems[:rep % len(systems)]:
                row = {"system": system, "rep": rep, "hidden": a.hidden, "nproc": a.nproc}
                if system == "torchrun + dcp.load":
                    s, _, _ = launch(torchrun_argv(a, "load", dcp_dir), 3, REPO)
                else:
                    shutil.rmtree(store, ignore_errors=True)
                    shutil.copytree(saved, store)
                    argv = elastic_argv(a, "file://" + store, 3, system.split()[1:])
                    s, out, err = launch(argv, 3, REPO)
                    if "resumed from step 2 " not in out:
                        raise RuntimeError(f"{system} did not resume from step 2:\n{out[-3000:]}")
                    m = RESTORED_MS.search(err)
                    row["restore_ms"] = int(m.group(1)) if m else None
                    row["warm_workers"] = err.count("worker started from a warm standby")
                row["first_step_s"] = round(s, 3)
                print(json.dumps(row), flush=True)
    finally:
        if a.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
