"""Shared fixtures: a real local pool of tally-reducer processes, and ranks
as threads of this process (each its own tally.Client with its own I/O
thread; the GIL is released while they wait)."""

import concurrent.futures
import itertools
import os

import pytest

import tally
import tally.pool

# Small chunks so that small tensors make many chunks (the reducers accept
# up to 4 KiB; clients send 1 KiB).
REDUCER_ARGS = [
    "--max-chunk-bytes",
    "4096",
    "--memory-budget",
    "1MiB",
    "--window",
    "4",
    "--log-level",
    "warn",
]
CHUNK_BYTES = 1024
_jobs = itertools.count()


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pool():
    with tally.pool.LocalPool(shards=2, args=REDUCER_ARGS) as p:
        yield p


def new_job(name):
    return "%s-%d-%d" % (name, os.getpid(), next(_jobs))


def connect(pool_address, job, world, **kwargs):
    """`world` clients of one job, connected concurrently."""
    kwargs.setdefault("chunk_bytes", CHUNK_BYTES)
    kwargs.setdefault("op_timeout_ms", 10000)
    with concurrent.futures.ThreadPoolExecutor(world) as ex:
        futures = [
            ex.submit(
                tally.Client,
                pool=pool_address,
                job=job,
                rank=r,
                world_size=world,
                env=False,
                **kwargs,
            )
            for r in range(world)
        ]
        return [f.result(timeout=30) for f in futures]


def on_every_rank(clients, fn):
    """fn(rank, client) on one thread per rank; returns the results by rank."""
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as ex:
        futures = [ex.submit(fn, r, c) for r, c in enumerate(clients)]
        return [f.result(timeout=60) for f in futures]


def pattern(rank, count, seed):
    """v(r, k, i) = (7i + 13k + 29r) mod 1021 + 1 (tally/bench/pattern.h), as int64 numbers:
    every op gives its own seed k, so a result of another op does not pass for its own."""
    import numpy as np

    i = np.arange(count, dtype=np.int64)
    return (7 * i + 13 * seed + 29 * rank) % 1021 + 1


def pattern_sum(world, count, seed):
    return sum(pattern(r, count, seed) for r in range(world))
