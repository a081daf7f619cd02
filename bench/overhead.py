"""Launcher overhead: CPU time and memory of the launcher (elastic-run's agent, or torchrun's
agent process) against its 2 workers while a standalone run of examples/ddp_train.py trains.

    python bench/overhead.py --system elastic|elastic-nockpt|torchrun [--steps 2000] [--step-sleep 0]

One run per invocation; prints one JSON object on stdout. /proc/PID/stat of the launcher and
of every descendant is sampled every --sample-ms; the training window runs from the first to
the last `step N` line rank 0 prints, and CPU figures are deltas over that window (so start-up,
torch imports and the final save are outside it). RSS: the launcher's peak, and the workers'
peak sum.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

STEP_RE = re.compile(r"(?:^|\] )step (\d+) loss")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True, choices=["elastic", "elastic-nockpt", "torchrun"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--checkpoint-interval", type=int, default=20)
    p.add_argument("--sample-ms", type=int, default=100)
    a = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench-overhead-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    py = os.path.join(common.VENV, "bin", "python")
    train = ["examples/ddp_train.py", "--steps", str(a.steps), "--step-sleep", str(a.step_sleep)]
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("ELASTIC_", "TORCHELASTIC_", "PET_")):
            del env[k]
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = os.path.join(common.VENV, "bin") + os.pathsep + env.get("PATH", "")
    if a.system.startswith("elastic"):
        binary = os.environ.get("ELASTIC_RUN") or os.path.join(common.REPO, "target", "release", "elastic-run")
        # Always a fresh store: the agent's default (./elastic-checkpoints) would resume a
        # previous run. Without --checkpoint-interval only the final step is saved (after the
        # measured window).
        argv = [binary, "--standalone", "--nproc-per-node", "2", "--staging-dir", os.path.join(tmp, "staging"),
                "--checkpoint-url", f"file://{tmp}/ckpt"]
        if a.system == "elastic":
            argv += ["--checkpoint-interval", str(a.checkpoint_interval)]
        argv += ["--", py, *train]
    else:
        # ddp_train.py saves its last step through elastic_run, which needs a staging dir.
        env["ELASTIC_STAGING_DIR"] = os.path.join(tmp, "staging")
        argv = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *train]

    lines = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=common.REPO,
                            start_new_session=True, bufsize=0)

    def read():
        buf = b""
        while True:
            chunk = proc.stdout.read(65536)
            if not chunk:
                break
            ts = time.monotonic()
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                lines.append((ts, raw.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples = []  # (t, launcher (cpu, rss), {pid: (cpu, rss)})
    try:
        while proc.poll() is None:
            t = time.monotonic()
            me = common.proc_stat(proc.pid)
            kids = {}
            for pid in common.children_of(proc.pid):
                st = common.proc_stat(pid)
                if st:
                    kids[pid] = (st[0], st[2])
            if me:
                samples.append((t, (me[0], me[2]), kids))
            time.sleep(a.sample_ms / 1000.0)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    steps = [(ts, int(m.group(1))) for ts, text in lines for m in [STEP_RE.search(text)] if m]
    if proc.returncode != 0 or len(steps) < 2:
        tail = "\n".join(t for _, t in lines[-30:])
        raise SystemExit(f"{a.system}: run failed (exit {proc.returncode}, {len(steps)} steps):\n{tail}")
    t0, t1 = steps[0][0], steps[-1][0]
    window = [s for s in samples if t0 <= s[0] <= t1]
    if len(window) < 2:
        raise SystemExit(f"{a.system}: training window too short to sample ({t1 - t0:.2f} s)")
    first, last = window[0], window[-1]
    dt = last[0] - first[0]
    # Workers: the launcher's descendants present in both samples (a process that appears or
    # disappears inside the window would bias the delta).
    pids = set(first[2]) & set(last[2])
    workers_cpu = sum(last[2][p][0] - first[2][p][0] for p in pids)
    launcher_cpu = last[1][0] - first[1][0]
    out = {
        "system": a.system,
        "steps": a.steps,
        "window_s": dt,
        "steps_per_s": (steps[-1][1] - steps[0][1]) / max(1e-9, t1 - t0),
        "launcher_cpu_s": launcher_cpu,
        "workers_cpu_s": workers_cpu,
        "launcher_cpu_pct": 100.0 * launcher_cpu / dt,
        "workers_cpu_pct": 100.0 * workers_cpu / dt,
        "cpu_ratio": launcher_cpu / workers_cpu if workers_cpu > 0 else None,
        "launcher_cpu_ms_per_step": 1000.0 * launcher_cpu / max(1, steps[-1][1] - steps[0][1]),
        "launcher_rss_peak_bytes": max(s[1][1] for s in samples),
        "workers_rss_peak_bytes": max(sum(r for _, r in s[2].values()) for s in window),
        "processes_in_tree": len(pids),
        "samples": len(window),
    }
    out["rss_ratio"] = out["launcher_rss_peak_bytes"] / out["workers_rss_peak_bytes"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
