"""TorchFT's lighthouse (the `torchft_lighthouse` command of its wheel), for bench/recovery.py:
run as `python bench/torchft_lighthouse.py --min_replicas 2 ...` with the torchft directory on
PYTHONPATH. Its arguments are read from the process's own command line."""
import sys

from torchft._torchft import lighthouse_main

if __name__ == "__main__":
    sys.exit(lighthouse_main())
