"""The "tally" torch.distributed backend, and the launcher's environment:
two ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, and no
TALLY_RANK, TALLY_WORLD_SIZE or TALLY_JOB) call init_process_group("tally")
and run collectives against a real pool: all_reduce through the pool
(sum and avg, 32- and 16-bit), every other collective through gloo, with
gloo's results."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid

import tally.pool

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    import tally.torch  # registers "tally"
    dist.init_process_group("tally")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"backend": dist.get_backend()}
    t = torch.arange(6, dtype=torch.float32) + 10 * rank
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    h = (torch.arange(4) + 2 * rank).to(torch.bfloat16)
    dist.all_reduce(h, op=dist.ReduceOp.AVG)
    out["avg_bf16"] = h.float().tolist()
    m = torch.tensor([rank, 5 - rank], dtype=torch.float32)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)  # not the pool's: gloo's
    out["max"] = m.tolist()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, rank + 0.5]))
    out["all_gather"] = [g.tolist() for g in gathered]
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    dist.barrier()
    out["job"] = dist.distributed_c10d._get_default_group().client.rank
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
"""
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_process_group_tally_under_a_launchers_environment(tmp_path):
    run_id = "run-" + uuid.uuid4().hex[:8]
    with tally.pool.LocalPool(shards=2, args=["--log-level", "info"]) as pool:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        env.update(
            TALLY_POOL=pool.address,
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            TORCHELASTIC_RUN_ID=run_id,
            TORCHELASTIC_RESTART_COUNT="3",
            PYTHONPATH=os.environ.get("PYTHONPATH", ""),
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT],
                env=dict(env, RANK=str(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=str(tmp_path),
            )
            for r in range(2)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, out + err
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert line, out + err
            results.append(json.loads(line[0][7:]))
        log = pool.log(0)
    for rank, r in enumerate(results):
        assert r["backend"] == "tally"
        assert r["sum"] == [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]
        assert r["avg_bf16"] == [1.0, 2.0, 3.0, 4.0]
        assert r["max"] == [1.0, 5.0]
        assert r["broadcast"] == [1.0]
        assert r["all_gather"] == [[0.0, 0.5], [1.0, 1.5]]
        assert r["job"] == rank
    # The job is torchrun's run and incarnation: a new incarnation is a new job.
    assert "rank 0/2 of job '%s-3' joined" % run_id in log, log
    assert "rank 1/2 of job '%s-3' joined" % run_id in log, log


def test_an_unknown_inner_backend_is_refused(monkeypatch):
    import datetime

    import pytest
    import torch.distributed as dist

    import tally
    import tally.torch

    monkeypatch.setenv("TALLY_INNER_BACKEND", "mpi")
    with pytest.raises(tally.InvalidArgumentError, match="TALLY_INNER_BACKEND='mpi'"):
        tally.torch.ProcessGroupTally(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
