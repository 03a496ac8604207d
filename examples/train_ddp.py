#!/usr/bin/env python3
"""Data-parallel training with PyTorch DDP, gradients averaged by a tally
pool or by gloo, for comparison.

    /usr/bin/python3 examples/train_ddp.py --world-size 4 --steps 20
    /usr/bin/python3 examples/train_ddp.py --world-size 4 --steps 20 --backend gloo

--backend picks who averages the gradients:
    tally       the tally DDP hook, beside a gloo process group (the default)
    tally-bf16  the same on the bfloat16 wire (TALLY_WIRE_DTYPE=bfloat16)
    tally-pg    init_process_group("tally"): no hook, DDP's own all-reduce
    gloo        gloo's all-reduce
    gloo-fp16   gloo with DDP's fp16_compress_hook (16-bit values on the wire)
    nccl        NCCL's all-reduce (--device cuda, one GPU per rank)
    none        no communication at all: each rank keeps its own gradients
                (the step time's floor)

--model mlp (small, the default) or transformer (an nn.TransformerEncoder
classifier of token sequences; --vocab, --d-model, --layers size it: the
defaults make 32M parameters, 128 MB of float32 gradients, most of them the
embeddings). --device cuda puts the model
on the GPU (ranks share cuda:0 when there is one GPU); its buckets then go
through pinned host memory (tally.staging). --stage-host sends CPU buckets
through that same staging pipeline (tally.staging.HostCopier): the tests'
way to run the CUDA path where no GPU is.

Ranks: with RANK and WORLD_SIZE in the environment (torchrun, Kubeflow's
PyTorchJob, tally-bench run) this process is one rank and rendezvous is
env:// (MASTER_ADDR, MASTER_PORT); otherwise it spawns --world-size ranks
itself (torch.multiprocessing, a file rendezvous). The tally modes use
TALLY_POOL if set, else --pool, else a local pool of --shards reducers it
starts itself. Rank 0 prints its loss and time per step as it goes, then
the mean loss over ranks per step, and writes --json / --save-params.
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
import tally.staging
import tally.torch

BACKENDS = ["tally", "tally-bf16", "tally-pg", "gloo", "gloo-fp16", "nccl", "none"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default="tally")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over ranks")
    p.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    p.add_argument("--features", type=int, default=64, help="mlp: inputs")
    p.add_argument("--hidden", type=int, default=512, help="mlp: hidden width")
    p.add_argument("--classes", type=int, default=10, help="outputs")
    p.add_argument("--layers", type=int, default=2, help="transformer: encoder layers")
    p.add_argument("--d-model", type=int, default=512, help="transformer: width")
    p.add_argument("--vocab", type=int, default=50000, help="transformer: tokens")
    p.add_argument("--seq-len", type=int, default=32, help="transformer: tokens per sample")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--stage-host",
        action="store_true",
        help="tally modes: stage CPU buckets as CUDA ones are (tally.staging)",
    )
    p.add_argument("--shards", type=int, default=2, help="reducers of the local pool")
    p.add_argument("--reducer", help="tally-reducer binary for the local pool")
    p.add_argument("--pool", help="use this pool (host:port,...) (TALLY_POOL wins)")
    p.add_argument("--op-timeout-ms", type=int, default=10000)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", help="write losses and step times here (rank 0)")
    p.add_argument("--save-params", help="torch.save the final parameters here (rank 0)")
    return p.parse_args(argv)


class TokenClassifier(nn.Module):
    """A transformer over token sequences that classifies each sequence:
    embeddings of a large vocabulary (most of the parameters, as in language
    and recommendation models), L encoder layers, the mean over the
    sequence, a linear head. Its gradients are large and its compute small,
    which is the regime a reduction server is for."""

    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.d_model)
        layer = nn.TransformerEncoderLayer(
            args.d_model, nhead=8, dim_feedforward=4 * args.d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, args.layers)
        self.head = nn.Linear(args.d_model, args.classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def make_model(args):
    if args.model == "transformer":
        return TokenClassifier(args)
    return nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.classes),
    )


def make_data(args, n=8192):
    g = torch.Generator().manual_seed(args.seed + 1)
    if args.model == "transformer":
        tokens = torch.randint(0, args.vocab, (n, args.seq_len), generator=g)
        return tokens, tokens.sum(dim=1) % args.classes
    x = torch.randn(n, args.features, generator=g)
    teacher = torch.randn(args.features, args.classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, args.classes, generator=g)).argmax(dim=1)
    return x, y


def _keep_local(state, bucket):
    """The floor: no communication, each rank's own gradient."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def attach(args, ddp, rank, world, pool, job):
    """Registers what averages the gradients; returns the tally client, if any."""
    if args.backend == "gloo-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.backend == "none":
        ddp.register_comm_hook(None, _keep_local)
    elif args.backend in ("tally", "tally-bf16"):
        client = tally.Client(
            pool=pool,
            job=job,
            rank=rank,
            world_size=world,
            op_timeout_ms=args.op_timeout_ms,
            wire_dtype="bfloat16" if args.backend == "tally-bf16" else None,
        )
        state = client
        if args.stage_host:
            state = tally.staging.Stager(client, tally.staging.HostCopier())
        ddp.register_comm_hook(state, tally.torch.allreduce_hook)
        return client
    return None


def worker(rank, args, pool, job, init_method):
    torch.set_num_threads(args.threads)
    world = args.world_size
    if args.backend == "tally-pg":
        os.environ["TALLY_POOL"] = pool  # the backend reads its pool from the environment
        os.environ.setdefault("TALLY_JOB", job)
        os.environ.setdefault("TALLY_OP_TIMEOUT_MS", str(args.op_timeout_ms))
    group = {"tally-pg": "tally", "nccl": "nccl"}.get(args.backend, "gloo")
    dist.init_process_group(group, init_method=init_method, rank=rank, world_size=world)
    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if args.device == "cuda"
        else torch.device("cpu")
    )
    torch.manual_seed(args.seed)
    model = make_model(args).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    client = attach(args, ddp, rank, world, pool, job)
    x, y = make_data(args)
    order = torch.Generator().manual_seed(args.seed + 2)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    per_rank = args.batch_size // world
    losses, times = [], []
    dist.barrier()
    start = time.perf_counter()
    try:
        for step in range(args.steps):
            start = time.perf_counter()
            batch = torch.randint(0, x.shape[0], (args.batch_size,), generator=order)
            mine = batch[rank * per_rank : (rank + 1) * per_rank]
            opt.zero_grad(set_to_none=True)
            out = ddp(x[mine].to(device))
            target = y[mine].to(device)
            loss = loss_fn(out.reshape(-1, out.shape[-1]), target.reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())  # waits for the device
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            if rank == 0:
                print(
                    "step %3d  loss %.6f  time_ms %.2f" % (step, losses[-1], elapsed * 1e3),
                    flush=True,
                )
    except Exception as e:
        print(
            "rank %d failed at step %d after %.3f s: %s: %s"
            % (rank, len(losses), time.perf_counter() - start, type(e).__name__, e),
            file=sys.stderr,
            flush=True,
        )
        raise
    # Mean over ranks of the local losses: the loss of the global batch.
    mean = torch.tensor(losses, dtype=torch.float64, device=device if group == "nccl" else "cpu")
    dist.all_reduce(mean)
    mean /= world
    if rank == 0:
        steady = sorted(times[2:] or times)
        result = {
            "backend": args.backend,
            "world_size": world,
            "steps": args.steps,
            "model": args.model,
            "device": args.device,
            "params": sum(p.numel() for p in model.parameters()),
            "loss": mean.tolist(),
            "step_ms": [t * 1e3 for t in times],
            "median_step_ms": steady[len(steady) // 2] * 1e3,
            "mean_step_ms": sum(steady) / len(steady) * 1e3,
        }
        print(
            "# backend=%s W=%d model=%s params=%d median step %.2f ms, mean %.2f ms (steps 2..)"
            % (
                args.backend,
                world,
                args.model,
                result["params"],
                result["median_step_ms"],
                result["mean_step_ms"],
            ),
            flush=True,
        )
        for i, v in enumerate(result["loss"]):
            print("mean_loss %3d %.6f" % (i, v))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.save_params:
            torch.save(
                {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                args.save_params,
            )
    if client is not None:
        client.close()
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        args.world_size = int(os.environ["WORLD_SIZE"])
    if args.batch_size % args.world_size:
        sys.exit("--batch-size must be a multiple of the world size")
    pool = os.environ.get("TALLY_POOL") or args.pool
    # One job name for every rank: torchrun's run and incarnation when it
    # launched us, else this launcher's pid.
    job = os.environ.get("TALLY_JOB") or "train-ddp-%s" % (
        os.environ.get("TORCHELASTIC_RUN_ID", os.getpid())
    )
    if launched:
        if args.backend.startswith("tally") and not pool:
            sys.exit("train_ddp: set TALLY_POOL (or --pool) when a launcher starts the ranks")
        try:
            worker(int(os.environ["RANK"]), args, pool, job, "env://")
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    local_pool = None
    with tempfile.TemporaryDirectory(prefix="train-ddp-") as tmp:
        try:
            if args.backend.startswith("tally") and not pool:
                local_pool = tally.pool.LocalPool(
                    shards=args.shards, reducer=args.reducer, args=["--log-level", "warn"]
                )
                pool = local_pool.address
                print("# local pool %s" % pool, flush=True)
            mp.spawn(
                worker,
                args=(args, pool, job, "file://" + os.path.join(tmp, "init")),
                nprocs=args.world_size,
                join=True,
            )
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
