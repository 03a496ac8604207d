#!/usr/bin/env python3
"""The DDP hook's all-reduce of one bucket vs tally-bench, same pool, same size.

    /usr/bin/python3 examples/bench_hook.py --bench build/bench/tally-bench --sizes 1M,4M,25M
    python3 examples/bench_hook.py --bench none --devices cpu,cuda --sizes 25M

Starts one local pool (--shards reducers), runs `tally-bench --pool` on it
(W workers, avg, -w 5 -n 20; --bench none skips it), then W Python
processes that call tally.torch.allreduce_hook on a bucket of the same size
and wait for its future, timed the way tally-bench times (warm-up, a
barrier, then the mean of back-to-back iterations, averaged over ranks),
once per device of --devices: a bucket on cuda goes through tally.staging
(pinned host pieces, copies overlapped with the network), and its time runs
until its results are back on the device. "staged" is a CPU bucket driven
through the same pipeline (tally.staging.HostCopier: a thread stands for
the copy stream), which tells the pieces' cost from the GPU copies'. Prints
each time and the ratios: hook/tally-bench, and each device's time over the
first device's.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import tally
import tally.pool
import tally.staging
import tally.torch


class Bucket:
    """What DDP hands a comm hook, as far as allreduce_hook uses it."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer

    def index(self):
        return 0


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def worker(rank, args, pool, job, sizes, devices, out):
    torch.set_num_threads(1)
    client = tally.Client(pool=pool, job=job, rank=rank, world_size=args.workers, env=False)
    barrier = torch.zeros(1, dtype=torch.float64)
    results = {}
    for device in devices:
        on_gpu = device.startswith("cuda")
        stager = None
        if device == "staged":
            stager = tally.staging.Stager(client, tally.staging.HostCopier())
        for nbytes in sizes:
            where = "cpu" if stager else device
            bucket = Bucket(torch.ones(nbytes // 4, dtype=torch.float32, device=where))

            def step():
                if stager:
                    stager.start(bucket.buffer(), "avg").future.wait()
                    return
                tally.torch.allreduce_hook(client, bucket).wait()
                if on_gpu:  # until the results are back on the device
                    torch.cuda.current_stream().synchronize()

            for _ in range(args.warmup):
                step()
            client.allreduce(barrier)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            t1 = time.perf_counter()
            mine = torch.tensor([(t1 - t0) / args.iters * 1e6], dtype=torch.float64)
            client.allreduce(mine, op="avg")  # the mean over ranks, as tally-bench reports
            results["%s %d" % (device, nbytes)] = mine.item()
            if not torch.equal(bucket.buffer().cpu(), torch.ones(nbytes // 4)):
                raise SystemExit("rank %d: the average of ones is not ones on %s" % (rank, device))
            client.allreduce(barrier)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    client.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", default=os.environ.get("TALLY_BENCH", "build/bench/tally-bench"))
    p.add_argument("--reducer", help="tally-reducer (default: $TALLY_REDUCER or PATH)")
    p.add_argument("--sizes", default="1M,4M,25M")
    p.add_argument(
        "--devices",
        default="cpu",
        help="where the buckets are: cpu, cuda, staged (a CPU bucket through tally.staging), "
        "comma-separated",
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    devices = args.devices.split(",")
    with tempfile.TemporaryDirectory() as tmp, tally.pool.LocalPool(
        shards=args.shards, reducer=args.reducer, args=["--log-level", "warn"]
    ) as pool:
        bench = {}
        for nbytes in sizes if args.bench != "none" else []:
            path = os.path.join(tmp, "bench-%d.json" % nbytes)
            subprocess.run(
                [
                    args.bench,
                    "--pool",
                    pool.address,
                    "-W",
                    str(args.workers),
                    "-b",
                    str(nbytes),
                    "-e",
                    str(nbytes),
                    "-o",
                    "avg",
                    "-w",
                    str(args.warmup),
                    "-n",
                    str(args.iters),
                    "--json",
                    path,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            with open(path) as f:
                rows = json.load(f)
            bench[nbytes] = rows["rows"][0]["time_us"]
        out = os.path.join(tmp, "hook.json")
        mp.spawn(
            worker,
            args=(args, pool.address, "bench-hook-%d" % os.getpid(), sizes, devices, out),
            nprocs=args.workers,
            join=True,
        )
        with open(out) as f:
            hook = json.load(f)
    print(
        "# W=%d S=%d, op avg, float32, warm-up %d, timed %d; time is the mean over ranks"
        % (args.workers, args.shards, args.warmup, args.iters)
    )
    head = ["size"] + (["tally-bench(us)"] if bench else [])
    head += ["hook %s(us)" % d for d in devices] + (["/tally-bench"] if bench else [])
    head += ["%s/%s" % (d, devices[0]) for d in devices[1:]]
    print(" ".join("%16s" % h for h in head))
    for nbytes in sizes:
        times = [hook["%s %d" % (d, nbytes)] for d in devices]
        row = ["%d" % nbytes] + (["%.1f" % bench[nbytes]] if bench else [])
        row += ["%.1f" % t for t in times] + (
            ["%.3f" % (times[0] / bench[nbytes])] if bench else []
        )
        row += ["%.3f" % (t / times[0]) for t in times[1:]]
        print(" ".join("%16s" % r for r in row))


if __name__ == "__main__":
    sys.exit(main())
