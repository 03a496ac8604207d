#!/usr/bin/env python3
"""Sizing a tally pool: the all-reduce bandwidth and reducer CPU a pool of W
workers and S shards x G groups reaches on links of a given rate, from a
machine's measured per-byte costs, and a ring all-reduce on the same links.

    sizing.py predict -W 256 -S 64 --link 100gbit --size 64M
    sizing.py plan -W 1024 --link 400gbit --size 64M
    sizing.py check --link 1gbit --shared-cores 2 run.json [run.json ...]

The model (docs/operations.md, "Sizing a pool"): an op of N bytes moves N
each way on every worker's link, and w_g x N/S (+ the replica exchange) each
way on every reducer's; it takes the slowest of those links, of the
reducers' and workers' CPU at their per-byte costs, plus a fixed per-op
time. `check` compares it with tally-bench --json runs (the lab's hosts
share --shared-cores cores, so there the CPU of every process adds up).
"""

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_rate(text):
    """A link rate in tc's units (1gbit, 400gbit, 25000mbit) -> bits/s."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)bit\s*", text.lower())
    if not m:
        raise ValueError("link rate %r: expected a number and kbit, mbit, gbit or tbit" % text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_size(text):
    """A byte count: 4096, 64K, 16M, 1G (binary units)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kmg]?)i?b?\s*", text.lower())
    if not m:
        raise ValueError("size %r: expected a number with an optional K, M or G" % text)
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


@dataclass
class Costs:
    """A machine's measured costs (tally-bench on loopback prints them). The
    defaults are the 2-core machine of docs/benchmarking.md ("Sizing model");
    measure yours with the commands there."""

    # Worker CPU per GB it sends (its receives included): "workers ... s/GB
    # sent" of tally-bench's cpu line.
    worker_s_per_gb: float = 0.60
    # Reducer CPU per GB it receives (its sums and sends included):
    # "reducers ... s/GB received".
    reducer_s_per_gb: float = 0.55
    # A small op's time, the per-op floor (tally-bench -b 4K -e 4K).
    op_seconds: float = 120e-6
    # A bare TCP stream's CPU per GB, send plus receive (tally-bench prints
    # it), for the ring.
    stream_s_per_gb: float = 0.45
    # One step of a ring: a small message's round trip on the link.
    ring_step_seconds: float = 60e-6
    # The payload's share of what a link carries: TCP with timestamps over a
    # 1500-byte MTU puts 1448 bytes in each 1514-byte frame (0.993 at 9000).
    wire_efficiency: float = 1448 / 1514


@dataclass
class Pool:
    workers: int
    shards: int
    groups: int = 1
    worker_link_bps: float = 1e9
    reducer_link_bps: float = 0.0  # 0: the workers' rate
    reducer_cores: int = 2  # I/O threads each reducer runs on cores of its own
    shared_cores: int = 0  # > 0: every process shares this many cores (one host)

    def reducer_link(self):
        return self.reducer_link_bps or self.worker_link_bps


@dataclass
class Prediction:
    seconds: float
    algbw_gbps: float  # GB/s, N / seconds
    bound: str  # what limits it
    reducer_cores_busy: float  # CPU a reducer burns at that speed, in cores
    reducer_bytes: float  # each way per op, on each reducer's link


def replica_bytes(groups, shard_bytes):
    """Each way per op on a reducer, to and from its shard's other replicas
    (the butterfly of docs/architecture.md, "Traffic"; exact for powers of
    two, the mean otherwise)."""
    if groups <= 1:
        return 0.0
    return 2.0 * (groups - 1) / groups * shard_bytes


def predict(pool, costs, nbytes):
    """The time and algbw of one all-reduce of `nbytes` through `pool`."""
    w_g = pool.workers / pool.groups
    shard = nbytes / pool.shards
    from_workers = w_g * shard
    per_reducer = from_workers + replica_bytes(pool.groups, shard)
    eff = costs.wire_efficiency
    terms = {
        "worker link": nbytes * 8 / (pool.worker_link_bps * eff),
        "reducer link": per_reducer * 8 / (pool.reducer_link() * eff),
    }
    worker_cpu = costs.worker_s_per_gb * nbytes / 1e9
    reducer_cpu = costs.reducer_s_per_gb * per_reducer / 1e9
    if pool.shared_cores > 0:
        total = pool.workers * worker_cpu + pool.shards * pool.groups * reducer_cpu
        terms["shared cpu"] = total / pool.shared_cores
    else:
        # One worker thread does its I/O; a reducer spreads its streams over
        # its cores, at most one stream per core.
        terms["worker cpu"] = worker_cpu
        streams = w_g + (pool.groups - 1)
        terms["reducer cpu"] = reducer_cpu / max(1, min(pool.reducer_cores, streams))
    bound = max(terms, key=terms.get)
    seconds = costs.op_seconds + terms[bound]
    busy = reducer_cpu / seconds
    return Prediction(seconds, nbytes / seconds / 1e9, bound, busy, per_reducer)


def predict_ring(workers, link_bps, costs, nbytes, shared_cores=0):
    """A ring all-reduce on the workers' own links: 2(W-1)/W x N each way
    per worker in 2(W-1) steps."""
    moved = 2.0 * (workers - 1) / workers * nbytes
    wire = moved * 8 / (link_bps * costs.wire_efficiency)
    cpu = costs.stream_s_per_gb * moved / 1e9
    if shared_cores > 0:
        cpu = workers * cpu / shared_cores
    seconds = 2 * (workers - 1) * costs.ring_step_seconds + max(wire, cpu)
    return nbytes / seconds / 1e9


def plan(workers, link_bps, nbytes, costs, target=0.9, reducer_link_bps=0.0, max_cores=64):
    """The fewest reducers (one group) and cores each that reach `target` of
    the workers' link rate, or the best there is; with the ring beside it."""
    line = link_bps / 8 / 1e9  # GB/s
    best = None
    for shards in range(1, 4 * workers + 1):
        for cores in range(1, max_cores + 1):
            pool = Pool(workers, shards, 1, link_bps, reducer_link_bps, cores)
            p = predict(pool, costs, nbytes)
            if p.algbw_gbps >= target * line:
                return shards, cores, p, predict_ring(workers, link_bps, costs, nbytes)
            if p.bound != "reducer cpu":
                break  # more cores do not help
        if best is None or p.algbw_gbps > best[2].algbw_gbps * 1.001:
            best = (shards, cores, p)
    shards, cores, p = best
    return shards, cores, p, predict_ring(workers, link_bps, costs, nbytes)


def ring_crossover(workers, link_bps, nbytes, costs, cores, reducer_link_bps=0.0):
    """The fewest reducers (one group, `cores` each) at which the pool is
    at least as fast as a ring; with fewer, the ring is faster. None when
    no pool of up to 4W reducers is."""
    ring = predict_ring(workers, link_bps, costs, nbytes)
    for shards in range(1, 4 * workers + 1):
        pool = Pool(workers, shards, 1, link_bps, reducer_link_bps, cores)
        if predict(pool, costs, nbytes).algbw_gbps >= ring:
            return shards
    return None


def _ring_wins(crossover):
    if crossover is None:
        return "every pool"
    if crossover == 1:
        return "no pool"
    return "pools of under %d reducers" % crossover


def check(doc, link_bps, costs, shared_cores, min_bytes):
    """(size, measured, predicted, ratio) for each row of a tally-bench
    --json run of at least `min_bytes`."""
    pool = Pool(doc["workers"], doc["shards"], doc["groups"], link_bps, 0.0, 2, shared_cores)
    out = []
    for row in doc["rows"]:
        if row["size"] < min_bytes:
            continue
        p = predict(pool, costs, row["size"])
        out.append((row["size"], row["algbw_gbps"], p.algbw_gbps, row["algbw_gbps"] / p.algbw_gbps))
    return out


def _costs(args):
    return Costs(
        args.worker_cpu,
        args.reducer_cpu,
        args.op_us * 1e-6,
        args.stream_cpu,
        args.ring_step_us * 1e-6,
        args.wire_efficiency,
    )


def _add_costs(p):
    d = Costs()
    p.add_argument("--worker-cpu", type=float, default=d.worker_s_per_gb, help="s per GB sent")
    p.add_argument(
        "--reducer-cpu", type=float, default=d.reducer_s_per_gb, help="s per GB received"
    )
    p.add_argument("--op-us", type=float, default=d.op_seconds * 1e6, help="a small op's time")
    p.add_argument(
        "--stream-cpu", type=float, default=d.stream_s_per_gb, help="bare TCP stream, s per GB"
    )
    p.add_argument("--ring-step-us", type=float, default=d.ring_step_seconds * 1e6)
    p.add_argument(
        "--wire-efficiency", type=float, default=d.wire_efficiency, help="payload share of a link"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("predict", help="algbw and reducer CPU of one pool")
    pr.add_argument("-W", "--workers", type=int, required=True)
    pr.add_argument("-S", "--shards", type=int, required=True)
    pr.add_argument("-G", "--groups", type=int, default=1)
    pr.add_argument("--cores", type=int, default=2, help="cores (I/O threads) per reducer")
    pl = sub.add_parser("plan", help="the fewest reducers and cores for a target")
    pl.add_argument("-W", "--workers", type=int, required=True)
    pl.add_argument("--target", type=float, default=0.9, help="fraction of the link rate")
    for p in (pr, pl):
        p.add_argument("--link", required=True, help="workers' link rate (tc units, e.g. 100gbit)")
        p.add_argument("--reducer-link", help="reducers' link rate (default: the workers')")
        p.add_argument("--size", default="64M", help="tensor bytes (e.g. 25M)")
    ck = sub.add_parser("check", help="the model against tally-bench --json runs")
    ck.add_argument("--link", required=True)
    ck.add_argument("--shared-cores", type=int, default=0, help="cores every process shares")
    ck.add_argument("--min-size", default="1M")
    ck.add_argument("runs", nargs="+")
    for p in (pr, pl, ck):
        _add_costs(p)
    args = ap.parse_args(argv)
    costs = _costs(args)
    try:
        link = parse_rate(args.link)
        if args.cmd == "check":
            return _check(args, link, costs)
        reducer_link = parse_rate(args.reducer_link) if args.reducer_link else 0.0
        nbytes = parse_size(args.size)
    except ValueError as e:
        ap.error(str(e))
    if args.cmd == "predict":
        pool = Pool(args.workers, args.shards, args.groups, link, reducer_link, args.cores)
        p = predict(pool, costs, nbytes)
        ring = predict_ring(args.workers, link, costs, nbytes)
        print(
            "W=%d S=%d G=%d, %s links, %d bytes: algbw %.3f GB/s (%.0f%% of the link), "
            "bound by the %s; each reducer moves %.0f bytes each way per op and burns "
            "%.1f cores; a ring: %.3f GB/s (tally/ring %.2fx)"
            % (
                args.workers,
                args.shards,
                args.groups,
                args.link,
                nbytes,
                p.algbw_gbps,
                100 * p.algbw_gbps / (link / 8e9),
                p.bound,
                p.reducer_bytes,
                p.reducer_cores_busy,
                ring,
                p.algbw_gbps / ring,
            )
        )
        return 0
    shards, cores, p, ring = plan(args.workers, link, nbytes, costs, args.target, reducer_link)
    crossover = ring_crossover(args.workers, link, nbytes, costs, cores, reducer_link)
    print(
        "W=%d, %s links, %d bytes: %d reducers of %d cores each reach %.3f GB/s "
        "(%.0f%% of the link, bound by the %s); a ring: %.3f GB/s (tally/ring %.2fx), "
        "faster than %s"
        % (
            args.workers,
            args.link,
            nbytes,
            shards,
            cores,
            p.algbw_gbps,
            100 * p.algbw_gbps / (link / 8e9),
            p.bound,
            ring,
            p.algbw_gbps / ring,
            _ring_wins(crossover),
        )
    )
    return 0


def _check(args, link, costs):
    worst = 0.0
    print("# %-28s %10s %10s %10s %7s" % ("run", "size", "measured", "model", "ratio"))
    for path in args.runs:
        with open(path) as f:
            doc = json.load(f)
        name = "W=%d S=%d G=%d" % (doc["workers"], doc["shards"], doc["groups"])
        for size, measured, model, ratio in check(
            doc, link, costs, args.shared_cores, parse_size(args.min_size)
        ):
            worst = max(worst, abs(math.log(ratio)))
            print("  %-28s %10d %10.4f %10.4f %6.2fx" % (name, size, measured, model, ratio))
    print("# worst: %.0f%% off" % (100 * (math.exp(worst) - 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
