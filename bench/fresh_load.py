"""A restarted worker's load, up to its first two optimizer steps: a fresh model and a fresh
Adam (no state yet, as after a restart) load a committed step, then train two steps.

    python bench/fresh_load.py --size-gib G --reps N [--staging-dir /dev/shm]

Per repetition, untimed: `bench_store restore` lays the step out in the staging directory as
the agent does. Timed: `elastic_run.load`, then each of two `Adam.step()`s (their gradients
set beforehand, untimed). After the load the restore directory is removed, as the agent
removes it, and the shared memory still held is read from /proc/meminfo (`Shmem`): what the
worker keeps of the restored file. Beside it, the same with `dcp.load` through
`get_state_dict`/`set_state_dict` (the way DCP fills a fresh optimizer) from the same disk.
Every load is checked against the saved state.

`elastic_run` is this checkout's (`runtime/python`); to compare builds, run the script from a
checkout of each. Rust tools come from $ELASTIC_CKPT and $BENCH_STORE (bench/build.sh). Prints one JSON object per measurement on stdout.
"""
import argparse
import gc
import json
import os
import shutil
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--staging-dir", default="/dev/shm")
    a = p.parse_args()
    sys.argv = sys.argv[:1]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ckpt_bench as cb
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    er = cb.er
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cb.init_gloo()
    base = os.path.join(a.staging_dir, f"elastic-fresh-{os.getpid()}")
    disk = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"elastic-fresh-{os.getpid()}")
    os.makedirs(base)
    os.makedirs(disk)
    try:
        model, opt, layers, nbytes = cb.make_state(a.size_gib)
        want = cb.digest(model, opt)
        ckpt, store = cb.tool("ELASTIC_CKPT"), cb.tool("BENCH_STORE")
        staging = os.path.join(base, "saved")
        cb.er_save(model, opt, staging, 1, rank=0, world=1)
        with open(os.path.join(staging, "step-1", "rank-0", "meta.json")) as f:
            md = json.dumps({"state": json.load(f)["state"]})
        url = f"file://{disk}/ckpt"
        cb.run_tool([ckpt, "--json", "push", os.path.join(staging, "step-1"), url, "--step", "1",
                     "--world-size", "1", "--metadata", md])
        cb.rm(staging)
        dcp_dir = os.path.join(disk, "dcp")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        del model, opt, msd, osd
        grads = None

        def fresh(seed):
            torch.manual_seed(seed)
            m = torch.nn.Sequential(*[torch.nn.Linear(cb.HIDDEN, cb.HIDDEN) for _ in range(layers)])
            return m, torch.optim.Adam(m.parameters(), lr=1e-3)

        def steps(m, o):
            nonlocal grads
            if grads is None:
                grads = [torch.randn_like(p).mul_(1e-3) for p in m.parameters()]
            out = []
            for _ in range(2):
                for p, g in zip(m.parameters(), grads):
                    p.grad = g
                t = time.perf_counter()
                o.step()
                out.append(time.perf_counter() - t)
            return out

        def m_er(rep):
            dest = os.path.join(base, "restore")
            cb.run_tool([store, "restore", url, os.path.join(dest, "rank-0"), "--rank", "0", "--world", "1"])
            m, o = fresh(rep + 1)
            cb.er_env(base, 0, 1)
            t = time.perf_counter()
            step, _ = er.load(model=m, optimizer=o, resume_dir=dest)
            load_s = time.perf_counter() - t
            assert step == 1 and cb.digest(m, o) == want
            cb.rm(dest)
            held = shmem_mib()
            s1, s2 = steps(m, o)
            return {"load_s": load_s, "first_step_s": s1, "second_step_s": s2, "load_and_first_step_s": load_s + s1,
                    "shmem_held_mib": held}

        def m_dcp(rep):
            m, o = fresh(rep + 1)
            t = time.perf_counter()
            msd, osd = get_state_dict(m, o)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
            set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)
            load_s = time.perf_counter() - t
            assert cb.digest(m, o) == want
            del msd, osd
            held = shmem_mib()
            s1, s2 = steps(m, o)
            return {"load_s": load_s, "first_step_s": s1, "second_step_s": s2, "load_and_first_step_s": load_s + s1,
                    "shmem_held_mib": held}

        methods = [("elastic_run.load into a fresh model and Adam (restored in /dev/shm)", m_er),
                   ("dcp.load via get_state_dict/set_state_dict into a fresh model and Adam (file)", m_dcp)]
        for rep in range(-1, a.reps):
            for name, fn in methods if rep % 2 else methods[::-1]:
                gc.collect()
                base_shm = shmem_mib()
                r = fn(rep)
                r["shmem_held_mib"] -= base_shm
                if rep >= 0:
                    print(json.dumps({"bench": "fresh-load", "size_gib": a.size_gib, "state_bytes": nbytes,
                                      "method": name, "rep": rep, **r}), flush=True)
                print(f"[bench] fresh-load rep {rep}: {name}: "
                      + ", ".join(f"{k}={v:.3f}" for k, v in r.items()), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def shmem_mib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    main()
