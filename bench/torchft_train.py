"""One worker of a TorchFT 0.2.0 replica group training examples/ddp_train.py's model, for
bench/recovery.py --system torchft (the peer system the recovery figures are compared with).

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT REPLICA_GROUP_ID=G \
        torchrun --standalone --nproc-per-node 2 bench/torchft_train.py --steps 400

Each replica group is one torchrun job (2 workers, gloo within the group); across groups,
torchft's Manager runs the quorum through the lighthouse, averages the gradients over the
groups in the quorum, and votes (`should_commit`) before every optimizer step. A group that
joins heals from a live group (torchft's HTTP checkpoint transport). The model, data, batch
and optimizer are ddp_train.py's: a 16-64-64-1 MLP on its generated data set, 32 samples per
worker, SGD with momentum 0.9, LR 0.05.

The workaround stock torchft 0.2.0 needs on gloo: gradients are averaged here with
`manager.allreduce` on one flat buffer after the backward, not with
`torchft.DistributedDataParallel`. Its comm hook swallows the connection reset a dead peer
causes and then fails an assertion on the survivors, which ends them.

Group rank 0 prints `step N loss L` for every step its group committed (the bench stamps the
lines as they arrive).
"""
import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from ddp_train import N_FEATURES, dataset  # noqa: E402

from torchft import Manager, Optimizer, ProcessGroupGloo  # noqa: E402

# Collectives across groups, and the wait for a quorum: a dead peer fails the step within this.
TIMEOUT_S = 10.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--min-replicas", type=int, default=2)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = int(os.environ["REPLICA_GROUP_ID"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, 1),
    )
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def load_state_dict(sd):
        # Called only when this group heals from a live one.
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        if rank == 0:
            print(f"group {group} healed from a live group", flush=True)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S)),
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"group{group}",
        timeout=timedelta(seconds=TIMEOUT_S),
        quorum_timeout=timedelta(seconds=60),
        rank=rank,
        world_size=world,
    )
    opt = Optimizer(manager, inner)
    params = list(model.parameters())
    x_all, y_all = dataset(0, 8192)
    n = x_all.shape[0]
    while manager.current_step() < args.steps:
        opt.zero_grad()  # starts the quorum for this step
        step = manager.current_step()
        # This worker's batch: a different slice per group and rank, moving with the step.
        start = ((step * 8 + group * world + rank) * args.batch_size) % (n - args.batch_size)
        x, y = x_all[start:start + args.batch_size], y_all[start:start + args.batch_size]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        # Across groups (an error marks the step failed in the manager), then within the group.
        manager.allreduce(flat).wait()
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for q in params:
            k = q.grad.numel()
            q.grad.copy_(flat[offset:offset + k].view_as(q.grad))
            offset += k
        if manager.should_commit():
            inner.step()
            if rank == 0:
                print(f"step {manager.current_step()} loss {loss.item():.6f} group {group} "
                      f"replicas {manager.num_participants()}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
