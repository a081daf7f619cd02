"""The benchmark suite: runs the named benchmarks (all by default), alternating the systems
compared within every repetition, and writes results.json and results.md (medians, ranges,
ratios to elastic-run, the machine). Run it through bench/run.sh, which builds what it needs.

    bench/run.sh [--reps 3] [--sizes 0.25,1] [--s3-sizes 0.25] [--members 10,100,1000] ... [NAME...]

NAMEs: stall durable restore recovery scale overhead fsdp export (recovery covers lost work too).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import log, summarize  # noqa: E402

BENCHES = ["stall", "durable", "restore", "recovery", "scale", "overhead", "fsdp", "export"]
HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.join(common.VENV, "bin", "python")
# Longest a single child run may take before it is killed and recorded as failed.
CHILD_TIMEOUT_S = 3600


def floats(s):
    return [float(x) for x in s.split(",") if x.strip()]


def ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def words(s):
    return [x.strip() for x in s.split(",") if x.strip()]


def child(argv, what):
    """Runs a driver; returns its JSON lines, or raises with its stderr tail."""
    log(what, "...")
    t = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, cwd=common.REPO, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what}: timed out after {CHILD_TIMEOUT_S} s")
    if p.returncode != 0:
        raise RuntimeError(f"{what}: exit {p.returncode}: {p.stderr[-3000:]}")
    log(what, f"done in {time.perf_counter() - t:.0f} s")
    return common.json_lines(p.stdout)


# --- the runs ---------------------------------------------------------------------------------


def run_ckpt(name, a):
    rows, errors = [], []
    for size in a.sizes:
        argv = [PY, os.path.join(HERE, "ckpt_bench.py"), name, "--size-gib", str(size), "--reps", str(a.reps),
                "--warmup", str(a.warmup), "--staging-dir", a.staging_dir]
        if a.disk_dir:
            argv += ["--disk-dir", a.disk_dir]
        if name != "stall" and size in a.s3_sizes:
            argv.append("--s3")
        try:
            rows += child(argv, f"{name} {size} GiB")
        except RuntimeError as e:
            errors.append(str(e))
            log(str(e))
    return rows, errors


def run_interop(name, a):
    rows, errors = [], []
    for size in a.sizes:
        argv = [PY, os.path.join(HERE, "interop_bench.py"), name, "--size-gib", str(size), "--reps", str(a.reps),
                "--warmup", str(a.warmup), "--staging-dir", a.staging_dir]
        if a.disk_dir:
            argv += ["--disk-dir", a.disk_dir]
        try:
            rows += child(argv, f"{name} {size} GiB")
        except RuntimeError as e:
            errors.append(str(e))
            log(str(e))
    return rows, errors


def run_profile(a):
    """Where elastic_run.save's time goes, at the largest size (bench/profile_save.py)."""
    argv = [PY, os.path.join(HERE, "profile_save.py"), "--size-gib", str(max(a.sizes)), "--staging-dir", a.staging_dir]
    try:
        log("profile of elastic_run.save ...")
        p = subprocess.run(argv, capture_output=True, text=True, cwd=common.REPO, timeout=CHILD_TIMEOUT_S)
        if p.returncode != 0:
            return {"error": p.stderr[-2000:]}
        return json.loads(p.stdout)
    except (subprocess.TimeoutExpired, ValueError) as e:
        return {"error": repr(e)}


def run_recovery(a):
    rows, errors = [], []
    reps = a.recovery_reps or a.reps
    for rep in range(reps):
        for system in common.rotate(a.recovery_systems, rep):
            for sig in a.signals:
                if system == "torchft" and sig != "KILL":
                    continue  # no drain: a SIGTERM ends its workers as a SIGKILL does
                argv = [PY, os.path.join(HERE, "recovery.py"), "--system", system, "--signal", sig,
                        "--steps", str(a.recovery_steps), "--kill-at", str(a.kill_at)]
                if (system.startswith("elastic") or system == "torchft") and sig == "KILL":
                    argv.append("--join")
                try:
                    for r in child(argv, f"recovery {system} SIG{sig} rep {rep}"):
                        r["rep"] = rep
                        rows.append(r)
                except RuntimeError as e:
                    errors.append(str(e))
                    log(str(e))
    return rows, errors


SCALE_KEYS = {
    "join phase (start to last join)": "join_ms",
    "last join -> frozen generation seen by all": "frozen_ms",
    "first to last member seeing it": "spread_ms",
    "members fenced during the run": "fenced",
}


def parse_scale(text, members):
    out = {"members": members}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2:
            continue
        k, v = cells
        num = re.match(r"[-\d.]+", v.replace(",", ""))
        if k in SCALE_KEYS and num:
            out[SCALE_KEYS[k]] = float(num.group(0))
        elif k.startswith("steady-state etcd messages/s, window 1") and num:
            out["msgs_per_s_w1"] = float(num.group(0))
        elif k.startswith("steady-state etcd messages/s, window 2") and num:
            out["msgs_per_s_w2"] = float(num.group(0))
        elif k.startswith("all ") and "left" in k and num:
            out["leave_ms"] = float(num.group(0))
        elif k.startswith("generations seen"):
            out["generations"] = v
    return out


def run_scale(a):
    rows, errors = [], []
    binary = os.environ.get("SCALE") or os.path.join(common.REPO, "target", "release", "examples", "scale")
    for rep in range(a.reps):
        for m in common.rotate(a.members, rep):
            argv = [binary, str(m), str(m), str(a.scale_ttl_ms), str(a.scale_window)]
            log(f"scale {m} members rep {rep} ...")
            p = subprocess.run(argv, capture_output=True, text=True, cwd=common.REPO, timeout=CHILD_TIMEOUT_S)
            if p.returncode != 0:
                errors.append(f"scale {m}: exit {p.returncode}: {p.stderr[-2000:]}")
                log(errors[-1])
                continue
            r = parse_scale(p.stdout, m)
            r["rep"] = rep
            rows.append(r)
    return rows, errors


def run_overhead(a):
    rows, errors = [], []
    systems = ["elastic", "elastic-nockpt", "torchrun"]
    for rep in range(a.reps):
        for system in common.rotate(systems, rep):
            argv = [PY, os.path.join(HERE, "overhead.py"), "--system", system, "--steps", str(a.overhead_steps)]
            try:
                for r in child(argv, f"overhead {system} rep {rep}"):
                    r["rep"] = rep
                    rows.append(r)
            except RuntimeError as e:
                errors.append(str(e))
                log(str(e))
    return rows, errors


# --- tables -----------------------------------------------------------------------------------


def fmt_s(x):
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_b(x):
    if x is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def ratio(x, ref):
    if x is None or ref in (None, 0):
        return "-"
    return f"{x / ref:.2f}x"


def group(rows, *keys):
    out = {}
    for r in rows:
        out.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return out


def med(rs, key):
    s = summarize([r.get(key) for r in rs])
    return s["median"] if s else None


def rng(rs, key, f=fmt_s):
    s = summarize([r.get(key) for r in rs])
    return f"{f(s['min'])} - {f(s['max'])}" if s else "-"


def table_stall(rows):
    out, verdicts = [], []
    for (size,), rs in sorted(group(rows, "size_gib").items()):
        nbytes = rs[0]["state_bytes"]
        by = group(rs, "method")
        ref = med(by.get(("elastic_run.async_save",), []), "blocked_s")
        step = med(rs, "step_s")
        out.append(f"\n**{fmt_b(nbytes)} of fp32 model + Adam state** (stall = time the save call blocks; "
                   f"blocked = the call plus how much longer the two training steps after it took than the two "
                   f"before; one step {fmt_s(step)} here)\n")
        out.append("| method | blocked (median) | range | n | ÷ elastic_run.async_save | stall (call) | "
                   "until written (async) |")
        out.append("|---|---|---|---|---|---|---|")
        for (m,), mr in by.items():
            b = med(mr, "blocked_s")
            done = med(mr, "done_s")
            out.append(f"| {m} | {fmt_s(b)} | {rng(mr, 'blocked_s')} | {len(mr)} | {ratio(b, ref)} | "
                       f"{fmt_s(med(mr, 'stall_s'))} | {fmt_s(done) if done is not None else '-'} |")
        d = med(by.get(("dcp.save",), []), "blocked_s")
        da = med(by.get(("dcp.async_save",), []), "blocked_s")
        if ref is not None and ref > 0 and d and da:
            verdicts.append(f"- {fmt_b(nbytes)}: dcp.save blocks training {d / ref:.2f}x as long as "
                            f"elastic_run.async_save (goal >= 5x: **{'met' if d / ref >= 5 else 'not met'}**); "
                            f"dcp.async_save {da / ref:.2f}x as long (goal >= 1x: "
                            f"**{'met' if da >= ref else 'not met'}**).")
        elif ref is not None and ref <= 0 and d and da:
            verdicts.append(f"- {fmt_b(nbytes)}: elastic_run.async_save cost training nothing measurable "
                            f"({fmt_s(ref)}); dcp.save {fmt_s(d)}, dcp.async_save {fmt_s(da)}.")
    return out + ([""] + verdicts if verdicts else [])


def table_durable(rows):
    out = []
    for (size,), rs in sorted(group(rows, "size_gib").items()):
        nbytes = rs[0]["state_bytes"]
        by = group(rs, "method")
        out.append(f"\n**{fmt_b(nbytes)} of state** (durable = from the save call until the bytes are durable: "
                   "fsynced on file://, PUT answered on S3)\n")
        out.append("| method | durable (median) | range | n | of which training blocked | ÷ elastic-run (same store) "
                   "| stored | uploader CPU |")
        out.append("|---|---|---|---|---|---|---|---|")
        for (m,), mr in by.items():
            store = "s3" if "(s3)" in m else ("file, cold cache" if "cold cache" in m else "file")
            ref_rows = by.get((f"elastic_run.save + checkpoint push ({store})",), [])
            ref = med(ref_rows, "durable_s")
            s = med(mr, "durable_s")
            out.append(f"| {m} | {fmt_s(s)} | {rng(mr, 'durable_s')} | {len(mr)} | {fmt_s(med(mr, 'stall_s'))} | "
                       f"{ratio(s, ref)} | {fmt_b(med(mr, 'stored_bytes'))} | {fmt_s(med(mr, 'uploader_cpu_s'))} |")
    return out


def table_restore(rows):
    out = []
    for (size,), rs in sorted(group(rows, "size_gib").items()):
        nbytes = rs[0]["state_bytes"]
        by = group(rs, "method")
        out.append(f"\n**{fmt_b(nbytes)} of state**, saved by a world of 2 (restore = newest step -> this "
                   "rank's tensors in the model and optimizer; page cache warm, or dropped before each "
                   "\"cold cache\" row)\n")
        out.append("| method | restore (median) | range | n | fetch / load | ÷ elastic-run 2->2 (same store) | bytes read | bytes needed | read ÷ needed | fetch memory (peak RSS rise) |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for (m,), mr in by.items():
            store = "s3" if "(s3)" in m else ("file, cold cache" if "cold cache" in m else "file")
            ref = med(by.get((f"checkpoint restore + elastic_run.load, world 2->2 ({store})",), []), "restore_s")
            s = med(mr, "restore_s")
            br = med(mr, "bytes_read")
            need = med(mr, "bytes_needed") or (nbytes if "raw object_store" not in m else None)
            fl = f"{fmt_s(med(mr, 'fetch_s'))} / {fmt_s(med(mr, 'load_s'))}" if med(mr, "fetch_s") else "-"
            rss = max((r["fetch_rss_rise_mib"] for r in mr if "fetch_rss_rise_mib" in r), default=None)
            mem = "-" if rss is None else f"{rss:.0f} MiB (largest of {len(mr)})"
            out.append(f"| {m} | {fmt_s(s)} | {rng(mr, 'restore_s')} | {len(mr)} | {fl} | {ratio(s, ref)} | "
                       f"{fmt_b(br)} | {fmt_b(need)} | {ratio(br, need)} | {mem} |")
    return out


def table_recovery(rows):
    out = ["", "| system | signal | recovered | time to survivors' first step (median) | range | ÷ elastic-run | "
           "steps redone (median) | detail |", "|---|---|---|---|---|---|---|---|"]
    by = group(rows, "system", "signal")
    for (system, sig), rs in sorted(by.items()):
        ok = [r for r in rs if r.get("recovered")]
        ref = med([r for r in by.get(("elastic", sig), []) if r.get("recovered")], "recovery_s")
        s = med(ok, "recovery_s")
        if system == "elastic-in-place" and ok:
            n_in_place = sum(1 for r in ok if r.get("in_place"))
            detail = (f"new generation {fmt_s(med(ok, 'new_generation_s'))}; {n_in_place}/{len(ok)} switched in place "
                      f"(the rest restarted); first step after: {med(ok, 'first_step_after')}")
            drained = [r for r in ok if r.get("after_drained_commit_s") is not None]
            if drained:
                detail += f"; after the drained step's commit {fmt_s(med(drained, 'after_drained_commit_s'))}"
        elif system in ("elastic", "elastic-standby"):
            detail = (f"new generation {fmt_s(med(ok, 'new_generation_s'))}, workers started "
                      f"{fmt_s(med(ok, 'workers_started_s'))}, workers started -> first step "
                      f"{fmt_s(med(ok, 'workers_to_first_step_s'))}, cold start of a worker group "
                      f"{fmt_s(med(ok, 'cold_start_s'))}; resumed from step {med(ok, 'resume_step')}") if ok else ""
            if system == "elastic-standby" and ok:
                detail += (f"; survivors' workers started in a warm standby {med(ok, 'warm_workers')} of 4 "
                           f"(median); `import torch` alone {fmt_s(med(ok, 'import_torch_s'))}")
        elif system == "torchft":
            detail = (f"first committed step after: {med(ok, 'first_step_after')}; lighthouse join_timeout_ms 1000; "
                      "gradients averaged with manager.allreduce (its DDP comm hook fails the survivors on gloo)"
                      ) if ok else ""
        else:
            detail = f"restarted at step {med(ok, 'first_step_after')}" if ok else ""
        joined = [r for r in ok if r.get("join_first_step_s") is not None]
        if joined:
            healed = sum(1 for r in joined if r.get("join_healed"))
            workers = med(joined, "join_workers_to_first_step_s")
            detail += (f"; a fresh node joining after: first step {fmt_s(med(joined, 'join_first_step_s'))} after its "
                       f"launcher started{'' if workers is None else f' (its workers {fmt_s(workers)})'}, "
                       f"{int(med(joined, 'join_bytes_from_store')):,} bytes from the store, healed from peers "
                       f"{healed}/{len(joined)}")
        if (system.startswith("elastic") or system == "torchft") and ok and med(ok, "step_ms") is not None:
            detail += f"; steady step {med(ok, 'step_ms'):.1f} ms"
        errs = sorted({r.get("error", "")[:160] for r in rs if not r.get("recovered")})
        if errs:
            detail += ("; " if detail else "") + "failed: " + " / ".join(errs)
        out.append(f"| {system} | SIG{sig} | {len(ok)}/{len(rs)} | {fmt_s(s)} | {rng(ok, 'recovery_s')} | "
                   f"{ratio(s, ref)} | {med(ok, 'steps_redone') if ok else '-'} | {detail} |")
    return out


def table_scale(rows):
    out = ["", "| members | join phase | last join -> generation seen by all (median) | range | first -> last member "
           "| steady etcd msgs/s | msgs/s per member | fenced | all leave |", "|---|---|---|---|---|---|---|---|---|"]
    ms = lambda x: "-" if x is None else f"{x:,.0f} ms"  # noqa: E731
    for (m,), rs in sorted(group(rows, "members").items()):
        rate = med(rs, "msgs_per_s_w1")
        out.append(f"| {m:,} | {ms(med(rs, 'join_ms'))} | {ms(med(rs, 'frozen_ms'))} | "
                   f"{rng(rs, 'frozen_ms', ms)} | {ms(med(rs, 'spread_ms'))} | "
                   f"{rate:.1f} / {med(rs, 'msgs_per_s_w2'):.1f} | {rate / m:.2f} | {med(rs, 'fenced'):.0f} | "
                   f"{ms(med(rs, 'leave_ms'))} |")
    return out


def table_overhead(rows):
    out = ["", "| launcher | launcher CPU | workers CPU (2) | launcher ÷ workers CPU | launcher CPU per step | "
           "launcher RSS peak | workers RSS peak | launcher ÷ workers RSS | steps/s | n |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"elastic": "elastic-run (checkpoint every 20 steps)", "elastic-nockpt": "elastic-run (no checkpoints)",
             "torchrun": "torchrun (python -m torch.distributed.run)"}
    for (system,), rs in sorted(group(rows, "system").items()):
        out.append(f"| {names.get(system, system)} | {med(rs, 'launcher_cpu_pct'):.2f} % | {med(rs, 'workers_cpu_pct'):.0f} % | "
                   f"{100 * med(rs, 'cpu_ratio'):.2f} % | {med(rs, 'launcher_cpu_ms_per_step'):.3f} ms | "
                   f"{fmt_b(med(rs, 'launcher_rss_peak_bytes'))} | "
                   f"{fmt_b(med(rs, 'workers_rss_peak_bytes'))} | {100 * med(rs, 'rss_ratio'):.1f} % | "
                   f"{med(rs, 'steps_per_s'):.0f} | {len(rs)} |")
    return out


def table_fsdp(rows):
    out = []
    for (size,), rs in sorted(group(rows, "size_gib").items()):
        nbytes = rs[0]["state_bytes"]
        out.append(f"\n**{fmt_b(nbytes)} of FSDP2 state** (model + AdamW, 2 ranks, each holding half of every "
                   "tensor; save = until durable on file://; restore = from the store into the model and optimizer, "
                   "checked bitwise)\n")
        out.append("| what | method | median | range | n | ÷ elastic-run |")
        out.append("|---|---|---|---|---|---|")
        for (kind,), kr in sorted(group(rs, "kind").items(), key=lambda kv: kv[0][0] != "save"):
            by = group(kr, "method")
            ref = next((med(mr, "seconds") for (m,), mr in by.items() if not m.startswith("dcp")), None)
            for (m,), mr in by.items():
                s = med(mr, "seconds")
                out.append(f"| {kind} | {m} | {fmt_s(s)} | {rng(mr, 'seconds')} | {len(mr)} | {ratio(s, ref)} |")
    return out


def table_export(rows):
    out = []
    for (size,), rs in sorted(group(rows, "size_gib").items()):
        nbytes = rs[0]["state_bytes"]
        out.append(f"\n**{fmt_b(nbytes)} of model weights** to Hugging Face safetensors (each in a process of its "
                   "own; peak RSS from wait4; both outputs checked equal)\n")
        out.append("| method | time (median) | range | n | ÷ elastic-ckpt export | peak RSS | peak RSS ÷ model |")
        out.append("|---|---|---|---|---|---|---|")
        by = group(rs, "method")
        ref = med(by.get(("elastic-ckpt export (file)",), []), "seconds")
        for (m,), mr in by.items():
            s = med(mr, "seconds")
            peak = med(mr, "peak_rss_bytes")
            out.append(f"| {m} | {fmt_s(s)} | {rng(mr, 'seconds')} | {len(mr)} | {ratio(s, ref)} | {fmt_b(peak)} | "
                       f"{ratio(peak, nbytes)} |")
    return out


TABLES = {"stall": table_stall, "durable": table_durable, "restore": table_restore, "recovery": table_recovery,
          "scale": table_scale, "overhead": table_overhead, "fsdp": table_fsdp, "export": table_export}
TITLES = {"stall": "1. Checkpoint stall", "durable": "2. Time until a checkpoint is durable",
          "restore": "3. Restore", "recovery": "4-5. Recovery and lost work (3 nodes x 2 workers, one node lost)",
          "scale": "6. Rendezvous at scale (one etcd)", "overhead": "7. Launcher overhead while training (standalone, 2 workers)",
          "fsdp": "8. FSDP2 state: save and restore against DCP", "export": "9. Export to Hugging Face safetensors"}


def markdown(res):
    m = res["machine"]
    lines = [f"# elastic-run benchmark results ({m['date']})", "",
             f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB; {m['os']}, kernel {m['kernel']}; "
             f"torch {m['torch']}, {m['etcd']}, {m['rustc']}; git {m['git']}. Load average at start "
             f"{', '.join(f'{x:.1f}' for x in m['loadavg_start'])}, at end "
             f"{', '.join(f'{x:.1f}' for x in res.get('loadavg_end', []))}.", "",
             f"Command: `{res['command']}`", ""]
    for name in res["benchmarks"]:
        b = res["benchmarks"][name]
        lines.append(f"## {TITLES[name]}")
        if b["rows"]:
            try:
                lines += TABLES[name](b["rows"])
            except Exception as e:  # a table must never lose the raw results
                lines.append(f"(table failed: {e!r}; see results.json)")
        prof = b.get("profile")
        if prof and "error" not in prof:
            top = prof["top_self_time"][0] if prof.get("top_self_time") else {}
            lines += ["", f"Profile of one elastic_run.save of {fmt_b(prof['state_bytes'])} (bench/profile_save.py, "
                      f"cProfile): {fmt_s(prof['elastic_run_save_s'])} in all, of which {fmt_s(top.get('self_s'))} "
                      f"in `{top.get('function')}`. For the same bytes: writing each tensor's memory straight into a "
                      f"safetensors file + fsync takes {fmt_s(prof['direct_write_s'])}; one in-memory copy "
                      f"(`clone`, what dcp.async_save's blocking part does) {fmt_s(prof['one_memory_copy_s'])}."]
        elif prof:
            lines += ["", f"Profile failed: `{prof['error'][:500]}`"]
        for e in b["errors"]:
            lines += ["", f"Error: `{e[:1500]}`"]
        lines.append("")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(prog="bench/run.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all): {' '.join(BENCHES)}")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every comparison (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up rounds per checkpoint benchmark")
    p.add_argument("--sizes", type=floats, default=floats("0.25,1"),
                   help="state sizes in GiB, model + Adam (default 0.25,1; full run: 1,4)")
    p.add_argument("--s3-sizes", type=floats, default=floats("0.25"),
                   help="sizes also run against S3 (moto) in durable/restore (default 0.25; moto keeps objects in RAM)")
    p.add_argument("--staging-dir", default="/dev/shm", help="node-local staging / stall target (default /dev/shm)")
    p.add_argument("--disk-dir", default=None, help="where file:// stores and DCP write (default $TMPDIR or /tmp)")
    p.add_argument("--members", type=ints, default=ints("10,100,1000"), help="rendezvous sizes (default 10,100,1000)")
    p.add_argument("--scale-window", type=int, default=10, help="seconds per steady-state window (default 10)")
    p.add_argument("--scale-ttl-ms", type=int, default=10000, help="member lease TTL in the scale runs")
    p.add_argument("--recovery-systems", type=words,
                   default=words("elastic,elastic-in-place,torchft,torchrun-c10d,torchrun-c10d-own-store,"
                                 "torchrun-c10d-tuned,torchrun-etcd-v2"))
    p.add_argument("--signals", type=words, default=words("KILL,TERM"))
    p.add_argument("--recovery-reps", type=int, default=None, help="repetitions of recovery runs (default --reps)")
    p.add_argument("--recovery-steps", type=int, default=400)
    p.add_argument("--kill-at", type=int, default=25)
    p.add_argument("--overhead-steps", type=int, default=2000)
    p.add_argument("--out", default=None, help="results directory (default bench/results/<date-time>)")
    a = p.parse_args()
    names = a.names or BENCHES
    bad = [n for n in names if n not in BENCHES + ["lostwork"]]
    if bad:
        p.error(f"unknown benchmark {bad}: choose from {' '.join(BENCHES)}")
    names = [("recovery" if n == "lostwork" else n) for n in names]
    names = [n for i, n in enumerate(names) if n not in names[:i]]

    out = a.out or os.path.join(HERE, "results", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    res = {"command": "bench/run.sh " + " ".join(sys.argv[1:]), "machine": common.machine(),
           "config": {k: v for k, v in vars(a).items()}, "benchmarks": {}}
    log(f"machine: {res['machine']}")

    def save():
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(markdown(res))

    for name in names:
        t = time.perf_counter()
        if name in ("stall", "durable", "restore"):
            rows, errors = run_ckpt(name, a)
        elif name == "recovery":
            rows, errors = run_recovery(a)
        elif name == "scale":
            rows, errors = run_scale(a)
        elif name in ("fsdp", "export"):
            rows, errors = run_interop(name, a)
        else:
            rows, errors = run_overhead(a)
        res["benchmarks"][name] = {"rows": rows, "errors": errors, "seconds": time.perf_counter() - t}
        if name == "stall":
            res["benchmarks"][name]["profile"] = run_profile(a)
        res["loadavg_end"] = os.getloadavg()
        save()
    print(markdown(res))
    log(f"results: {out}/results.json, {out}/results.md")
    return 1 if any(b["errors"] for b in res["benchmarks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
