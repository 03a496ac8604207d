#!/usr/bin/env python3
"""Data-parallel training with PyTorch DDP, gradients averaged by a tally
pool (the default) or by gloo (--backend gloo), for comparison.

    /usr/bin/python3 examples/train_ddp.py --world-size 4 --steps 20
    /usr/bin/python3 examples/train_ddp.py --world-size 4 --steps 20 --backend gloo

W worker processes (torch.multiprocessing.spawn) train an MLP on a generated
classification set (a fixed random "teacher" network labels Gaussian
inputs), same seed everywhere. With tally, the example starts a local pool
of --shards tally-reducer processes (found by --reducer, $TALLY_REDUCER or
PATH) unless --pool or $TALLY_POOL names one. DDP itself runs on gloo (its
initial parameter broadcast); only the gradient all-reduce goes through the
hook. Rank 0 prints its loss and time per step as it goes, then the mean
loss over ranks per step, and writes --json / --save-params if asked.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import tally
import tally.pool
import tally.torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["tally", "gloo"], default="tally")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over ranks")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    p.add_argument("--shards", type=int, default=2, help="reducers of the local pool")
    p.add_argument("--reducer", help="tally-reducer binary for the local pool")
    p.add_argument("--pool", default=os.environ.get("TALLY_POOL"), help="use this pool (host:port,...)")
    p.add_argument("--op-timeout-ms", type=int, default=10000)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", help="write losses and step times here (rank 0)")
    p.add_argument("--save-params", help="torch.save the final parameters here (rank 0)")
    return p.parse_args(argv)


def make_model(args):
    return nn.Sequential(
        nn.Linear(args.features, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, args.classes))


def make_data(args, n=8192):
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(n, args.features, generator=g)
    teacher = torch.randn(args.features, args.classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, args.classes, generator=g)).argmax(dim=1)
    return x, y


def worker(rank, args, pool, job, init_file):
    torch.set_num_threads(args.threads)
    world = args.world_size
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    torch.manual_seed(args.seed)
    model = make_model(args)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    client = None
    if args.backend == "tally":
        client = tally.Client(pool=pool, job=job, rank=rank, world_size=world,
                              op_timeout_ms=args.op_timeout_ms, env=False)
        ddp.register_comm_hook(client, tally.torch.allreduce_hook)
    x, y = make_data(args)
    order = torch.Generator().manual_seed(args.seed + 2)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    per_rank = args.batch_size // world
    losses, times = [], []
    dist.barrier()
    try:
        for step in range(args.steps):
            start = time.perf_counter()
            batch = torch.randint(0, x.shape[0], (args.batch_size,), generator=order)
            mine = batch[rank * per_rank:(rank + 1) * per_rank]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x[mine]), y[mine])
            loss.backward()
            opt.step()
            elapsed = time.perf_counter() - start
            losses.append(loss.item())
            times.append(elapsed)
            if rank == 0:
                print("step %3d  loss %.6f  time_ms %.2f" % (step, losses[-1], elapsed * 1e3), flush=True)
    except Exception as e:
        print("rank %d failed at step %d after %.3f s: %s: %s"
              % (rank, len(losses), time.perf_counter() - start, type(e).__name__, e),
              file=sys.stderr, flush=True)
        raise
    # Mean over ranks of the local losses: the loss of the global batch.
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    mean /= world
    if rank == 0:
        steady = sorted(times[2:] or times)
        result = {
            "backend": args.backend, "world_size": world, "steps": args.steps,
            "params": sum(p.numel() for p in model.parameters()),
            "loss": mean.tolist(), "step_ms": [t * 1e3 for t in times],
            "median_step_ms": steady[len(steady) // 2] * 1e3,
            "mean_step_ms": sum(steady) / len(steady) * 1e3,
        }
        print("# backend=%s W=%d params=%d median step %.2f ms, mean %.2f ms (steps 2..)"
              % (args.backend, world, result["params"], result["median_step_ms"],
                 result["mean_step_ms"]), flush=True)
        for i, v in enumerate(result["loss"]):
            print("mean_loss %3d %.6f" % (i, v))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.save_params:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save_params)
    if client is not None:
        client.close()
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if args.batch_size % args.world_size:
        sys.exit("--batch-size must be a multiple of --world-size")
    local_pool = None
    pool = args.pool
    with tempfile.TemporaryDirectory(prefix="train-ddp-") as tmp:
        try:
            if args.backend == "tally" and not pool:
                local_pool = tally.pool.LocalPool(shards=args.shards, reducer=args.reducer,
                                                  args=["--log-level", "warn"])
                pool = local_pool.address
                print("# local pool %s" % pool, flush=True)
            job = "train-ddp-%d" % os.getpid()
            mp.spawn(worker, args=(args, pool, job, os.path.join(tmp, "init")),
                     nprocs=args.world_size, join=True)
        except mp.ProcessRaisedException as e:
            print("train_ddp: a rank failed:\n%s" % e, file=sys.stderr, flush=True)
            return 1
        except mp.ProcessExitedException as e:
            print("train_ddp: %s" % e, file=sys.stderr, flush=True)
            return 1
        except Exception:
            traceback.print_exc()
            return 1
        finally:
            if local_pool is not None:
                local_pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
