"""Sharded (FSDP2) training of a small MLP under elastic-run, with every kind of state a real
loop has.

    elastic-run --standalone --nproc-per-node 4 --checkpoint-interval 10 \
        -- python examples/fsdp_train.py --steps 100

- Every linear layer and the root are wrapped with torch's fully_shard on a 1-D device mesh of
  all ranks (gloo on CPU, NCCL on GPU): each rank holds rows of every parameter, of AdamW's
  moments and of an EMA copy of the model (DTensors placed Shard(0)).
- One state mapping holds the model, the EMA model, AdamW, a cosine LR schedule, a GradScaler
  and the data position (elastic_run.ElasticSampler). elastic_run.save/async_save write each
  rank's own rows and where they sit in the whole tensor; after a rescale the agent restores
  each new rank's rows, and elastic_run.load puts them into that rank's DTensors. The layers'
  sizes (37, 29, 5 rows) do not divide evenly by 2, 3 or 4 ranks, and at 4 ranks the last holds
  no rows of the output layer.
- The LR is the cosine schedule's times elastic-run's scale (elastic_run.scale_lr); the
  GradScaler grows its scale every --scaler-growth-interval steps, so its state changes as the
  run goes.
- Data is generated from --seed; ElasticSampler orders it as one global stream, and each rank
  trains on its slice of every global batch, micro-batch after micro-batch (gradient
  accumulation as the agent sets it).
- --log-digests: rank 0 prints a digest of every parameter, optimizer and EMA tensor, gathered
  whole, and of the schedule's, the scaler's and the sampler's state, after a load and at each
  save (tests compare the two across a rescale, and the final ones with an export).

The final checkpoint's model and EMA export to Hugging Face's layout:

    elastic-ckpt export URL model-dir
    elastic-ckpt export URL ema-dir --key ema
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
N_OUT = 5


def make_model():
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 37), torch.nn.Tanh(),
        torch.nn.Linear(37, 29), torch.nn.Tanh(),
        torch.nn.Linear(29, N_OUT),
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


def dataset(seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, N_OUT, generator=g)
    return x, torch.sin(x @ w)


def tensor_digest(t):
    """A digest of a tensor's dtype, shape and bytes (a DTensor is gathered whole first: every
    rank must call it then, as gathering is a collective)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    t = t.cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype} {list(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def value_digest(v):
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16]


def digests(model, ema, opt, sched, scaler, sampler):
    """Every parameter, EMA and optimizer tensor, gathered whole, and the schedule's, the
    scaler's and the sampler's state, by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p for n, p in model.named_parameters()}
    tensors.update({f"ema.{n}": p for n, p in ema.named_parameters()})
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"opt.{names[id(p)]}.{k}"] = v
    out = {name: tensor_digest(tensors[name]) for name in sorted(tensors)}
    out["sched"] = value_digest(sched.state_dict())
    out["scaler"] = value_digest(scaler.state_dict())
    out["data"] = value_digest(sampler.state_dict())
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2, help="base LR, scaled by elastic-run's --lr-scaling")
    p.add_argument("--lr-decay-steps", type=int, default=1000,
                   help="the cosine schedule's length (T_max), independent of --steps")
    p.add_argument("--ema-decay", type=float, default=0.9)
    p.add_argument("--scaler-growth-interval", type=int, default=10)
    p.add_argument("--samples", type=int, default=1000, help="size of the generated data set")
    p.add_argument("--batch-size", type=int, default=None, help="per worker (default: ELASTIC_BATCH_SIZE or 8)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
    p.add_argument("--log-digests", action="store_true",
                   help="rank 0 prints every piece of state's digest (tensors gathered whole) after a "
                        "load and at each save")
    args = p.parse_args()

    backend = er.init()
    rank, world = er.rank(), er.world_size()
    device = torch.device("cuda", er.local_rank()) if backend == "nccl" else torch.device("cpu")
    batch = args.batch_size or er.batch_size(8)
    accum = er.grad_accum_steps()

    torch.manual_seed(args.seed)
    model = make_model().to(device)
    ema = make_model().to(device).requires_grad_(False)
    if dist.is_initialized():
        shard(model, device, world)
        shard(ema, device, world)
    with torch.no_grad():
        for e, w in zip(ema.parameters(), model.parameters()):
            e.copy_(w)
    # Made after sharding, so that its state (AdamW's moments) is sharded like the parameters.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.lr_decay_steps, eta_min=args.lr * 0.1)
    scaler = torch.amp.GradScaler(device.type, growth_interval=args.scaler_growth_interval)
    x_all, y_all = dataset(args.seed, args.samples)
    sampler = er.ElasticSampler(args.samples, seed=args.seed, batch_size=batch)

    def log_digests(event, step):
        d = digests(model, ema, opt, sched, scaler, sampler)
        if rank == 0:
            print("digests " + json.dumps({"event": event, "step": step, "world": world, "tensors": d}), flush=True)

    if rank == 0:
        print(f"backend {backend or 'none'} world {world} device {device} accum {accum}", flush=True)
    # Stateful objects load in place (each rank gets its own rows); plain values come back in
    # the mapping.
    state = {"model": model, "ema": ema, "opt": opt, "sched": sched, "scaler": scaler, "data": sampler,
             "progress": None}
    step = er.load(state) or 0
    if step:
        if rank == 0:
            print(f"resumed from step {step} (saved at world {state['progress']['world_size']})", flush=True)
        if args.log_digests:
            log_digests("loaded", step)
    # The scale applies to the training step about to be taken, which the GradScaler may skip.
    er.scale_lr(opt, step=lambda: step)

    while step < args.steps:
        step += 1
        mine = torch.tensor(sampler.rank_ids(sampler.ids(sampler.consumed, sampler.global_batch())))
        opt.zero_grad()
        total = 0.0
        for a in range(accum):
            micro = mine[a * batch:(a + 1) * batch]
            x, y = x_all[micro].to(device), y_all[micro].to(device)
            loss = torch.nn.functional.mse_loss(model(x), y) / accum
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.step(opt)
        scaler.update()
        sched.step()
        sampler.advance()
        with torch.no_grad():
            for e, w in zip(ema.parameters(), model.parameters()):
                e.lerp_(w, 1.0 - args.ema_decay)
        if rank == 0:
            print(f"step {step} loss {total:.6f} world {world} scale {scaler.get_scale():g}", flush=True)
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
