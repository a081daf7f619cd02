"""`python -m launcher_pkg.touch DIR`: touches DIR/<RANK>."""
import os
import pathlib
import sys

if __name__ == "__main__":
    if __spec__ is None or __spec__.name != "launcher_pkg.touch":
        sys.exit("not run as a module")
    (pathlib.Path(sys.argv[1]) / os.environ["RANK"]).touch()
