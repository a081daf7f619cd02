"""Sharded (FSDP2) training of a small MLP under elastic-run.

    elastic-run --standalone --nproc-per-node 4 --checkpoint-interval 10 \
        -- python examples/fsdp_train.py --steps 100

- Every linear layer and the root are wrapped with torch's fully_shard on a 1-D device mesh of
  all ranks (gloo on CPU, NCCL on GPU): each rank holds rows of every parameter and of AdamW's
  moments (DTensors placed Shard(0)).
- elastic_run.save/async_save write each rank's own rows and where they sit in the whole tensor;
  after a rescale the agent restores each new rank's rows, and elastic_run.load puts them into
  that rank's DTensors. The layers' sizes (37, 29, 5 rows) do not divide evenly by 2, 3 or 4
  ranks, and at 4 ranks the last holds no rows of the output layer.
- Data is generated from --seed and the step: each step's batch is the same whatever the world
  size, split between the ranks.
- --log-digests: rank 0 prints a digest of every parameter and optimizer tensor, gathered whole,
  after a load and at each save (tests compare the two across a rescale).
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

try:
    import elastic_run as er
except ImportError:  # running from a clone without `pip install ./runtime/python`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime", "python"))
    import elastic_run as er

N_FEATURES = 16


def make_model():
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 37), torch.nn.Tanh(),
        torch.nn.Linear(37, 29), torch.nn.Tanh(),
        torch.nn.Linear(29, 5),
    )


def shard(model, device, world):
    """FSDP2: each linear layer is its own unit (gathered for its forward and backward only),
    and the root takes whatever is left."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def batch(seed, step, rank, world, per_rank):
    """This rank's part of step `step`'s batch of `per_rank * world` samples."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(per_rank * world, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, 5, generator=torch.Generator().manual_seed(seed))
    y = torch.sin(x @ w)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine], y[mine]


def digests(model, opt):
    """A digest of every parameter and optimizer tensor, gathered whole, by name. Every rank
    must call it (gathering a sharded tensor is a collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"opt.{names[id(p)]}.{k}"] = v
    out = {}
    for name in sorted(tensors):
        t = tensors[name].detach()
        if hasattr(t, "full_tensor"):  # a DTensor: this rank holds only its rows
            t = t.full_tensor()
        t = t.cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype} {list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()[:16]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2, help="base LR, scaled by elastic-run's --lr-scaling")
    p.add_argument("--batch-size", type=int, default=None, help="per worker (default: ELASTIC_BATCH_SIZE or 8)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
    p.add_argument("--log-digests", action="store_true",
                   help="rank 0 prints every tensor's digest, gathered whole, after a load and at each save")
    args = p.parse_args()

    backend = er.init()
    rank, world = er.rank(), er.world_size()
    device = torch.device("cuda", er.local_rank()) if backend == "nccl" else torch.device("cpu")
    per_rank = args.batch_size or er.batch_size(8)

    torch.manual_seed(args.seed)
    model = make_model().to(device)
    if dist.is_initialized():
        shard(model, device, world)
    # Made after sharding, so that its state (AdamW's moments) is sharded like the parameters.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    er.scale_lr(opt)

    def log_digests(event, step):
        d = digests(model, opt)
        if rank == 0:
            print("digests " + json.dumps({"event": event, "step": step, "world": world, "tensors": d}), flush=True)

    if rank == 0:
        print(f"backend {backend or 'none'} world {world} device {device}", flush=True)
    # Stateful objects load in place (each rank gets its own rows); plain values come back in
    # the mapping.
    state = {"model": model, "opt": opt, "progress": None}
    step = er.load(state) or 0
    if step:
        if rank == 0:
            print(f"resumed from step {step} (saved at world {state['progress']['world_size']})", flush=True)
        if args.log_digests:
            log_digests("loaded", step)

    while step < args.steps:
        step += 1
        x, y = batch(args.seed, step, rank, world, per_rank)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} world {world}", flush=True)
        er.report_progress(step)
        stop = er.should_stop(step)
        if stop or er.should_checkpoint(step) or step == args.steps:
            state["progress"] = {"world_size": world}
            if args.log_digests:
                # Of the state about to be saved, and printed before it is: once a step is
                # committed, its digests are in the log, whichever rank dies next.
                log_digests("saved", step)
            if stop or step == args.steps:
                er.save(step, state)  # the last one: written before the worker exits
            else:
                # Returns once the state is captured; opt.step() waits for the write.
                er.async_save(step, state)
            if rank == 0:
                print(f"saved step {step}", flush=True)
        if stop:
            if rank == 0:
                print(f"stopping at step {step} (drain)", flush=True)
            break
        if args.step_sleep:
            time.sleep(args.step_sleep)

    if rank == 0:
        print(f"done step {step}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
