"""init_process_group with an explicit init_method, then an all_reduce that must add up to
the world size."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--init-method", "--init_method", required=True)
    args = p.parse_args()
    dist.init_process_group(
        "gloo",
        init_method=args.init_method,
        world_size=int(os.environ["WORLD_SIZE"]),
        rank=int(os.environ["RANK"]),
    )
    world = dist.get_world_size()
    t = F.one_hot(torch.tensor(dist.get_rank()), num_classes=world)
    dist.all_reduce(t)
    if int(t.sum().item()) != world:
        raise SystemExit(f"all_reduce summed to {t.sum().item()}, expected {world}")
    print("Done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
