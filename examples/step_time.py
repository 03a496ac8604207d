#!/usr/bin/env python3
"""What a training step gains from the pool on a capped network: runs
examples/train_ddp.py under each way of averaging gradients, every rank and
reducer on a host of its own in tally-bench's network lab, and prints the
median step time of each beside the step with no communication at all.

    sudo /usr/bin/python3 examples/step_time.py --netlab 1gbit -W 4 -S 4

The communication part of a step is its time minus the floor's (the same
step with no all-reduce: --backend none). The table gives each mode's
communication part and its ratio to gloo's (lower is better). Every mode
runs the same model, data and seed; extra arguments after -- go to
train_ddp.py (the defaults: the 29M-parameter transformer, DDP's 25 MiB
buckets, one sample of --seq-len 8 tokens per rank). The batch is small on
purpose: the lab's hosts share the machine's cores, and a step whose
compute takes seconds there (it takes milliseconds on a GPU) would hide the
network, which is what is measured. Needs root (network namespaces) and tally-bench (--bench, else
$TALLY_BENCH, else build/bench/tally-bench of this checkout).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["none", "gloo", "gloo-fp16", "tally", "tally-bf16"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--netlab", default="1gbit", help="each host's link rate (tc units)")
    p.add_argument("-W", "--workers", type=int, default=4)
    p.add_argument("-S", "--shards", type=int, default=4, help="reducers of the pool")
    p.add_argument("--steps", type=int, default=8, help="steps per mode (the first 2 not timed)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=8,
        help="tokens per sample (one sample per rank): the compute of a step",
    )
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated train_ddp --backend values"
    )
    p.add_argument("--link-rate", help="tell the pool its links' rate (default: not told)")
    p.add_argument(
        "--bench",
        default=os.environ.get("TALLY_BENCH")
        or os.path.join(HERE, "..", "build", "bench", "tally-bench"),
    )
    p.add_argument("--json", help="write every mode's result here")
    p.add_argument("train_args", nargs="*", help="after --: more train_ddp.py arguments")
    return p.parse_args(argv)


def run_mode(args, mode, out):
    told = ["--link-rate", args.link_rate] if args.link_rate else []
    cmd = (
        [
            args.bench,
            "run",
            "-W",
            str(args.workers),
            "-r",
            str(args.shards),
            "--netlab",
            args.netlab,
        ]
        + told
        + [
            "--",
            sys.executable,
            os.path.join(HERE, "train_ddp.py"),
            "--backend",
            mode,
            "--steps",
            str(args.steps),
            "--model",
            "transformer",
            "--batch-size",
            str(args.workers),
            "--seq-len",
            str(args.seq_len),
            "--json",
            out,
        ]
        + args.train_args
    )
    print("# " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit("step_time: %s failed:\n%s" % (mode, r.stdout[-4000:]))
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="step-time-") as tmp:
        for mode in args.modes.split(","):
            results[mode] = run_mode(args, mode, os.path.join(tmp, mode + ".json"))
    floor = results["none"]["median_step_ms"] if "none" in results else None
    gloo = results["gloo"]["median_step_ms"] if "gloo" in results else None
    params = next(iter(results.values()))["params"]
    print(
        "# step time, W=%d, S=%d, %s links (network lab), link rate %s, %d parameters (%.0f MB "
        "of float32 gradients), median of steps 2..%d"
        % (
            args.workers,
            args.shards,
            args.netlab,
            "told: " + args.link_rate if args.link_rate else "not told",
            params,
            params * 4 / 1e6,
            args.steps - 1,
        )
    )
    print("# comm = step - floor (the step with no communication); comm/gloo = comm / gloo's comm")
    print("%-12s %12s %12s %12s" % ("mode", "step(ms)", "comm(ms)", "comm/gloo"))
    for mode, r in results.items():
        step = r["median_step_ms"]
        comm = step - floor if floor is not None else float("nan")
        ratio = (
            comm / (gloo - floor)
            if floor is not None and gloo is not None and gloo > floor
            else float("nan")
        )
        print("%-12s %12.1f %12.1f %12.3f" % (mode, step, comm, ratio))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
