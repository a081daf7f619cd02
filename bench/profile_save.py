"""Where elastic_run.save's stall goes: cProfile of one save, and reference times for the same
bytes (one in-memory copy, one direct write of the tensors' memory into a safetensors file).

    python bench/profile_save.py [--size-gib 1] [--staging-dir /dev/shm] [--top 12]

Prints a JSON summary on stdout and the profile on stderr.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_bench as cb  # noqa: E402  (builds the same state)

import torch  # noqa: E402

import elastic_run as er  # noqa: E402

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
          torch.int32: "I32", torch.float64: "F64", torch.uint8: "U8", torch.bool: "BOOL"}


def direct_write(tensors, path):
    """safetensors, written straight from each tensor's memory (no intermediate bytes)."""
    header, off = {}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--staging-dir", default="/dev/shm")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    base = os.path.join(a.staging_dir, f"elastic-profile-{os.getpid()}")
    os.makedirs(base)
    try:
        model, opt, _, nbytes = cb.make_state(a.size_gib)
        cb.er_save(model, opt, os.path.join(base, "warm"), 0)  # warm-up (imports, first-touch)
        shutil.rmtree(os.path.join(base, "warm"))
        os.sync()
        prof = cProfile.Profile()
        cb.er_env(os.path.join(base, "prof"))
        t = time.perf_counter()
        prof.enable()
        er.save(1, model=model, optimizer=opt)
        prof.disable()
        save_s = time.perf_counter() - t
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s).sort_stats("tottime")
        st.print_stats(a.top)
        print(s.getvalue(), file=sys.stderr)
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: a.top]:
            rows.append({"function": f"{os.path.basename(file)}:{line}({fn})", "calls": nc, "self_s": tt, "cumulative_s": ct})
        shutil.rmtree(os.path.join(base, "prof"))
        os.sync()

        tensors, _ = er._flatten(model, opt, None)
        t = time.perf_counter()
        copies = {k: v.clone() for k, v in tensors.items()}
        clone_s = time.perf_counter() - t
        del copies
        path = os.path.join(base, "direct.safetensors")
        t = time.perf_counter()
        direct_write(tensors, path)
        direct_s = time.perf_counter() - t
        from safetensors.torch import load_file
        back = load_file(path)
        assert all(torch.equal(back[k], tensors[k]) for k in tensors), "direct write does not round-trip"
        del back
        os.unlink(path)
        print(json.dumps({
            "state_bytes": nbytes, "elastic_run_save_s": save_s, "direct_write_s": direct_s,
            "one_memory_copy_s": clone_s, "top_self_time": rows,
        }, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
