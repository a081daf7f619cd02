"""Checks the launcher's worker environment, then touches DIR/<RANK> (or fails on --fail).

The same checks as torchrun's own launcher test script: every variable torchrun gives a worker
must be present, including the error file and a variable set in the launcher's parent.
"""
import argparse
import os
import pathlib
import sys

REQUIRED = [
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
    "TEST_SENTINEL_PARENT",
    "TORCHELASTIC_ERROR_FILE",
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fail", action="store_true")
    p.add_argument("--touch-file-dir", "--touch_file_dir", dest="dir")
    args = p.parse_args()
    missing = [k for k in REQUIRED if k not in os.environ]
    if missing:
        sys.exit(f"missing from the worker environment: {missing}")
    for k in REQUIRED:
        print(f"{k} = {os.environ[k]}")
    if os.environ["TEST_SENTINEL_PARENT"] != "FOOBAR":
        sys.exit("TEST_SENTINEL_PARENT was not passed through")
    if args.fail:
        raise RuntimeError("raising exception since --fail flag was set")
    f = pathlib.Path(args.dir) / os.environ["RANK"]
    f.touch()
    print(f"Success, created {f}")


if __name__ == "__main__":
    main()
