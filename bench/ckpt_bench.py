"""Checkpoint benchmarks, torch side: one child process per state size, run by bench/suite.py.

    python bench/ckpt_bench.py stall|durable|restore --size-gib G --reps N [--warmup 1] \
        [--staging-dir /dev/shm] [--disk-dir /tmp] [--s3]
    python bench/ckpt_bench.py dcp-s3-once --size-gib G --url s3://BUCKET/PATH   (durable's
        child for dcp.save to S3: s3fs comes first on its path, see common.ensure_s3fs)
    python bench/ckpt_bench.py dcp-s3-load-once --size-gib G --url s3://BUCKET/PATH
        (restore's child for dcp.load from S3 through s3fs, of what dcp-s3-once saved)

Prints one JSON object per measurement on stdout (progress on stderr). Methods alternate within
every repetition (the order rotates by one each time) and every one gets the same state object.

The state: L x nn.Linear(2048, 2048) (fp32) and its Adam state after one step with random
gradients, i.e. model + exp_avg + exp_avg_sq = 3 x the parameters; L is chosen so the total is
--size-gib. Rust tools come from $ELASTIC_CKPT and $BENCH_STORE (bench/build.sh).
"""
import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, os.path.join(common.REPO, "runtime", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import elastic_run as er  # noqa: E402
from elastic_run import _load_from  # noqa: E402

HIDDEN = 2048
LAYER_BYTES = (HIDDEN * HIDDEN + HIDDEN) * 4
BUCKET = "bench"


def emit(**kw):
    print(json.dumps(kw), flush=True)


def make_state(size_gib, seed=0):
    layers = max(1, round(size_gib * 2**30 / (3 * LAYER_BYTES)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(model, opt))
    return model, opt, layers, nbytes


def tensors_of(model, opt):
    """Every tensor of the state, in a fixed order (optimizer state by parameter index and name:
    a load may rebuild the optimizer's dicts in another order). References, not copies."""
    out = [p.data for p in model.parameters()]
    st = opt.state_dict()["state"]
    for idx in sorted(st):
        out.extend(st[idx][k] for k in sorted(st[idx]) if isinstance(st[idx][k], torch.Tensor))
    return out


def digest(model, opt):
    """A cheap fingerprint of the whole state: one strided sample of every tensor."""
    return [float(t.reshape(-1)[:: max(1, t.numel() // 4096)].double().sum()) for t in tensors_of(model, opt)]


def dcp_load_timed(model, opt, **source):
    """`dcp.load` of the state from `source` (`checkpoint_id=` or `storage_reader=`), then
    `load_state_dict` of the model and optimizer: its seconds."""
    t = time.perf_counter()
    sd = state_dict(model, opt)
    dcp.load(sd, **source)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return time.perf_counter() - t


def wipe(model, opt):
    with torch.no_grad():
        for t in tensors_of(model, opt):
            t.zero_()


def state_dict(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def init_gloo():
    # DCP's async_save needs a process group; every DCP call here then runs under it (world 1).
    if not dist.is_initialized():
        port = common.free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def rm(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def er_env(staging, rank=0, world=1):
    os.environ.pop("ELASTIC_AGENT_SOCKET", None)
    os.environ["ELASTIC_STAGING_DIR"] = staging
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)


def er_save(model, opt, staging, step, rank=0, world=1):
    er_env(staging, rank, world)
    t = time.perf_counter()
    er.save(step, model=model, optimizer=opt)
    return time.perf_counter() - t


def wait_async(resp):
    if hasattr(resp, "upload_completion"):  # AsyncSaveResponse (with an async stager)
        resp.upload_completion.result()
    else:
        resp.result()


def run_tool(argv, env=None):
    """Runs a tool; returns its wall time and its last JSON line, with the CPU seconds (user +
    system) it used added as `cpu_s`."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr[-2000:]}")
    js = common.json_lines(p.stdout)
    out = dict(js[-1]) if js else {}
    out["cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return dt, out


def tool(name):
    p = os.environ.get(name)
    if not p or not os.path.exists(p):
        raise SystemExit(f"${name} is not set to a built binary: run bench/build.sh")
    return p


def s3_env(svc):
    env = dict(os.environ)
    env.update(svc.env)
    return env


def s3_clear(svc, prefix):
    """Deletes every object under prefix (keeps moto's memory flat between repetitions)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=svc.env["AWS_ENDPOINT"], aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    token = None
    while True:
        kw = {"Bucket": BUCKET, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        r = s3.list_objects_v2(**kw)
        keys = [{"Key": o["Key"]} for o in r.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
        if not r.get("IsTruncated"):
            break
        token = r["NextContinuationToken"]


# --- stall ------------------------------------------------------------------------------------


# Rows of the training step the stall benchmark runs between saves.
STALL_BATCH = 32


def bench_stall(a, model, opt, base):
    """Each measurement: two plain training steps, the save, two more steps. "stall" is how
    long the save call blocks; "blocked" what the save cost training in all: the call plus how
    much longer the two steps after it took than the two before (an async save's write competes
    with them for the cores, and opt.step() waits for elastic_run.async_save's write)."""
    init_gloo()
    torch.set_flush_denormal(True)  # a deep linear stack's activations shrink towards denormals
    x = torch.randn(STALL_BATCH, HIDDEN)
    seq = [0]

    def train_step():
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t

    def measured(save, finish=None):
        before = train_step() + train_step()
        t = time.perf_counter()
        handle = save()
        call = time.perf_counter() - t
        after = train_step() + train_step()
        r = {"stall_s": call, "blocked_s": call + after - before, "step_s": before / 2}
        if finish is not None:
            finish(handle)
            r["done_s"] = time.perf_counter() - t
        return r

    def out(name):
        seq[0] += 1
        return os.path.join(base, f"{name}-{seq[0]}")

    def m_er():
        d = out("er")
        er_env(d)
        r = measured(lambda: er.save(seq[0], model=model, optimizer=opt))
        return {**r, "_rm": d}

    def m_er_async():
        d = out("era")
        er_env(d)
        r = measured(lambda: er.async_save(seq[0], model=model, optimizer=opt), lambda p: p.wait())
        return {**r, "_rm": d}

    def m_dcp():
        d = out("dcp")
        return {**measured(lambda: dcp.save(state_dict(model, opt), checkpoint_id=d)), "_rm": d}

    def m_dcp_async():
        d = out("dcpa")
        r = measured(lambda: dcp.async_save(state_dict(model, opt), checkpoint_id=d), wait_async)
        return {**r, "_rm": d}

    def m_torch():
        f = out("ts") + ".pt"
        return {**measured(lambda: torch.save(state_dict(model, opt), f)), "_rm": f}

    methods = [("elastic_run.save", m_er), ("elastic_run.async_save", m_er_async), ("dcp.save", m_dcp),
               ("dcp.async_save", m_dcp_async), ("torch.save", m_torch)]
    return methods


# --- durable ----------------------------------------------------------------------------------


def bench_durable(a, model, opt, base, disk, moto):
    init_gloo()
    ckpt, store = tool("ELASTIC_CKPT"), tool("BENCH_STORE")
    # The bytes the raw baseline uploads: one staged snapshot, as the agent would upload it.
    ref = os.path.join(base, "ref")
    er_save(model, opt, ref, 0)
    ref_file = os.path.join(ref, "step-0", "rank-0", "tensors.safetensors")
    seq = [0]

    def nxt():
        seq[0] += 1
        return seq[0]

    def m_er(url_of, env=None, compress="auto", cleanup=None):
        def run():
            n = nxt()
            staging = os.path.join(base, f"er-{n}")
            stall = er_save(model, opt, staging, n)
            url = url_of(n)
            argv = [ckpt, "--json", "--concurrency", "4", "push", os.path.join(staging, f"step-{n}"), url,
                    "--step", str(n)]
            argv += ["--compress", compress]
            push, js = run_tool(argv, env)
            rm(staging)
            if cleanup:
                cleanup(n)
            return {"durable_s": stall + push, "stall_s": stall, "upload_s": push, "uploader_cpu_s": js["cpu_s"],
                    "stored_bytes": js.get("stored_bytes"), "raw_bytes": js.get("raw_bytes")}
        return run

    def m_raw(url_of, env=None, cleanup=None):
        def run():
            n = nxt()
            dt, js = run_tool([store, "raw-put", url_of(n), ref_file], env)
            if cleanup:
                cleanup(n)
            return {"durable_s": js["seconds"], "process_s": dt, "uploader_cpu_s": js["cpu_s"],
                    "stored_bytes": js["bytes"]}
        return run

    def m_dcp():
        n = nxt()
        d = os.path.join(disk, f"dcp-{n}")
        t = time.perf_counter()
        dcp.save(state_dict(model, opt), checkpoint_id=d)
        dt = time.perf_counter() - t
        rm(d)
        return {"durable_s": dt, "stall_s": dt}

    def m_dcp_async():
        n = nxt()
        d = os.path.join(disk, f"dcpa-{n}")
        t = time.perf_counter()
        resp = dcp.async_save(state_dict(model, opt), checkpoint_id=d)
        blocked = time.perf_counter() - t
        wait_async(resp)
        dt = time.perf_counter() - t
        rm(d)
        return {"durable_s": dt, "stall_s": blocked}

    def m_torch():
        n = nxt()
        f = os.path.join(disk, f"ts-{n}.pt")
        t = time.perf_counter()
        torch.save(state_dict(model, opt), f)
        fsync_path(f)
        dt = time.perf_counter() - t
        rm(f)
        return {"durable_s": dt, "stall_s": dt}

    def file_url(kind):
        return lambda n: f"file://{disk}/{kind}-{n}"

    def file_rm(kind):
        return lambda n: rm(os.path.join(disk, f"{kind}-{n}"))

    def m_dcp_s3(env):
        # In a child process of its own (s3fs's botocore is not the venv's), which builds the
        # same state from the same seed; only its dcp.save is timed.
        deps = common.ensure_s3fs()
        child_env = dict(env)
        child_env["PYTHONPATH"] = deps + os.pathsep + child_env.get("PYTHONPATH", "")

        def run():
            n = nxt()
            prefix = f"dcp-{n}"
            _, js = run_tool([sys.executable, os.path.abspath(__file__), "dcp-s3-once", "--size-gib",
                              str(a.size_gib), "--url", f"s3://{BUCKET}/{prefix}"], child_env)
            s3_clear(moto, prefix + "/")
            if js.get("state_bytes") != state_bytes:
                raise RuntimeError(f"dcp-s3-once built {js.get('state_bytes')} bytes, not {state_bytes}")
            return {"durable_s": js["durable_s"], "stall_s": js["durable_s"], "uploader_cpu_s": js["save_cpu_s"]}
        return run

    state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(model, opt))
    methods = [
        ("elastic_run.save + checkpoint push (file)", m_er(file_url("er"), cleanup=file_rm("er"))),
        ("same, compressed (file)", m_er(file_url("erc"), compress="always", cleanup=file_rm("erc"))),
        ("raw object_store put (file)", m_raw(file_url("raw"), cleanup=file_rm("raw"))),
        ("dcp.save (file)", m_dcp),
        ("dcp.async_save, until done (file)", m_dcp_async),
        ("torch.save + fsync (file)", m_torch),
    ]
    if moto is not None:
        env = s3_env(moto)
        methods += [
            ("elastic_run.save + checkpoint push (s3)",
             m_er(lambda n: f"s3://{BUCKET}/er-{n}", env, cleanup=lambda n: s3_clear(moto, f"er-{n}/"))),
            ("raw object_store put (s3)",
             m_raw(lambda n: f"s3://{BUCKET}/raw-{n}", env, cleanup=lambda n: s3_clear(moto, f"raw-{n}/"))),
            ("dcp.save (s3, fsspec s3fs)", m_dcp_s3(env)),
        ]
    return methods, ref


def fsspec_s3_options():
    """fsspec (s3fs) options for the S3 endpoint and keys in $AWS_ENDPOINT and friends."""
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT"],
                              "region_name": os.environ.get("AWS_REGION", "us-east-1")}}


def dcp_s3_load_once(a):
    """Builds the state (the same seed as the parent's), zeroes it, and times one dcp.load of
    it from S3 through fsspec (s3fs), then load_state_dict, as the file:// row loads it. The
    loaded state is checked against the one built."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    model, opt, _, nbytes = make_state(a.size_gib)
    want = digest(model, opt)
    wipe(model, opt)
    reader = FsspecReader(a.url, **fsspec_s3_options())
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    dt = dcp_load_timed(model, opt, storage_reader=reader)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    if digest(model, opt) != want:
        raise RuntimeError("dcp.load from S3 gave a state that differs from the saved one")
    emit(restore_s=dt, state_bytes=nbytes,
         load_cpu_s=(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))


def dcp_s3_once(a):
    """Builds the state and times one dcp.save of it to S3 through fsspec (s3fs), single file
    per rank like the file:// rows. Endpoint and keys come from $AWS_ENDPOINT and friends."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    model, opt, _, nbytes = make_state(a.size_gib)
    writer = FsspecWriter(a.url, **fsspec_s3_options())
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    dcp.save(state_dict(model, opt), storage_writer=writer)
    dt = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    emit(durable_s=dt, state_bytes=nbytes,
         save_cpu_s=(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))


# --- restore ----------------------------------------------------------------------------------


def drop_caches():
    """Writes dirty pages back and drops the clean page cache, so the next read of a local disk
    is cold (tmpfs, where staging lives, is memory and stays). Needs root."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        raise RuntimeError(f"a cold-cache run needs to write /proc/sys/vm/drop_caches (root): {e}") from None


def bench_restore(a, model, opt, base, disk, moto):
    init_gloo()
    ckpt, store = tool("ELASTIC_CKPT"), tool("BENCH_STORE")
    want = digest(model, opt)
    # Setup, untimed: step 1 saved by a world of 2 (each rank writes half), committed as the
    # agent would (world size 2, the trainer's JSON state in the manifest); the same state
    # through dcp.save and torch.save.
    staging = os.path.join(base, "saved")
    for r in (0, 1):
        er_save(model, opt, staging, 1, rank=r, world=2)
    with open(os.path.join(staging, "step-1", "rank-0", "meta.json")) as f:
        meta_state = json.load(f)["state"]
    md = json.dumps({"state": meta_state})
    urls = {"file": f"file://{disk}/ckpt"}
    run_tool([ckpt, "--json", "--concurrency", "4", "push", os.path.join(staging, "step-1"), urls["file"],
              "--step", "1", "--world-size", "2", "--metadata", md])
    env = None
    if moto is not None:
        env = s3_env(moto)
        urls["s3"] = f"s3://{BUCKET}/ckpt"
        run_tool([ckpt, "--json", "--concurrency", "4", "push", os.path.join(staging, "step-1"), urls["s3"],
                  "--step", "1", "--world-size", "2", "--metadata", md], env)
        # The same step with raw chunks (`--no-compress`).
        urls["s3-raw"] = f"s3://{BUCKET}/ckpt-raw"
        run_tool([ckpt, "--json", "--concurrency", "4", "push", os.path.join(staging, "step-1"), urls["s3-raw"],
                  "--step", "1", "--world-size", "2", "--metadata", md, "--no-compress"], env)
    rm(staging)
    urls["dcp-s3"] = f"s3://{BUCKET}/dcp"
    # The same tensors as FSDP-style row shards (each of 2 ranks holds half the rows of every
    # tensor of 2+ rows, declared in __metadata__["elastic.shards"]), for resharded reads.
    from safetensors.torch import save_file

    flat, _ = er._flatten(model, opt, None)
    sharded = os.path.join(base, "sharded")
    os.makedirs(sharded)
    for r in (0, 1):
        part, spec = {}, {}
        for k, t in flat.items():
            if t.dim() >= 1 and t.shape[0] >= 2:
                lo, hi = t.shape[0] * r // 2, t.shape[0] * (r + 1) // 2
                part[k] = t[lo:hi].contiguous()
                spec[k] = {"global_shape": list(t.shape), "dim0_offset": lo}
            elif r == 0:
                part[k] = t.detach().clone()
        save_file(part, os.path.join(sharded, f"rank-{r}.safetensors"), metadata={"elastic.shards": json.dumps(spec)})
        del part
    urls["sharded"] = f"file://{disk}/ckpt-sharded"
    run_tool([ckpt, "--json", "--concurrency", "4", "push", sharded, urls["sharded"], "--step", "1",
              "--world-size", "2"])
    if moto is not None:
        # Compressed, as remote stores get it by default: read in part by decoded blocks.
        urls["sharded-s3"] = f"s3://{BUCKET}/ckpt-sharded"
        run_tool([ckpt, "--json", "--concurrency", "4", "push", sharded, urls["sharded-s3"], "--step", "1",
                  "--world-size", "2"], env)
    rm(sharded)
    dcp_dir = os.path.join(disk, "dcp")
    dcp.save(state_dict(model, opt), checkpoint_id=dcp_dir)
    ts_file = os.path.join(disk, "state.pt")
    torch.save(state_dict(model, opt), ts_file)
    os.sync()

    def check():
        got = digest(model, opt)
        if got != want:
            raise RuntimeError("restored state differs from the saved state")

    def m_er(kind, world):
        def run():
            dest = os.path.join(base, "restore")
            rm(dest)
            wipe(model, opt)
            t0 = time.perf_counter()
            _, js = run_tool([store, "restore", urls[kind], os.path.join(dest, "rank-0"), "--rank", "0",
                              "--world", str(world)], env if kind.startswith("s3") else None)
            t1 = time.perf_counter()
            er_env(base, 0, world)
            step, _ = er.load(model=model, optimizer=opt, resume_dir=dest)
            t2 = time.perf_counter()
            assert step == 1, step
            check()
            rm(dest)
            return {"restore_s": t2 - t0, "fetch_s": js["seconds"], "fetch_process_s": t1 - t0, "fetch_cpu_s": js["cpu_s"],
                    "load_s": t2 - t1, "bytes_read": js["bytes_read"], "bytes_needed": js["bytes_needed"],
                    "stored_bytes": js["step_stored_bytes"], "gets": js["gets"],
                    "fetch_rss_rise_mib": js["rss_rise_bytes"] / 2**20}
        return run

    def m_agent(kind, world, no_copy):
        """elastic-run's own resume path: the agent's restore (``StoreSink::restore``, through
        ``bench_store agent-restore``) of rank 0 of ``world``, with ``--restore-no-copy`` or
        without, then ``elastic_run.load`` from the directory it laid out."""
        def run():
            root = os.path.join(base, "agent-restore")
            rm(root)
            wipe(model, opt)
            t0 = time.perf_counter()
            _, js = run_tool([store, "agent-restore", urls[kind], root, "--step", "1", "--rank", "0",
                              "--world", str(world)] + (["--no-copy"] if no_copy else []),
                             env if kind.startswith("s3") else None)
            t1 = time.perf_counter()
            er_env(base, 0, world)
            step, _ = er.load(model=model, optimizer=opt, resume_dir=js["dir"])
            t2 = time.perf_counter()
            assert step == 1, step
            if kind == "file" and js["copied"] == no_copy:
                raise RuntimeError(f"the agent's restore copied={js['copied']} with no_copy={no_copy}")
            check()
            rm(root)
            return {"restore_s": t2 - t0, "fetch_s": js["seconds"], "fetch_process_s": t1 - t0, "load_s": t2 - t1}
        return run

    def m_from(kind, world, into=True):
        """elastic_run.load_from(URL): the restore (elastic-ckpt restore --events) with the
        load overlapped, read into the model and optimizer. From S3 the restore writes into
        the tensors (--into-parent); with `into` False it writes a file into `base`, which
        the load reads."""
        def run():
            wipe(model, opt)
            er_env(base, 0, world)
            before = dict(os.environ)
            os.environ["ELASTIC_CKPT"] = ckpt
            if kind.startswith("s3"):
                os.environ.update(env)
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            try:
                t0 = time.perf_counter()
                with mock.patch.object(_load_from, "_INTO_PROCESS", into):
                    step = er.load_from(urls[kind], {"model": model, "optimizer": opt}, work_dir=base)
                dt = time.perf_counter() - t0
            finally:
                os.environ.clear()
                os.environ.update(before)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            assert step == 1, step
            check()
            return {"restore_s": dt, "fetch_cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)}
        return run

    def m_dcp():
        wipe(model, opt)
        r0 = common.io_read_bytes()
        dt = dcp_load_timed(model, opt, checkpoint_id=dcp_dir)
        check()
        return {"restore_s": dt, "bytes_read": common.io_read_bytes() - r0}

    def m_dcp_s3():
        """dcp.load from S3 through s3fs, timed in a child process (dcp_s3_load_once). Its first
        run saves the checkpoint, untimed: dcp.save through fsspec's s3fs in a child process
        (s3fs's botocore is not the venv's) that builds the same state from the same seed."""
        child_env = None

        def run():
            nonlocal child_env
            if child_env is None:
                child_env = dict(env)
                child_env["PYTHONPATH"] = common.ensure_s3fs() + os.pathsep + child_env.get("PYTHONPATH", "")
                run_tool([sys.executable, os.path.abspath(__file__), "dcp-s3-once", "--size-gib", str(a.size_gib),
                          "--url", urls["dcp-s3"]], child_env)
            _, js = run_tool([sys.executable, os.path.abspath(__file__), "dcp-s3-load-once", "--size-gib",
                              str(a.size_gib), "--url", urls["dcp-s3"]], child_env)
            return {"restore_s": js["restore_s"], "fetch_cpu_s": js["load_cpu_s"]}
        return run

    def m_torch():
        wipe(model, opt)
        r0 = common.io_read_bytes()
        t = time.perf_counter()
        sd = torch.load(ts_file, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        dt = time.perf_counter() - t
        del sd
        check()
        return {"restore_s": dt, "bytes_read": common.io_read_bytes() - r0}

    def m_shard(world, kind="sharded"):
        def run():
            dest = os.path.join(base, "restore-sharded")
            _, js = run_tool([store, "restore", urls[kind], dest, "--rank", "0", "--world", str(world)],
                             env if kind == "sharded-s3" else None)
            rm(dest)
            return {"restore_s": js["seconds"], "fetch_s": js["seconds"], "bytes_read": js["bytes_read"],
                    "bytes_needed": js["bytes_needed"], "stored_bytes": js["step_stored_bytes"], "gets": js["gets"]}
        return run

    def m_raw(kind, stream=False):
        def run():
            dt, js = run_tool([store, "raw-get", urls[kind]] + (["--stream"] if stream else []),
                              env if kind.startswith("s3") else None)
            return {"restore_s": js["seconds"], "bytes_read": js["bytes"]}
        return run

    def cold(fn):
        def run():
            drop_caches()
            return fn()
        return run

    def s3_warm(kind, fn):
        # moto keeps large objects in files on the local disk, which the cold rows' cache
        # drop evicts: every S3 row reads its objects once, untimed, first, so that each
        # restore and each raw get is served from a warm moto.
        def run():
            run_tool([store, "raw-get", urls[kind]], env)
            return fn()
        return run

    methods = [
        ("checkpoint restore + elastic_run.load, world 2->2 (file)", m_er("file", 2)),
        ("checkpoint restore + elastic_run.load, world 2->2 (file, cold cache)", cold(m_er("file", 2))),
        ("elastic_run.load_from, world 2->2 (file, cold cache)", cold(m_from("file", 2))),
        ("agent restore --restore-no-copy + elastic_run.load, world 2->2 (file, cold cache)",
         cold(m_agent("file", 2, True))),
        ("dcp.load (file, cold cache)", cold(m_dcp)),
        ("raw object_store get of the step (file, cold cache)", cold(m_raw("file"))),
        ("elastic_run.load_from, world 2->2 (file)", m_from("file", 2)),
        ("agent restore --restore-no-copy + elastic_run.load, world 2->2 (file)", m_agent("file", 2, True)),
        ("agent restore + elastic_run.load, world 2->2 (file)", m_agent("file", 2, False)),
        ("checkpoint restore + elastic_run.load, world 2->3 (file)", m_er("file", 3)),
        ("raw object_store get of the step (file)", m_raw("file")),
        ("checkpoint restore only, row-sharded state, world 2->2 (file)", m_shard(2)),
        ("checkpoint restore only, row-sharded state, world 2->3 (file)", m_shard(3)),
        ("dcp.load (file)", m_dcp),
        ("torch.load (file)", m_torch),
    ]
    if moto is not None:
        methods += [
            ("checkpoint restore + elastic_run.load, world 2->2 (s3)", s3_warm("s3", m_er("s3", 2))),
            ("checkpoint restore + elastic_run.load, world 2->3 (s3)", s3_warm("s3", m_er("s3", 3))),
            ("elastic_run.load_from, world 2->2 (s3)", s3_warm("s3", m_from("s3", 2))),
            ("elastic_run.load_from through a file, world 2->2 (s3)", s3_warm("s3", m_from("s3", 2, into=False))),
            ("raw object_store get of the step (s3)", s3_warm("s3", m_raw("s3"))),
            ("raw object_store get of the step, streamed (s3)", s3_warm("s3", m_raw("s3", stream=True))),
            ("dcp.load (s3, fsspec s3fs)", s3_warm("dcp-s3", m_dcp_s3())),
            ("checkpoint restore + elastic_run.load, world 2->2 (s3, raw chunks)",
             s3_warm("s3-raw", m_er("s3-raw", 2))),
            ("elastic_run.load_from, world 2->2 (s3, raw chunks)", s3_warm("s3-raw", m_from("s3-raw", 2))),
            ("elastic_run.load_from through a file, world 2->2 (s3, raw chunks)",
             s3_warm("s3-raw", m_from("s3-raw", 2, into=False))),
            ("raw object_store get of the step (s3, raw chunks)", s3_warm("s3-raw", m_raw("s3-raw"))),
            ("raw object_store get of the step, streamed (s3, raw chunks)",
             s3_warm("s3-raw", m_raw("s3-raw", stream=True))),
            ("checkpoint restore only, row-sharded state, world 2->2 (s3, compressed)",
             s3_warm("sharded-s3", m_shard(2, "sharded-s3"))),
            ("checkpoint restore only, row-sharded state, world 2->3 (s3, compressed)",
             s3_warm("sharded-s3", m_shard(3, "sharded-s3"))),
        ]
    return methods


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bench", choices=["stall", "durable", "restore", "dcp-s3-once", "dcp-s3-load-once"])
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--staging-dir", default="/dev/shm")
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--s3", action="store_true")
    p.add_argument("--url", help="dcp-s3-once: where to save; dcp-s3-load-once: where to load from")
    p.add_argument("--only", default=None,
                   help="run only the methods whose name holds this text (e.g. 's3')")
    p.add_argument("--skip", default=None,
                   help="leave out the methods whose name holds this text (e.g. 'dcp.load (s3')")
    a = p.parse_args()
    if a.bench == "dcp-s3-once":
        return dcp_s3_once(a)
    if a.bench == "dcp-s3-load-once":
        return dcp_s3_load_once(a)

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    base = os.path.join(a.staging_dir, f"elastic-bench-{os.getpid()}")
    disk = os.path.join(a.disk_dir or os.environ.get("TMPDIR", "/tmp"), f"elastic-bench-{os.getpid()}")
    os.makedirs(base, exist_ok=True)
    os.makedirs(disk, exist_ok=True)
    moto = None
    try:
        t = time.perf_counter()
        model, opt, layers, nbytes = make_state(a.size_gib)
        common.log(f"{a.bench}: state of {nbytes / 2**30:.3f} GiB ({layers} layers) built in "
                   f"{time.perf_counter() - t:.1f} s")
        if a.s3:
            moto = common.start_moto(BUCKET)
        if a.bench == "stall":
            methods = bench_stall(a, model, opt, base)
        elif a.bench == "durable":
            methods, _ = bench_durable(a, model, opt, base, disk, moto)
        else:
            methods = bench_restore(a, model, opt, base, disk, moto)
        if a.only:
            methods = [(n, f) for n, f in methods if a.only in n]
        if a.skip:
            methods = [(n, f) for n, f in methods if a.skip not in n]
        for rep in range(-a.warmup, a.reps):
            for name, fn in common.rotate(methods, rep):
                gc.collect()
                os.sync()  # no write-back of the previous method lands in this one
                r = fn()
                for k in [k for k in r if k.startswith("_")]:
                    rm(r.pop(k))
                if rep >= 0:
                    emit(bench=a.bench, size_gib=a.size_gib, state_bytes=nbytes, method=name, rep=rep, **r)
                common.log(f"{a.bench} {a.size_gib} GiB rep {rep}: {name}: "
                           + ", ".join(f"{k}={v:.3f}" for k, v in r.items() if isinstance(v, float)))
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
