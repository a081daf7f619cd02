"""Appends TORCHELASTIC_RESTART_COUNT to FILE, then fails."""
import os
import sys

with open(sys.argv[1], "a") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\n")
sys.exit(3)
