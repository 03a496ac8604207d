"""Clear errors: a bad pool address at construction, unusable buffers before
any op is sent, and a reducer killed under the client."""

import time

import numpy as np
import pytest
import torch

import tally
import tally.pool
from conftest import REDUCER_ARGS, connect, new_job, on_every_rank


def test_wrong_pool_address_fails_at_construction():
    start = time.monotonic()
    with pytest.raises(tally.Error) as e:
        tally.Client(
            pool="127.0.0.1:1",
            job="nobody",
            rank=0,
            world_size=1,
            connect_timeout_ms=500,
            env=False,
        )
    assert isinstance(e.value, (tally.TimeoutError, tally.UnavailableError)), repr(e.value)
    assert "127.0.0.1:1" in str(e.value)
    assert time.monotonic() - start < 5


def test_malformed_pool_and_missing_arguments():
    with pytest.raises(tally.InvalidArgumentError) as e:
        tally.Client(pool="no-port-here", job="j", rank=0, world_size=1, env=False)
    assert "no-port-here" in str(e.value)
    with pytest.raises(tally.InvalidArgumentError) as e:
        tally.Client(pool="127.0.0.1:1", job="j", env=False)
    assert "rank=" in str(e.value) and "TALLY_WORLD_SIZE" in str(e.value)
    with pytest.raises(TypeError):
        tally.Client(pool="127.0.0.1:1", job="j", rank=0, world_size=1, nonsense=1)
    with pytest.raises(tally.InvalidArgumentError) as e:
        tally.Client(pool="127.0.0.1:1", job="j", rank=5, world_size=2, env=False)
    assert "rank 5 is not below world size 2" in str(e.value)


def test_link_rate_is_checked_and_paces_the_streams(pool):
    with pytest.raises(tally.InvalidArgumentError) as e:
        tally.Client(pool=pool.address, job="j", rank=0, world_size=1, link_rate="1G", env=False)
    assert "TALLY_LINK_RATE" in str(e.value) and "1gbit" in str(e.value)
    with pytest.raises(tally.InvalidArgumentError) as e:
        tally.Client(
            pool=pool.address,
            job="j",
            rank=0,
            world_size=1,
            link_rate="1gbit",
            tcp_congestion="bbr",
            env=False,
        )
    assert "under bbr" in str(e.value)
    with tally.Client(
        pool=pool.address,
        job=new_job("paced"),
        rank=0,
        world_size=1,
        link_rate="10gbit",
        tcp_congestion="reno",
        env=False,
    ) as c:
        t = torch.arange(10, dtype=torch.float32)
        c.allreduce(t)
        assert t.tolist() == list(range(10))


def test_environment_is_read(monkeypatch, pool):
    monkeypatch.setenv("TALLY_POOL", pool.address)
    monkeypatch.setenv("TALLY_JOB", new_job("env"))
    monkeypatch.setenv("TALLY_RANK", "0")
    monkeypatch.setenv("TALLY_WORLD_SIZE", "1")
    monkeypatch.setenv("TALLY_CHUNK_BYTES", "1024")
    with tally.Client() as c:
        assert (c.rank, c.world_size, c.shards) == (0, 1, 2)
        t = torch.arange(10, dtype=torch.int32)
        c.allreduce(t)
        assert t.tolist() == list(range(10))


def test_unusable_buffers_are_refused_before_sending(pool):
    (c,) = connect(pool.address, new_job("refused"), 1)
    cases = [
        (torch.ones(4, 4).t(), tally.InvalidArgumentError, "not contiguous"),
        (torch.ones(4, device="meta"), tally.InvalidArgumentError, "device 'meta'"),
        (torch.ones(4, requires_grad=True), tally.InvalidArgumentError, "requires grad"),
        (torch.ones(4, dtype=torch.uint8), tally.InvalidArgumentError, "torch.uint8"),
        (torch.ones(4).to_sparse(), tally.InvalidArgumentError, "layout"),
        (np.ones((4, 4))[:, 1], tally.InvalidArgumentError, "not contiguous"),
        (np.frombuffer(b"\0" * 16, dtype=np.float32), tally.InvalidArgumentError, "read-only"),
        (np.ones(4, dtype=np.uint16), tally.InvalidArgumentError, "format"),
        (np.ones(4, dtype=">f4"), tally.InvalidArgumentError, "big-endian"),
        ([1.0, 2.0], tally.InvalidArgumentError, "got list"),
    ]
    for buf, cls, text in cases:
        with pytest.raises(cls) as e:
            c.allreduce(buf)
        assert text in str(e.value), (text, str(e.value))
    with pytest.raises(tally.InvalidArgumentError):
        c.allreduce(torch.ones(4), op="max")
    # None of them took an op number.
    h = c.allreduce_async(torch.ones(4))
    h.wait(timeout=30)
    assert h.op == 0
    c.close()


def test_killed_reducer_raises_peer_lost_naming_it():
    # Without resuming (resume_bytes=0) a lost reducer fails the op at once.
    with tally.pool.LocalPool(shards=2, args=REDUCER_ARGS) as p:
        a, b = connect(p.address, new_job("killed"), 2, op_timeout_ms=5000, resume_bytes=0)
        on_every_rank([a, b], lambda rank, c: c.allreduce(torch.ones(1000)))
        h = a.allreduce_async(torch.ones(5000))  # rank 1 never contributes
        p.kill(1)
        start = time.monotonic()
        with pytest.raises(tally.PeerLostError) as e:
            h.wait(timeout=30)
        assert time.monotonic() - start < 5
        assert "lost reducer %s (shard 1)" % p.addresses[1] in str(e.value)
        # Rank 1 fails too, naming the same cause. Its op has rank 0's shape:
        # one of another shape could meet rank 0's op on the live shard
        # first and fail there as a mismatch, before rank 1 sees the loss.
        with pytest.raises(tally.PeerLostError):
            b.allreduce(torch.ones(5000))
        a.close()
        b.close()


def test_restarted_reducer_is_resumed_and_the_op_completes():
    # With resuming (the default) the workers reconnect to the reducer that
    # comes back at its address, and the op in flight completes exactly
    # (rank 0's chunks on shard 1 died with the first reducer: without the
    # resend the op would fail).
    with tally.pool.LocalPool(shards=2, args=REDUCER_ARGS) as p:
        a, b = connect(p.address, new_job("restarted"), 2, op_timeout_ms=10000)
        x = torch.arange(5000, dtype=torch.float32)
        h = a.allreduce_async(x)  # rank 1 has not contributed yet
        p.restart(1)
        y = torch.arange(5000, dtype=torch.float32)
        b.allreduce(y)
        h.wait(timeout=30)
        torch.testing.assert_close(x, 2 * torch.arange(5000, dtype=torch.float32))
        torch.testing.assert_close(y, x)
        a.close()
        b.close()
