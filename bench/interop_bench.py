"""Interop benchmarks, torch side, run by bench/suite.py:

    python bench/interop_bench.py fsdp --size-gib G --reps N [--warmup 1] [--staging-dir /dev/shm] [--disk-dir /tmp]
    python bench/interop_bench.py export --size-gib G --reps N [--warmup 1] [--disk-dir /tmp]

`fsdp`: an FSDP2 model (`fully_shard` per layer, gloo on CPU, 2 ranks as 2 processes) and its
AdamW state after one step: L x nn.Linear(2048, 2048) with 3 x the parameters' bytes in all, L
chosen so the total is --size-gib. Each rank holds half of every tensor. Side by side, the
methods alternating within every repetition:
- save until durable: `elastic_run.save` of each rank's local shards into staging, then the
  step committed to a `file://` store (`elastic-ckpt push`, the agent's upload and commit path),
  against `dcp.save` of the same DTensor state (its FileSystemWriter fsyncs);
- restore into the model: `elastic-ckpt restore` of each rank's rows plus `elastic_run.load`
  (the agent's path), the agent's own restore with `--restore-no-copy` (`bench_store
  agent-restore --no-copy`: each rank's rows checked where they lie, `sources.json` written)
  plus `elastic_run.load`, and `elastic_run.load_from(URL)` (the store's raw chunks checked
  where they lie and read into the model), against `dcp.load` plus `set_state_dict`. Every
  restore is checked against the saved local shards, bitwise.

`export`: one model's weights (L x nn.Linear(2048, 2048), --size-gib of parameters), committed
by `elastic_run.save`; `elastic-ckpt export` to Hugging Face safetensors against what a DCP user
does for the same files: `dcp.load` of the step into freshly allocated tensors, then
`safetensors.torch.save_file`. Time and peak RSS of each (a process of its own, measured with
wait4), and both outputs checked equal.

Prints one JSON object per measurement on stdout (progress on stderr). Tools come from
$ELASTIC_CKPT and $BENCH_STORE (bench/build.sh).
"""
import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, os.path.join(common.REPO, "runtime", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import elastic_run as er  # noqa: E402

HIDDEN = 2048
LAYER_PARAM_BYTES = (HIDDEN * HIDDEN + HIDDEN) * 4


def emit(**kw):
    print(json.dumps(kw), flush=True)


def tool(name):
    p = os.environ.get(name)
    if not p or not os.path.exists(p):
        raise SystemExit(f"${name} is not set to a built binary: run bench/build.sh")
    return p


# Runs argv and prints its peak RSS in KiB as the last line of stderr. A process's ru_maxrss
# includes its life before exec, when it is a fork of its parent: measured from this small
# interpreter, the figure is the tool's own and not the benchmark's (which holds torch).
WAIT4 = r"""
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, ru = os.wait4(pid, 0)
print(f"maxrss_kib={ru.ru_maxrss}", file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_peak(argv, env=None):
    """Runs argv in a process of its own; returns (seconds, its peak RSS in bytes, stdout)."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-S", "-c", WAIT4, *argv], capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr[-2000:]}")
    last = p.stderr.strip().splitlines()[-1]
    if not last.startswith("maxrss_kib="):
        raise RuntimeError(f"{' '.join(argv)}: no peak RSS reported: {p.stderr[-500:]}")
    return dt, int(last.split("=", 1)[1]) * 1024, p.stdout


def rm(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


# --- fsdp -------------------------------------------------------------------------------------


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_reset():
    """Resets this process's peak RSS to its RSS now (Linux's clear_refs 5) and returns that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def peak_rss():
    return _status_bytes("VmHWM")


def fsdp_worker(rank, world, port, a, q):
    """One rank of the FSDP2 benchmark; rank 0 sends each measurement to q."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.pop("ELASTIC_AGENT_SOCKET", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layers = max(1, round(a.size_gib * 2**30 / (3 * LAYER_PARAM_BYTES)))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
        for m in model:
            fully_shard(m)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, HIDDEN)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

        def local_tensors():
            out = [p.to_local() for p in model.parameters()]
            for st in opt.state.values():
                out += [v.to_local() if hasattr(v, "to_local") else v for k, v in sorted(st.items())
                        if isinstance(v, torch.Tensor)]
            return out

        want = [t.clone() for t in local_tensors()]
        nbytes = torch.tensor(sum(t.numel() * t.element_size() for t in want))
        dist.all_reduce(nbytes)
        ckpt = tool("ELASTIC_CKPT")
        base = os.path.join(a.staging_dir, f"elastic-bench-fsdp-staging-{port}")
        disk = os.path.join(a.disk_dir, f"elastic-bench-fsdp-{port}")
        url = f"file://{disk}/store"
        dcp_dir = os.path.join(disk, "dcp")
        state = {"model": model, "opt": opt}

        def wipe():
            with torch.no_grad():
                for t in local_tensors():
                    t.zero_()

        def check():
            if not all(torch.equal(x, y) for x, y in zip(local_tensors(), want)):
                raise RuntimeError(f"rank {rank}: the restored state differs from the saved state")

        def timed(fn):
            dist.barrier()
            rss0 = peak_reset()
            t = time.perf_counter()
            extra = fn() or {}
            rise = peak_rss() - rss0
            # Until every rank is done.
            dist.barrier()
            return {"s": time.perf_counter() - t, "peak_rss_rise_mib": rise / 2**20, **extra}

        steps = iter(range(1, 10**6))
        saved = {}  # the step the last save committed

        def er_save():
            step = next(steps)
            os.environ["ELASTIC_STAGING_DIR"] = base
            t0 = time.perf_counter()
            er.save(step, state)
            dist.barrier()
            t1 = time.perf_counter()
            if rank == 0:
                # The store keeps only this step, as the DCP directory holds only the last save:
                # the steps before would fill the page cache over the repetitions.
                rm(os.path.join(disk, "store"))
                skeleton = json.load(open(os.path.join(base, f"step-{step}", "rank-0", "meta.json")))["state"]
                subprocess.run([ckpt, "--json", "push", os.path.join(base, f"step-{step}"), url, "--step", str(step),
                                "--world-size", str(world), "--metadata", json.dumps({"state": skeleton})],
                               check=True, capture_output=True)
            dist.barrier()
            t2 = time.perf_counter()
            rm(os.path.join(base, f"step-{step}"))
            saved["step"] = step
            return {"step": step, "stage_s": t1 - t0, "push_s": t2 - t1}

        def dcp_save():
            rm(dcp_dir)
            dist.barrier()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

        def er_restore():
            # The restore of the repetition before was removed after it, untimed.
            dest = os.path.join(base, "restore")
            wipe()
            t0 = time.perf_counter()
            subprocess.run([ckpt, "--json", "restore", url, os.path.join(dest, f"rank-{rank}"), "--rank", str(rank),
                            "--world-size", str(world)], check=True, capture_output=True)
            t1 = time.perf_counter()
            er.load(state, resume_dir=dest)
            return {"fetch_process_s": t1 - t0, "load_s": time.perf_counter() - t1}

        def er_agent_no_copy():
            # The agent's own restore (StoreSink) with --restore-no-copy: each rank's rows
            # checked where they lie, rank-R/sources.json written, read by elastic_run.load.
            root = os.path.join(base, "restore", f"agent-{rank}")
            wipe()
            t0 = time.perf_counter()
            p = subprocess.run([tool("BENCH_STORE"), "agent-restore", url, root, "--step", str(saved["step"]),
                                "--rank", str(rank), "--world", str(world), "--no-copy"],
                               check=True, capture_output=True, text=True)
            js = json.loads(p.stdout.strip().splitlines()[-1])
            if js["copied"]:
                raise RuntimeError("the agent's restore wrote the state file with --no-copy")
            t1 = time.perf_counter()
            er.load(state, resume_dir=js["dir"])
            return {"fetch_process_s": t1 - t0, "load_s": time.perf_counter() - t1}

        def er_load_from():
            # Each rank's rows, from the store straight into the model (a file:// store of raw
            # chunks: checked where they lie, nothing staged).
            wipe()
            t0 = time.perf_counter()
            er.load_from(url, state, work_dir=base)
            return {"load_from_s": time.perf_counter() - t0}

        def dcp_restore():
            wipe()
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=dcp_dir)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        methods = [("elastic_run.save + commit (file)", "save", er_save), ("dcp.save (file)", "save", dcp_save)]
        restores = [("elastic-ckpt restore + elastic_run.load, 2->2 (file)", "restore", er_restore),
                    ("agent restore --restore-no-copy + elastic_run.load, 2->2 (file)", "restore",
                     er_agent_no_copy),
                    ("elastic_run.load_from, 2->2 (file)", "restore", er_load_from),
                    ("dcp.load + set_state_dict, 2->2 (file)", "restore", dcp_restore)]
        for rep in range(-a.warmup, a.reps):
            for name, kind, fn in common.rotate(methods, rep):
                gc.collect()
                os.sync()
                r = timed(fn)
                if rank == 0 and rep >= 0:
                    q.put({"bench": "fsdp", "size_gib": a.size_gib, "state_bytes": int(nbytes), "method": name,
                           "kind": kind, "rep": rep, "world": world, "seconds": r["s"],
                           **{k: v for k, v in r.items() if k != "s"}})
            # Restores read what the last saves wrote (both stores hold the same state).
            for name, kind, fn in common.rotate(restores, rep):
                gc.collect()
                r = timed(fn)
                check()
                if rank == 0:
                    rm(os.path.join(base, "restore"))
                dist.barrier()
                if rank == 0 and rep >= 0:
                    q.put({"bench": "fsdp", "size_gib": a.size_gib, "state_bytes": int(nbytes), "method": name,
                           "kind": kind, "rep": rep, "world": world, "seconds": r["s"],
                           **{k: v for k, v in r.items() if k != "s"}})
        dist.barrier()
        if rank == 0:
            rm(base)
            rm(disk)
    finally:
        dist.destroy_process_group()


def bench_fsdp(a):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = common.free_port()
    procs = [ctx.Process(target=fsdp_worker, args=(r, 2, port, a, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"fsdp ranks exited {[p.exitcode for p in procs]}")
    while not q.empty():
        emit(**q.get())


# --- export -----------------------------------------------------------------------------------

# A DCP user's export, as its own process: the step's tensors allocated from DCP's metadata,
# loaded with dcp.load (no process group), written with safetensors' save_file, fsynced.
DCP_EXPORT = r"""
import os, sys
import torch, torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
src, out = sys.argv[1], sys.argv[2]
md = dcp.FileSystemReader(src).read_metadata()
sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
      if hasattr(v, "size")}
dcp.load(sd, checkpoint_id=src)
save_file(sd, out, metadata={"format": "pt"})
fd = os.open(out, os.O_RDONLY); os.fsync(fd); os.close(fd)
"""


def same_tensors(a_files, b_files):
    from safetensors import safe_open

    def load(files):
        out = {}
        for f in files:
            with safe_open(f, framework="pt") as sf:
                for k in sf.keys():
                    out[k] = sf.get_tensor(k)
        return out

    x, y = load(a_files), load(b_files)
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def bench_export(a):
    ckpt = tool("ELASTIC_CKPT")
    disk = os.path.join(a.disk_dir, f"elastic-bench-export-{os.getpid()}")
    base = os.path.join(a.staging_dir, f"elastic-bench-export-staging-{os.getpid()}")
    os.makedirs(disk)
    try:
        layers = max(1, round(a.size_gib * 2**30 / LAYER_PARAM_BYTES))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        os.environ.update(ELASTIC_STAGING_DIR=base, RANK="0", WORLD_SIZE="1")
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        er.save(1, {"model": model})
        skeleton = json.load(open(os.path.join(base, "step-1", "rank-0", "meta.json")))["state"]
        url = f"file://{disk}/store"
        subprocess.run([ckpt, "--json", "push", os.path.join(base, "step-1"), url, "--step", "1", "--metadata",
                        json.dumps({"state": skeleton})], check=True, capture_output=True)
        rm(base)
        dcp_dir = os.path.join(disk, "dcp")
        dcp.save(model.state_dict(), checkpoint_id=dcp_dir)
        del model
        gc.collect()
        os.sync()

        def m_export():
            out = os.path.join(disk, "export-er")
            rm(out)
            dt, peak, _ = run_peak([ckpt, "--json", "export", url, out, "--key", "model"])
            files = [os.path.join(out, f) for f in sorted(os.listdir(out)) if f.endswith(".safetensors")]
            return {"seconds": dt, "peak_rss_bytes": peak, "_files": files, "_dir": out}

        def m_dcp():
            out = os.path.join(disk, "export-dcp")
            rm(out)
            os.makedirs(out)
            dt, peak, _ = run_peak([sys.executable, "-c", DCP_EXPORT, dcp_dir, os.path.join(out, "model.safetensors")])
            return {"seconds": dt, "peak_rss_bytes": peak, "_files": [os.path.join(out, "model.safetensors")],
                    "_dir": out}

        methods = [("elastic-ckpt export (file)", m_export), ("dcp.load + safetensors save_file (file)", m_dcp)]
        for rep in range(-a.warmup, a.reps):
            outs = {}
            for name, fn in common.rotate(methods, rep):
                gc.collect()
                os.sync()
                r = fn()
                outs[name] = r
                if rep >= 0:
                    emit(bench="export", size_gib=a.size_gib, state_bytes=nbytes, method=name, rep=rep,
                         seconds=r["seconds"], peak_rss_bytes=r["peak_rss_bytes"])
                common.log(f"export {a.size_gib} GiB rep {rep}: {name}: {r['seconds']:.2f} s, "
                           f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
            a_r, b_r = outs.values()
            if not same_tensors(a_r["_files"], b_r["_files"]):
                raise SystemExit("the two exports differ")
            for r in outs.values():
                rm(r["_dir"])
    finally:
        rm(disk)
        rm(base)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bench", choices=["fsdp", "export"])
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--staging-dir", default="/dev/shm")
    p.add_argument("--disk-dir", default=os.environ.get("TMPDIR", "/tmp"))
    a = p.parse_args()
    if a.bench == "fsdp":
        bench_fsdp(a)
    else:
        bench_export(a)


if __name__ == "__main__":
    main()
