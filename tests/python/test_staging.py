"""The staging pipeline of tally.staging (how a CUDA tensor goes through the
pool: pieces copied to host buffers, each piece an op started as its copy
lands, results copied back piece by piece), driven here with HostCopier,
which runs the same pipeline on host tensors with a copy thread standing for
the CUDA stream, against a real pool. The pipeline on a GPU is the same code
with CudaCopier, which the tests take too where torch sees a GPU
(docs/pytorch.md has the run on a GPU machine)."""

import numpy as np
import pytest
import torch

import tally
import tally.pool
import tally.staging
from conftest import connect, new_job, on_every_rank, pattern, pattern_sum


@pytest.fixture
def small_pieces(monkeypatch):
    # 4 KiB pieces: a few-KiB tensor already makes several, each its own op.
    monkeypatch.setattr(tally.staging, "PIECE_BYTES", 4096)


def counting(copier_class):
    """copier_class, counting the host buffers it allocates."""

    class Counting(copier_class):
        allocated = 0

        def host(self, numel, dtype):
            self.allocated += 1
            return super().host(numel, dtype)

    return Counting


# Where the buckets are: host tensors through HostCopier, everywhere; CUDA
# tensors through CudaCopier, where there is a GPU.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


def copier_for(device):
    if device == "cpu":
        return counting(tally.staging.HostCopier)()
    return counting(tally.staging.CudaCopier)(torch.device(device))


def test_pieces_cover_the_tensor_evenly():
    assert tally.staging.pieces(0, 4) == [(0, 0)]
    assert tally.staging.pieces(10, 4) == [(0, 10)]
    per = tally.staging.PIECE_BYTES // 4
    for numel in (3 * per, 3 * per + 1, 4 * per - 1):
        got = tally.staging.pieces(numel, 4)
        assert len(got) == 3 and got[0][0] == 0 and got[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert max(hi - lo for lo, hi in got) - min(hi - lo for lo, hi in got) <= 1
        # Every piece is held by the client, not copied at its end
        # (kHoldResultsBytes, client/client_impl.h).
        assert min(hi - lo for lo, hi in got) * 4 >= 4 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("device", DEVICES)
def test_staged_ops_in_flight_on_reused_tensors_are_exact(pool, small_pieces, dtype, op, device):
    """DDP's shape: 3 buckets of different sizes reused step after step, all
    three in flight, each cut into pieces; every result exact, and the host
    buffers allocated in the first step only."""
    world, steps = 2, 4
    sizes = [3100, 2049, 2048]  # float32: 3, 2 and 2 pieces of at least 4 KiB
    clients = connect(
        pool.address, new_job("staged-%s-%s-%s" % (str(dtype)[6:], op, device)), world
    )

    def run(rank, client):
        copier = copier_for(device)
        stager = tally.staging.Stager(client, copier)
        buckets = [torch.empty(n, dtype=dtype, device=device) for n in sizes]
        for step in range(steps):
            handles = []
            for b, t in enumerate(buckets):
                seed = step * len(sizes) + b
                # Small integers: exact in every dtype, and in its average over 2 ranks.
                t.copy_(
                    torch.from_numpy((pattern(rank, t.numel(), seed) % 64 * 2).astype(np.float32))
                )
                handles.append(stager.start(t, op))
            for b, (t, h) in enumerate(zip(buckets, handles)):
                assert h.wait(timeout=30) is t
                seed = step * len(sizes) + b
                want = sum((pattern(r, t.numel(), seed) % 64 * 2) for r in range(world))
                want = want / world if op == "avg" else want
                np.testing.assert_array_equal(
                    t.float().cpu().numpy(),  # after wait(), on this thread's stream
                    want.astype(np.float32),
                    err_msg="step %d bucket %d" % (step, b),
                )
        return copier.allocated

    assert on_every_rank(clients, run) == [len(sizes)] * world
    for c in clients:
        c.close()


def test_staged_pieces_and_host_ops_take_numbers_in_call_order(pool, small_pieces):
    """A host op started after a staged one waits for the staged pieces to
    start first: numbering follows the calls, on every rank alike."""
    clients = connect(pool.address, new_job("staged-order"), 2)

    def run(rank, client):
        stager = tally.staging.Stager(client, tally.staging.HostCopier())
        staged = torch.from_numpy(pattern(rank, 3100, 0).astype(np.float32))  # 3 pieces
        host = torch.from_numpy(pattern(rank, 10, 3).astype(np.float32))
        s = stager.start(staged, "sum")
        h = client.allreduce_async(host, "sum")
        s.wait(timeout=30)
        h.wait(timeout=30)
        return [x.op for x in s.handles], h.op, staged, host

    for pieces, host_op, staged, host in on_every_rank(clients, run):
        assert pieces == [0, 1, 2]
        assert host_op == 3
        np.testing.assert_array_equal(staged.numpy(), pattern_sum(2, 3100, 0).astype(np.float32))
        np.testing.assert_array_equal(host.numpy(), pattern_sum(2, 10, 3).astype(np.float32))
    for c in clients:
        c.close()


def test_a_failed_piece_fails_the_staged_op_and_its_future(small_pieces):
    """A reducer that dies with resuming off: the staged op's wait() and its
    future raise the tally error naming it."""
    with tally.pool.LocalPool(shards=2, args=["--log-level", "warn"]) as p:
        clients = connect(p.address, new_job("staged-fail"), 2, resume_bytes=0, op_timeout_ms=5000)
        warm = on_every_rank(clients, lambda r, c: c.allreduce(torch.ones(4)).tolist())
        assert warm == [[2.0] * 4] * 2
        p.kill(1)

        def run(rank, client):
            stager = tally.staging.Stager(client, tally.staging.HostCopier())
            h = stager.start(torch.ones(5000), "sum")
            with pytest.raises(tally.Error) as e:
                h.wait(timeout=30)
            with pytest.raises(Exception) as f:
                h.future.wait()
            return str(e.value), str(f.value)

        for error, future_error in on_every_rank(clients, run):
            assert "shard 1" in error, error
            assert "shard 1" in future_error, future_error
        for c in clients:
            c.close()
