"""Writes torch.distributed.is_torchelastic_launched() to --out-file."""
import argparse

import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out-file", "--out_file", required=True)
    args = p.parse_args()
    with open(args.out_file, "w") as f:
        f.write(str(dist.is_torchelastic_launched()))


if __name__ == "__main__":
    main()
