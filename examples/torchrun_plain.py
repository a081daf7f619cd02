"""An unmodified torchrun-style script: env:// rendezvous, one all_reduce, prints.

    elastic-run --standalone --nproc-per-node 2 examples/torchrun_plain.py
"""
import os

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    print(f"rank {rank}/{world} local_rank {os.environ['LOCAL_RANK']} all_reduce {t.item():g} expected {expected:g}")
    if t.item() != expected:
        raise SystemExit(f"all_reduce gave {t.item()}, expected {expected}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
