"""allreduce on torch tensors and numpy arrays of every dtype the reducers
sum (float32, float64, int32, int64), sum and avg, against the closed form,
W=3 ranks on a real pool of 2 reducers."""

import numpy as np
import pytest
import torch

from conftest import connect, new_job, on_every_rank, pattern, pattern_sum

WORLD = 3
# 0, 1, a prime, and many 1 KiB chunks (over both shards).
COUNTS = [0, 1, 257, 9477]
DTYPES = ["float32", "float64", "int32", "int64"]


def expected(dtype, op, count):
    s = pattern_sum(WORLD, count)
    if op == "sum":
        return s.astype(dtype)
    if dtype.startswith("float"):
        return (s.astype(dtype) / np.dtype(dtype).type(WORLD)).astype(dtype)
    return (s // WORLD).astype(dtype)  # positive: truncation toward zero


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_rank_gets_the_closed_form(pool, dtype, op, kind):
    clients = connect(pool.address, new_job("ar-%s-%s-%s" % (kind, dtype, op)), WORLD)

    def run(rank, client):
        out = []
        for count in COUNTS:
            a = pattern(rank, count).astype(dtype)
            buf = torch.from_numpy(a.copy()) if kind == "torch" else a.copy()
            returned = client.allreduce(buf, op=op)
            assert returned is buf  # in place
            out.append(buf.numpy() if kind == "torch" else buf)
        return out

    results = on_every_rank(clients, run)
    for rank in range(WORLD):
        for count, got in zip(COUNTS, results[rank]):
            np.testing.assert_array_equal(got, expected(dtype, op, count), err_msg="rank %d" % rank)
    for c in clients:
        c.close()


def test_views_and_slices_write_in_place(pool):
    """A contiguous slice of a larger tensor is reduced where it lies."""
    clients = connect(pool.address, new_job("views"), 2)

    def run(rank, client):
        whole = torch.zeros(3000, dtype=torch.float32)
        part = whole[1000:2000]
        part.copy_(torch.from_numpy(pattern(rank, 1000).astype(np.float32)))
        client.allreduce(part)
        return whole

    for whole in on_every_rank(clients, run):
        assert torch.count_nonzero(whole[:1000]) == 0 and torch.count_nonzero(whole[2000:]) == 0
        np.testing.assert_array_equal(whole[1000:2000].numpy(), pattern_sum(2, 1000).astype(np.float32))
    for c in clients:
        c.close()


def test_fused_small_tensors_match_the_closed_form(pool):
    clients = connect(pool.address, new_job("fused"), 2)
    counts = [5, 100, 0, 3000, 17, 1]

    def run(rank, client):
        tensors = [torch.from_numpy(pattern(rank, n).astype(np.float64)) for n in counts]
        # 4-byte... 8-byte elements, 2048-byte threshold: [5, 100] fused,
        # 3000 alone, [17, 1] fused: three ops, then the next op is number 3.
        client.allreduce_fused(tensors, op="sum", fuse_bytes=2048)
        h = client.allreduce_async(torch.ones(1))
        h.wait(timeout=30)
        return tensors, h.op

    for tensors, next_op in on_every_rank(clients, run):
        assert next_op == 3
        for n, t in zip(counts, tensors):
            np.testing.assert_array_equal(t.numpy(), pattern_sum(2, n).astype(np.float64))
    for c in clients:
        c.close()
