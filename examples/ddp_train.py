"""Data-parallel training of a small MLP regression under elastic-run.

    elastic-run --standalone --nproc-per-node 2 --checkpoint-interval 20 --lr-scaling linear \
        -- python examples/ddp_train.py --steps 200

- Data is generated from --seed; elastic_run.ElasticSampler orders it as one global stream for
  the job, and its position (samples consumed, saved in every checkpoint) lets any world size
  continue the same stream: no sample skipped or repeated across rescales.
- Checkpoints model, optimizer, LR schedule, RNG state and data position through elastic_run
  (one state mapping); resumes from ELASTIC_RESUME_DIR when the agent sets it.
- A cosine LR schedule over --lr-decay-steps, times elastic-run's LR scale (elastic_run.scale_lr);
  gloo on CPU, NCCL on GPU; grad accumulation as the agent sets it.
- --sample-log DIR records which samples every step trained on (tests read it back).
- --in-place: recovery in place (elastic_run.InPlace): when the membership changes the workers
  switch to the new process group and train on from memory, without a restart or a restore.
"""
import argparse
import contextlib
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


def dataset(seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def open_sample_log(directory, rank):
    """This process's sample log, DIR/gen-<generation>-rank-<rank>.jsonl: a new worker group
    writes new files, so one that dies mid-line leaves its partial line at the end of its own."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"gen-{er.generation()}-rank-{rank}.jsonl")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)


def weights_digest(model):
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05, help="base LR, scaled by elastic-run's --lr-scaling")
    p.add_argument("--batch-size", type=int, default=None, help="per worker (default: ELASTIC_BATCH_SIZE or 32)")
    p.add_argument("--lr-decay-steps", type=int, default=1000,
                   help="the cosine schedule's length (T_max), independent of --steps so that a run "
                        "stopped early and continued follows the same schedule")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--samples", type=int, default=8192, help="size of the generated data set")
    p.add_argument("--sample-log", metavar="DIR", default=None,
                   help="append one JSON line per step trained to DIR/gen-G-rank-R.jsonl: generation, "
                        "step, rank, world, accum, batch and this rank's sample ids (tests)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
    p.add_argument("--exit-linger", type=float, default=0.0,
                   help="seconds to linger after a drain's save before exiting: a slow teardown (tests)")
    p.add_argument("--crash-at", type=int, default=None, help="rank --crash-rank exits 3 at this step (tests)")
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--crash-restarts", type=int, default=1,
                   help="crash only while TORCHELASTIC_RESTART_COUNT is below this")
    p.add_argument("--digest-every-rank", action="store_true",
                   help="every rank prints its final weights' digest, not only rank 0 (tests)")
    p.add_argument("--in-place", action="store_true",
                   help="switch to new generations in place instead of being restarted")
    p.add_argument("--slow-voter", metavar="NODE", default=None,
                   help="with --in-place, the workers of the node whose id is NODE wait "
                        "--slow-vote-s before each commit vote, so that the other ranks wait "
                        "inside the vote (tests: a fault then lands in the middle of it)")
    p.add_argument("--slow-vote-s", type=float, default=0.5)
    args = p.parse_args()

    ip = None
    if args.in_place and "ELASTIC_AGENT_SOCKET" in os.environ:
        backend = "gloo"
    else:
        backend = er.init()
    rank, world = er.rank(), er.world_size()
    device = torch.device("cuda", er.local_rank()) if backend == "nccl" else torch.device("cpu")
    batch = args.batch_size or er.batch_size(32)
    accum = er.grad_accum_steps()

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, 1),
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.lr_decay_steps, eta_min=args.lr * 0.1)
    x_all, y_all = dataset(args.seed, args.samples)
    sampler = er.ElasticSampler(args.samples, seed=args.seed, batch_size=batch)
    sample_log = open_sample_log(args.sample_log, rank) if args.sample_log else None

    if rank == 0:
        print(f"backend {backend or 'none'} world {world} device {device}", flush=True)
    step = 0
    # Everything a resume needs, by name: Stateful objects load in place, plain values come
    # back in the mapping.
    state = {"model": model, "opt": opt, "sched": sched, "data": sampler, "progress": None, "rng": None}
    if args.in_place and backend == "gloo" and "ELASTIC_AGENT_SOCKET" in os.environ:
        ip = er.InPlace(state)
    resumed = er.load(state) if ip is None else None
    if resumed is not None:
        step = resumed
        torch.set_rng_state(state["rng"])
        if rank == 0:
            print(f"resumed from step {step} (samples_seen {sampler.consumed}, saved at world "
                  f"{state['progress']['world_size']})", flush=True)
    if ip is not None:
        # A worker that joins a running job gets the state from its peers in ip.load(), as
        # survivors of a switch do. The DDP behind `ddp` is made anew on each generation's group.
        ddp = ip.ddp(model)
        step = ip.load()
        if rank == 0 and step:
            print(f"resumed from step {step} (samples_seen {sampler.consumed})", flush=True)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    if ip is None and dist.is_initialized():
        # DDP re-buckets gradients after its first backward, which changes the order in which
        # gradient elements are summed across ranks. One backward of a zero loss makes it do so
        # before the first real step of every (re)start, so a resumed run sums in exactly the
        # same order as an uninterrupted one: resumes are bitwise equal at any world size.
        ddp(x_all[:1].to(device)).sum().mul(0.0).backward()
        opt.zero_grad(set_to_none=True)

    # Every opt.step() runs at the schedule's LR times the scale for this world size.
    lr_scaling = er.scale_lr(opt)

    saved_step = step
    stop = False
    while step < args.steps:
        if ip is not None and ip.switch_pending():
            step = ip.switch(step)
            rank, world = er.rank(), er.world_size()
            batch = args.batch_size or er.batch_size(32)
            accum = er.grad_accum_steps()
            # The new generation's share of the global batch (a fixed global batch changes the
            # per-worker batch or the accumulation with the world).
            sampler.batch_size = batch
            if sample_log is not None:
                os.close(sample_log)
                sample_log = open_sample_log(args.sample_log, rank)
        step += 1
        lr = opt.param_groups[0]["lr"] * lr_scaling.factor(step)
        # This rank's share of the job's next global batch, micro-batch after micro-batch.
        mine = torch.tensor(sampler.rank_ids(sampler.ids(sampler.consumed, sampler.global_batch())))
        opt.zero_grad()
        total = 0.0
        with (ip.step() if ip is not None else contextlib.nullcontext()):
            for a in range(accum):
                micro = mine[a * batch:(a + 1) * batch]
                x, y = x_all[micro].to(device), y_all[micro].to(device)
                # The gradients of the micro-batches add up locally; the last one's backward
                # averages them over the ranks.
                local = a < accum - 1 and hasattr(ddp, "no_sync")
                with (ddp.no_sync() if local else contextlib.nullcontext()):
                    loss = torch.nn.functional.mse_loss(ddp(x), y) / accum
                    loss.backward()
                total += loss.item()
        if ip is not None and args.slow_voter == os.environ.get("ELASTIC_NODE_ID"):
            time.sleep(args.slow_vote_s)
        if ip is not None and not ip.commit():
            # The step failed on some rank (a peer is gone): no rank applies it.
            print(f"rank {rank}: the vote dropped step {step}: {ip.failed}", flush=True)
            step -= 1
            continue
        opt.step()
        sched.step()
        sampler.advance()
        if sample_log is not None:
            # One write per line, before the step is reported: a step that a checkpoint
            # holds is in every rank's log.
            line = {"generation": er.generation(), "step": step, "rank": rank, "world": world,
                    "accum": accum, "batch": batch, "ids": mine.tolist()}
            os.write(sample_log, (json.dumps(line) + "\n").encode())
        if rank == 0:
            print(f"step {step} loss {total:.6f} lr {lr:.6g} world {world} accum {accum}", flush=True)
        er.report_progress(step)
        if (step == args.crash_at and rank == args.crash_rank
                and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < args.crash_restarts):
            print(f"rank {rank} crashing at step {step} on purpose", flush=True)
            os._exit(3)
        stop = er.should_stop(step)
        if stop or er.should_checkpoint(step) or step == args.steps:
            state["progress"] = {"world_size": world}
            state["rng"] = torch.get_rng_state()
            if stop or step == args.steps:
                # The last one: written before the worker exits.
                er.save(step, state)
            else:
                # Returns once the state is captured; a thread writes it while the next step
                # runs (opt.step() waits for the write before it changes the weights).
                er.async_save(step, state)
            saved_step = step
            if rank == 0:
                print(f"saved step {step}", flush=True)
        if stop:
            if rank == 0:
                print(f"stopping at step {step} (drain)", flush=True)
            break
        if args.step_sleep:
            time.sleep(args.step_sleep)

    if rank == 0:
        print(f"done step {step} saved {saved_step} weights {weights_digest(model)}", flush=True)
    if args.digest_every_rank:
        print(f"rank {rank} done step {step} weights {weights_digest(model)}", flush=True)
    if stop and args.exit_linger:
        time.sleep(args.exit_linger)
    if dist.is_initialized():
        dist.destroy_process_group()
    if ip is not None:
        ip.close()


if __name__ == "__main__":
    main()
