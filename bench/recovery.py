"""Recovery and lost work: 3 nodes x 2 workers of examples/ddp_train.py on this machine, one node
killed (SIGKILL of the node's whole process tree, or SIGTERM to its launcher, as a preemption
does), and the time until the survivors train again plus the steps they redo.

    python bench/recovery.py --system SYSTEM --signal KILL|TERM [--steps 400] [--kill-at 25] \
        [--step-sleep 0.05] [--keep]

SYSTEM: elastic, elastic-in-place (the same, with ddp_train.py --in-place: the survivors'
workers switch to the new generation without a restart), elastic-standby (elastic with
--warm-standby: the survivors' restarted workers start in interpreters that already imported
torch; `warm_workers` counts them, `import_torch_s` is `python -c "import torch"` timed alone
before the run), torchrun-c10d (the brief's flags, torch defaults), torchrun-c10d-own-store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), torchrun-c10d-tuned (that, and last_call_timeout=1),
torchrun-etcd-v2 (torchrun's etcd backend, etcd v2 API, against etcd --enable-v2).

One run per invocation; prints one JSON object on stdout.

--join (elastic systems): once the survivors train again, a fresh node joins them. `join_*`:
from its agent's start to its generation and to its first step, and the bytes its agent read
from the checkpoint store (`restored_bytes` of its generation, `bytes` of `restored_on_demand`):
in place it joins without a restore and takes the state from the survivors.

- elastic: `elastic-run --rdzv-backend etcd-v3` on one local etcd, checkpoint every
  --checkpoint-interval steps to file://. Times come from the agents' --events-file: recovery
  = the survivors' `first_step` of the next generation (the later of the two) minus the kill
  time; steps redone = that generation's `prev_last_step - resume_step`; after a SIGTERM,
  `after_drained_commit_s` = that first step minus the commit of the victim's drained step.
  `step_ms`: the median time per step of rank 0 before the kill (the steady state, where
  elastic-in-place's vote and gradient averaging differ from DDP's).
- torchrun: `python -m torch.distributed.run --nnodes 2:3 --max-restarts 3` with its c10d
  rendezvous (the store hosted by the first node, which is never the victim), or its etcd (v2
  API) backend against etcd started with --enable-v2. ddp_train.py has no checkpoints there
  (its only save is at the last step), so a restart begins at step 1. Times come from worker
  output lines, stamped as they arrive: recovery = the first `step N` line after the kill;
  steps redone = the last step printed before the kill - (N - 1).

The victim is the last node started (never the rendezvous host of torchrun's c10d). The kill
waits until rank 0 prints step --kill-at, which is --kill-at mod --checkpoint-interval steps
after the last checkpoint.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

STEP_RE = re.compile(r"(?:^|\] )step (\d+) loss")
NODES = 3
SYSTEMS = ["elastic", "elastic-in-place", "elastic-standby", "torchrun-c10d", "torchrun-c10d-own-store", "torchrun-c10d-tuned",
           "torchrun-etcd-v2", "torchft"]
NPROC = 2
# How long one phase (start-up, recovery) may take before the run is declared failed.
PHASE_TIMEOUT_S = 180.0


def now_ms():
    return time.time() * 1000.0


class Node:
    """One launcher process in its own session; its output lines are stamped on arrival."""

    def __init__(self, name, argv, env, log_dir):
        self.name = name
        self.lines = []  # (ts_ms, text)
        self.lock = threading.Lock()
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=common.REPO, bufsize=0)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        buf = b""
        while True:
            chunk = self.proc.stdout.read(65536)
            if not chunk:
                break
            ts = now_ms()
            buf += chunk
            *done, buf = buf.split(b"\n")
            with self.lock:
                for raw in done:
                    text = raw.decode(errors="replace")
                    self.lines.append((ts, text))
                    self.log.write(f"{ts:.0f} {text}\n")
        self.log.flush()

    def lines_since(self, ts_ms):
        with self.lock:
            return [(ts, text) for ts, text in self.lines if ts >= ts_ms]

    def steps(self):
        with self.lock:
            out = []
            for ts, text in self.lines:
                m = STEP_RE.search(text)
                if m:
                    out.append((ts, int(m.group(1))))
            return out

    def tree(self):
        return [self.proc.pid] + common.children_of(self.proc.pid)

    def kill_tree(self, sig=signal.SIGKILL):
        for pid in self.tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self):
        if self.proc.poll() is None:
            self.kill_tree(signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.reader.join(timeout=5)
        self.log.close()


class NotRecovered(Exception):
    """The run ended (or timed out) without reaching what was waited for."""


def wait_for(pred, what, timeout_s=PHASE_TIMEOUT_S, nodes=(), alive=()):
    """Polls pred until it returns something true. Gives up when every process of `alive` has
    exited or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        gone = bool(alive) and all(n.proc.poll() is not None for n in alive)
        if gone or time.monotonic() > deadline:
            why = "every launcher exited" if gone else f"timed out after {timeout_s:.0f} s"
            tails = "\n".join(f"--- {n.name}:\n" + "\n".join(t[:300] for _, t in n.lines[-8:]) for n in nodes)
            raise NotRecovered(f"{why} waiting for {what}", tails)
        time.sleep(0.01)


def read_events(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def worker_env(tmp):
    return common.worker_env()


def train_cmd(a):
    cmd = [os.path.join(common.VENV, "bin", "python"), "examples/ddp_train.py", "--steps", str(a.steps),
           "--step-sleep", str(a.step_sleep)]
    if a.system == "elastic-in-place":
        cmd.append("--in-place")
    return cmd


def import_torch_s(env):
    """`python -u -c "import torch"` alone: the interpreter-and-import time a standby saves."""
    t = time.perf_counter()
    subprocess.run([os.path.join(common.VENV, "bin", "python"), "-u", "-c", "import torch"], env=env, check=True)
    return round(time.perf_counter() - t, 3)


def run_elastic(a, tmp):
    binary = os.environ.get("ELASTIC_RUN") or os.path.join(common.REPO, "target", "release", "elastic-run")
    imported_s = import_torch_s(worker_env(tmp)) if a.system == "elastic-standby" else None
    etcd = common.start_etcd()
    nodes = []
    try:
        job = f"bench-{os.getpid()}"
        ckpt = os.path.join(tmp, "ckpt")
        env = worker_env(tmp)
        events = {}

        def start_node(name):
            events[name] = os.path.join(tmp, f"{name}.events")
            argv = [binary, "--nnodes", f"2:{NODES}", "--nproc-per-node", str(NPROC),
                    "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", f"127.0.0.1:{etcd.port}",
                    "--rdzv-id", job, "--node-id", name, "--local-addr", "127.0.0.1",
                    "--rdzv-conf", f"lease_ttl_ms={a.lease_ttl_ms},settle_ms={a.settle_ms}",
                    "--checkpoint-url", f"file://{ckpt}", "--checkpoint-interval", str(a.checkpoint_interval),
                    "--staging-dir", os.path.join(tmp, f"staging-{name}"), "--events-file", events[name],
                    *(["--warm-standby"] if a.system == "elastic-standby" else []),
                    "--", *train_cmd(a)]
            nodes.append(Node(name, argv, env, tmp))
            return nodes[-1]

        for k in range(NODES):
            start_node(f"node{k}")
        victim, survivors = nodes[-1], nodes[:-1]

        def all_events():
            return {n: read_events(p) for n, p in events.items()}

        def full_world():
            ev = all_events()
            gens = [e for e in ev["node0"] if e["event"] == "generation" and e.get("world_size") == NODES * NPROC]
            return gens[-1] if gens else None

        g_full = wait_for(full_world, f"a generation of world {NODES * NPROC}", nodes=nodes)

        def reached():
            for n in nodes:
                for ts, s in n.steps():
                    if ts >= g_full["ts_ms"] and s >= a.kill_at:
                        return s
            return None

        wait_for(reached, f"step {a.kill_at}", nodes=nodes)
        t_kill = now_ms()
        step_ms = steady_step_ms(rank0_node(nodes, t_kill), g_full["ts_ms"], t_kill)
        if a.signal == "KILL":
            victim.kill_tree(signal.SIGKILL)
        else:
            os.kill(victim.proc.pid, signal.SIGTERM)
        last_before = max((s for n in nodes for ts, s in n.steps() if ts <= t_kill), default=0)

        def recovered():
            ev = all_events()
            out = {}
            for n in survivors:
                gens = [e for e in ev[n.name] if e["event"] == "generation" and e["ts_ms"] >= t_kill
                        and e.get("world_size") == (NODES - 1) * NPROC]
                if not gens:
                    return None
                g = gens[0]
                firsts = [e for e in ev[n.name] if e["event"] == "first_step" and e["generation"] == g["generation"]]
                starts = [e for e in ev[n.name] if e["event"] == "workers_started" and e["generation"] == g["generation"]]
                # In place, no worker group starts: the generation's own record stands for it.
                if not firsts or not (starts or g.get("in_place")):
                    return None
                out[n.name] = (g, firsts[0], starts[0] if starts else g)
            return out

        rec = wait_for(recovered, "the survivors' first step in a smaller generation", nodes=nodes,
                       alive=survivors)
        ev = all_events()
        g = next(iter(rec.values()))[0]
        first_ms = max(f["ts_ms"] for _, f, _ in rec.values())
        gen_ms = max(gg["ts_ms"] for gg, _, _ in rec.values())
        started_ms = max(w["ts_ms"] for _, _, w in rec.values())
        drain = [e for e in ev[victim.name] if e["event"] == "drain_started"]
        commits = [e["step"] for n in ev for e in ev[n] if e["event"] == "checkpoint_committed" and e["ts_ms"] <= t_kill]
        prev_last = max(gg.get("prev_last_step") or 0 for gg, _, _ in rec.values())
        resume = g.get("resume_step") or 0
        # A drain: from the commit of the victim's drained step to the survivors' first step.
        left = [e.get("step") for e in ev[victim.name] if e["event"] == "left" and e.get("step") is not None]
        drained_commit = min((e["ts_ms"] for n in ev for e in ev[n]
                              if e["event"] == "checkpoint_committed" and left and e["step"] == left[0]), default=None)
        joined = run_joiner(a, start_node, all_events, nodes, survivors) if a.join else {}
        # The recovery's own restart (a joiner's generation restarts the survivors again).
        warm = sum(1 for n in survivors for ts, text in n.lines_since(t_kill)
                   if ts <= first_ms and "worker started from a warm standby" in text)
        return {
            **joined,
            "import_torch_s": imported_s,
            "warm_workers": warm if a.system == "elastic-standby" else None,
            "workers_to_first_step_s": (first_ms - started_ms) / 1000.0,
            "after_drained_commit_s": None if drained_commit is None else (first_ms - drained_commit) / 1000.0,
            "drained_step": left[0] if left else None,
            "step_ms": step_ms,
            "recovery_s": (first_ms - t_kill) / 1000.0,
            "new_generation_s": (gen_ms - t_kill) / 1000.0,
            "workers_started_s": (started_ms - t_kill) / 1000.0,
            "steps_redone": max(0, prev_last - resume),
            "last_step_before_kill": last_before,
            "prev_last_step": prev_last,
            "resume_step": resume,
            "first_step_after": next(iter(rec.values()))[1]["step"],
            "cold_start_s": cold_start_s(ev, g_full),
            "last_commit_before_kill": max(commits, default=None),
            "drained": bool(drain),
            "in_place": all(bool(gg.get("in_place")) for gg, _, _ in rec.values()),
        }
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def run_joiner(a, start_node, all_events, nodes, survivors):
    """A fresh node joins the survivors (back to NODES nodes): from its agent's start to its
    first step, and the bytes its agent read from the checkpoint store (a restore before its
    workers started, or one they asked for). In place, its workers take the state from the
    survivors and read nothing."""
    t_start = now_ms()
    joiner = start_node("joiner")

    # Its first step in the generation that admitted it.
    def first():
        ev = all_events()["joiner"]
        gens = [e for e in ev if e["event"] == "generation"]
        firsts = [e for e in ev if e["event"] == "first_step" and gens and e["generation"] == gens[0]["generation"]]
        return (gens[0], firsts[0], ev) if firsts else None

    g, f, ev = wait_for(first, "the joiner's first step", nodes=nodes, alive=[*survivors, joiner])
    read = (g.get("restored_bytes") or 0) + sum(e.get("bytes", 0) for e in ev if e["event"] == "restored_on_demand")
    return {
        "join_first_step_s": (f["ts_ms"] - t_start) / 1000.0,
        "join_generation_s": (g["ts_ms"] - t_start) / 1000.0,
        "join_workers_to_first_step_s": (f["ts_ms"] - g["ts_ms"]) / 1000.0,
        "join_bytes_from_store": read,
        "join_healed": g.get("heal_step") is not None and not any(e["event"] == "restored_on_demand" for e in ev),
    }


def rank0_node(nodes, until_ms):
    """The node whose output has the most step lines before ``until_ms``: the one rank 0 (which
    alone prints them) ran on, whichever node registered first."""
    return max(nodes, key=lambda n: sum(1 for ts, _ in n.steps() if ts <= until_ms))


def steady_step_ms(node, since_ms, until_ms):
    """The median time between consecutive steps rank 0 printed (on ``node``) in the full
    generation before the kill, leaving out its first 5 steps (warm-up): the steady state."""
    pts = [(ts, s) for ts, s in node.steps() if since_ms <= ts <= until_ms]
    gaps = sorted((t2 - t1) / (s2 - s1) for (t1, s1), (t2, s2) in zip(pts[5:], pts[6:]) if s2 > s1)
    return round(gaps[len(gaps) // 2], 2) if gaps else None


def cold_start_s(ev, g_full):
    """Workers started -> first step of the first full generation (the cost of starting a
    worker group at all: interpreter, torch import, process group), for comparison."""
    starts = [e["ts_ms"] for e in ev["node0"] if e["event"] == "workers_started" and e["generation"] == g_full["generation"]]
    firsts = [e["ts_ms"] for e in ev["node0"] if e["event"] == "first_step" and e["generation"] == g_full["generation"]]
    return (firsts[0] - starts[0]) / 1000.0 if starts and firsts else None


def ensure_python_etcd():
    """torchrun's etcd backends import `etcd` (PyPI python-etcd). Installed into the venv on
    first use; returns None when it works, else why not."""
    py = os.path.join(common.VENV, "bin", "python")
    ok = subprocess.run([py, "-c", "import etcd"], capture_output=True)
    if ok.returncode == 0:
        return None
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "python-etcd"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return f"pip install python-etcd failed: {p.stderr.strip()[-500:]}"
    ok = subprocess.run([py, "-c", "import etcd"], capture_output=True, text=True)
    return None if ok.returncode == 0 else f"import etcd failed: {ok.stderr.strip()[-500:]}"


def run_torchrun(a, tmp):
    etcd = None
    nodes = []
    try:
        conf = []
        if a.system == "torchrun-etcd-v2":
            why = ensure_python_etcd()
            if why:
                return {"error": why}
            etcd = common.start_etcd(enable_v2=True)
            backend, endpoint = "etcd", f"127.0.0.1:{etcd.port}"
        else:
            backend, endpoint = "c10d", f"127.0.0.1:{common.free_port()}"
        env = worker_env(tmp)
        if a.system in ("torchrun-c10d-own-store", "torchrun-c10d-tuned"):
            # torch's opt-out of sharing the rendezvous TCPStore with the workers: rank 0 of
            # every new worker group hosts a fresh store (the shared one keeps the previous
            # group's keys, see BENCHMARKS.md).
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if a.system == "torchrun-c10d-tuned":
            # The closest torchrun gets to elastic-run's settle window: last call after 1 s
            # (whole seconds) instead of 30 s.
            conf = ["--rdzv-conf", "last_call_timeout=1"]
        # ddp_train.py saves its last step through elastic_run, which needs a staging dir.
        env["ELASTIC_STAGING_DIR"] = os.path.join(tmp, "staging")
        job = f"bench-{os.getpid()}"
        for k in range(NODES):
            argv = [os.path.join(common.VENV, "bin", "python"), "-m", "torch.distributed.run",
                    "--nnodes", f"2:{NODES}", "--nproc-per-node", str(NPROC), "--rdzv-backend", backend,
                    "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--max-restarts", "3", *conf,
                    *train_cmd(a)[1:]]
            nodes.append(Node(f"node{k}", argv, env, tmp))
            if k == 0:
                time.sleep(1.0)  # node0 hosts the c10d store
        victim, survivors = nodes[-1], nodes[:-1]

        def reached():
            for n in nodes:
                for ts, s in n.steps():
                    if s >= a.kill_at:
                        return s
            return None

        wait_for(reached, f"step {a.kill_at}", nodes=nodes)
        t_kill = now_ms()
        if a.signal == "KILL":
            victim.kill_tree(signal.SIGKILL)
        else:
            os.kill(victim.proc.pid, signal.SIGTERM)
        last_before = max((s for n in nodes for ts, s in n.steps() if ts <= t_kill), default=0)

        def first_after():
            best = None
            for n in survivors:
                for ts, s in n.steps():
                    # A step line printed after the kill with a step no higher than before it:
                    # the restarted group's first step (lines still in flight at the kill, with
                    # higher numbers, are not).
                    if ts > t_kill and s <= last_before and (best is None or ts < best[0]):
                        best = (ts, s)
            return best

        ts, s = wait_for(first_after, "the survivors' first step after a restart", nodes=nodes, alive=survivors)
        restarts = sum(1 for n in survivors for _, t in n.lines if "Restarting workers" in t or "restart" in t.lower())
        return {
            "step_ms": steady_step_ms(rank0_node(nodes, t_kill), 0, t_kill),
            "recovery_s": (ts - t_kill) / 1000.0,
            "steps_redone": max(0, last_before - (s - 1)),
            "last_step_before_kill": last_before,
            "first_step_after": s,
            "resume_step": s - 1,
            "restart_log_lines": restarts,
        }
    finally:
        for n in nodes:
            n.stop()
        if etcd is not None:
            etcd.stop()


TORCHFT_VERSION = "0.2.0"


def ensure_torchft():
    """TorchFT and its lighthouse, from PyPI, in a directory of their own under target/ (its
    wheel asks for a torch the venv already has, so torch is not reinstalled). Returns the
    directory, or raises NotRecovered with why not."""
    d = os.path.join(common.REPO, "target", f"torchft-{TORCHFT_VERSION}")
    py = os.path.join(common.VENV, "bin", "python")
    env = dict(os.environ, PYTHONPATH=d)
    check = [py, "-c", "import torchft, torchft._torchft"]
    if subprocess.run(check, capture_output=True, env=env).returncode == 0:
        return d
    for what in ([f"torchft=={TORCHFT_VERSION}", "--no-deps"],
                 ["opentelemetry-exporter-otlp-proto-http>=1.39.0", "opentelemetry-sdk>=1.39.0",
                  "opentelemetry-api>=1.39.0"]):
        p = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade",
                            "--target", d, *what], capture_output=True, text=True)
        if p.returncode != 0:
            raise NotRecovered(f"pip install {what[0]} failed", p.stderr[-2000:])
    p = subprocess.run(check, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise NotRecovered("torchft does not import", p.stderr[-2000:])
    return d


def run_torchft(a, tmp):
    """TorchFT 0.2.0: its lighthouse (--min_replicas 2, --join_timeout_ms 1000), and one
    replica group per node, each a `torchrun --standalone --nproc-per-node 2` of
    bench/torchft_train.py. Recovery: the later of the surviving groups' first committed step
    after the kill. --join: a fresh group joins and heals from a live one."""
    d = ensure_torchft()
    py = os.path.join(common.VENV, "bin", "python")
    port = common.free_port()
    env = worker_env(tmp)
    env.update(PYTHONPATH=d, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")
    nodes = []
    try:
        nodes.append(Node("lighthouse", [py, "bench/torchft_lighthouse.py", "--min_replicas", "2",
                                         "--join_timeout_ms", "1000", "--bind", f"127.0.0.1:{port}"], env, tmp))

        def start_group(k):
            genv = dict(env, REPLICA_GROUP_ID=str(k))
            argv = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
                    "bench/torchft_train.py", "--steps", str(a.steps), "--step-sleep", str(a.step_sleep)]
            nodes.append(Node(f"group{k}", argv, genv, tmp))
            return nodes[-1]

        groups = [start_group(k) for k in range(NODES)]
        victim, survivors = groups[-1], groups[:-1]

        def reached():
            return max((s for g in groups for _, s in g.steps() if s >= a.kill_at), default=None)

        wait_for(reached, f"step {a.kill_at}", nodes=nodes, alive=groups)
        t_kill = now_ms()
        victim.kill_tree(signal.SIGKILL if a.signal == "KILL" else signal.SIGTERM)
        last_before = max((s for g in groups for ts, s in g.steps() if ts <= t_kill), default=0)

        def recovered():
            firsts = []
            for g in survivors:
                after = [(ts, s) for ts, s in g.steps() if ts > t_kill]
                if not after:
                    return None
                firsts.append(after[0])
            return firsts

        firsts = wait_for(recovered, "the surviving groups' first committed step", nodes=nodes, alive=survivors)
        ts = max(t for t, _ in firsts)
        first = min(s for _, s in firsts)
        out = {
            "step_ms": steady_step_ms(rank0_node(groups, t_kill), 0, t_kill),
            "recovery_s": (ts - t_kill) / 1000.0,
            "steps_redone": max(0, last_before - (first - 1)),
            "last_step_before_kill": last_before,
            "first_step_after": first,
            "resume_step": first - 1,
        }
        if a.join:
            t_start = now_ms()
            joiner = start_group(NODES)
            ts_j, _ = wait_for(lambda: next(iter(joiner.steps()), None), "the new group's first committed step",
                               nodes=nodes, alive=[*survivors, joiner])
            out.update(join_first_step_s=(ts_j - t_start) / 1000.0, join_bytes_from_store=0,
                       join_healed=any("healed from a live group" in t for _, t in joiner.lines))
        return out
    finally:
        for n in reversed(nodes):
            n.stop()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True,
                   choices=SYSTEMS)
    p.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kill-at", type=int, default=25)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--checkpoint-interval", type=int, default=10)
    p.add_argument("--lease-ttl-ms", type=int, default=3000)
    p.add_argument("--settle-ms", type=int, default=500)
    p.add_argument("--keep", action="store_true", help="keep the run's logs and files")
    p.add_argument("--join", action="store_true",
                   help="elastic systems: after the recovery, a fresh node joins; time it and count its store bytes")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-recovery-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        t = time.perf_counter()
        try:
            if a.system.startswith("elastic"):
                r = run_elastic(a, tmp)
            elif a.system == "torchft":
                r = run_torchft(a, tmp)
            else:
                r = run_torchrun(a, tmp)
            r.setdefault("recovered", "error" not in r)
        except NotRecovered as e:
            r = {"recovered": False, "error": e.args[0], "log_tail": e.args[1][-3000:]}
        r.update(system=a.system, signal=a.signal, kill_at=a.kill_at, wall_s=time.perf_counter() - t)
        if a.keep:
            r["logs"] = tmp
        print(json.dumps(r), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
