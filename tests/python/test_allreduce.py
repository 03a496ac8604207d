"""allreduce on torch tensors and numpy arrays of every dtype the reducers
sum (float32, float64, int32, int64), sum and avg, against the closed form,
W=3 ranks on a real pool of 2 reducers; float16 and bfloat16 (summed in
float32 on the reducers) against a float64 reference within their bound."""

import numpy as np
import pytest
import torch

from conftest import connect, new_job, on_every_rank, pattern, pattern_sum

WORLD = 3
# 0, 1, a prime, and many 1 KiB chunks (over both shards).
COUNTS = [0, 1, 257, 9477]
DTYPES = ["float32", "float64", "int32", "int64"]


def expected(dtype, op, count, seed):
    s = pattern_sum(WORLD, count, seed)
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
        for seed, count in enumerate(COUNTS):
            a = pattern(rank, count, seed).astype(dtype)
            buf = torch.from_numpy(a.copy()) if kind == "torch" else a.copy()
            returned = client.allreduce(buf, op=op)
            assert returned is buf  # in place
            out.append(buf.numpy() if kind == "torch" else buf)
        return out

    results = on_every_rank(clients, run)
    for rank in range(WORLD):
        for seed, (count, got) in enumerate(zip(COUNTS, results[rank])):
            np.testing.assert_array_equal(
                got, expected(dtype, op, count, seed), err_msg="rank %d" % rank
            )
    for c in clients:
        c.close()


def test_views_and_slices_write_in_place(pool):
    """A contiguous slice of a larger tensor is reduced where it lies."""
    clients = connect(pool.address, new_job("views"), 2)

    def run(rank, client):
        whole = torch.zeros(3000, dtype=torch.float32)
        part = whole[1000:2000]
        part.copy_(torch.from_numpy(pattern(rank, 1000, 0).astype(np.float32)))
        client.allreduce(part)
        return whole

    for whole in on_every_rank(clients, run):
        assert torch.count_nonzero(whole[:1000]) == 0 and torch.count_nonzero(whole[2000:]) == 0
        np.testing.assert_array_equal(
            whole[1000:2000].numpy(), pattern_sum(2, 1000, 0).astype(np.float32)
        )
    for c in clients:
        c.close()


def test_fused_small_tensors_match_the_closed_form(pool):
    clients = connect(pool.address, new_job("fused"), 2)
    counts = [5, 100, 0, 3000, 17, 1]

    def run(rank, client):
        tensors = [
            torch.from_numpy(pattern(rank, n, k).astype(np.float64)) for k, n in enumerate(counts)
        ]
        # 4-byte... 8-byte elements, 2048-byte threshold: [5, 100] fused,
        # 3000 alone, [17, 1] fused: three ops, then the next op is number 3.
        client.allreduce_fused(tensors, op="sum", fuse_bytes=2048)
        h = client.allreduce_async(torch.ones(1))
        h.wait(timeout=30)
        return tensors, h.op

    for tensors, next_op in on_every_rank(clients, run):
        assert next_op == 3
        for k, (n, t) in enumerate(zip(counts, tensors)):
            np.testing.assert_array_equal(t.numpy(), pattern_sum(2, n, k).astype(np.float64))
    for c in clients:
        c.close()


# Unit roundoff and half the smallest denormal of each 16-bit type.
SIXTEEN_BIT = {"float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_tensors_are_summed_in_float32(pool, dtype, op, kind):
    if kind == "numpy" and dtype == "bfloat16":
        pytest.skip("numpy has no bfloat16")
    clients = connect(pool.address, new_job("ar16-%s-%s-%s" % (kind, dtype, op)), WORLD)
    tdtype = getattr(torch, dtype)
    count = 9477  # many chunks over both shards, not a multiple of a vector
    # Fractions that 16-bit floats cannot hold exactly, different per rank.
    inputs = [
        (torch.arange(count, dtype=torch.float64) % 97 + 1).reciprocal() + r for r in range(WORLD)
    ]
    inputs = [x.to(tdtype) for x in inputs]

    def run(rank, client):
        if kind == "torch":
            buf = inputs[rank].clone()
            assert client.allreduce(buf, op=op) is buf
            return buf.to(torch.float64).numpy()
        buf = inputs[rank].numpy().copy()
        client.allreduce(buf, op=op)
        return buf.astype(np.float64)

    results = on_every_rank(clients, run)
    wide = [x.to(torch.float64).numpy() for x in inputs]
    exact = sum(wide)
    magnitude = sum(np.abs(x) for x in wide)
    if op == "avg":
        exact = exact / WORLD
        magnitude = magnitude / WORLD
    u, half_denormal = SIXTEEN_BIT[dtype]
    # docs/protocol.md, "16-bit types": float32 accumulation, one rounding.
    bound = u * np.abs(exact) + (1 + u) * (WORLD + 1) * 2.0**-24 * magnitude + half_denormal
    for rank in range(WORLD):
        err = np.abs(results[rank] - exact)
        bad = np.nonzero(~(err <= bound))[0]
        assert bad.size == 0, "rank %d: element %d is %r, exact %r, bound %r" % (
            rank,
            bad[0],
            results[rank][bad[0]],
            exact[bad[0]],
            bound[bad[0]],
        )
        # Every rank gets the same bits.
        np.testing.assert_array_equal(results[rank], results[0])
    for c in clients:
        c.close()


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_float32_on_the_bfloat16_wire_is_within_its_bound(pool, op):
    """wire_dtype='bfloat16': inputs rounded to bfloat16 for the wire, summed
    in float32, the result rounded to bfloat16 and widened into the float32
    tensor (docs/architecture.md, "The bfloat16 wire")."""
    clients = connect(pool.address, new_job("arwire-%s" % op), WORLD, wire_dtype="bfloat16")
    count = 9477
    inputs = [
        ((torch.arange(count, dtype=torch.float64) % 97 + 1).reciprocal() + r).to(torch.float32)
        for r in range(WORLD)
    ]

    def run(rank, client):
        buf = inputs[rank].clone()
        assert client.allreduce(buf, op=op) is buf
        assert buf.dtype == torch.float32
        return buf.to(torch.float64).numpy()

    results = on_every_rank(clients, run)
    # The reference sums the inputs as the wire carries them.
    wide = [x.to(torch.bfloat16).to(torch.float64).numpy() for x in inputs]
    exact = sum(wide)
    magnitude = sum(np.abs(x) for x in wide)
    if op == "avg":
        exact = exact / WORLD
        magnitude = magnitude / WORLD
    u, half_denormal = SIXTEEN_BIT["bfloat16"]
    bound = u * np.abs(exact) + (1 + u) * (WORLD + 1) * 2.0**-24 * magnitude + half_denormal
    for rank in range(WORLD):
        err = np.abs(results[rank] - exact)
        bad = np.nonzero(~(err <= bound))[0]
        assert bad.size == 0, "rank %d: element %d is %r, exact %r, bound %r" % (
            rank,
            bad[0],
            results[rank][bad[0]],
            exact[bad[0]],
            bound[bad[0]],
        )
        # The result travelled as bfloat16: it converts back without loss.
        wire = torch.from_numpy(results[rank]).to(torch.float32)
        assert torch.equal(wire.to(torch.bfloat16).to(torch.float32), wire)
        np.testing.assert_array_equal(results[rank], results[0])
    for c in clients:
        c.close()


def test_reproducible_sums_follow_the_rank_tree(pool):
    """deterministic=True: W=3 ranks' float32 sums are the tree's (x0 + x1) + x2 in
    float32, bit for bit, over both shards; fractions whose sum depends on its order."""
    clients = connect(pool.address, new_job("ar-deterministic"), WORLD, deterministic=True)
    count = 9477
    i = np.arange(count, dtype=np.float64)
    inputs = [(1.0 / (1.0 + (r * 131 + i * 7) % 97) + r % 5).astype(np.float32) for r in range(3)]

    def run(rank, client):
        buf = torch.from_numpy(inputs[rank].copy())
        client.allreduce(buf)
        return buf.numpy()

    tree = (inputs[0] + inputs[1]) + inputs[2]
    for rank, got in enumerate(on_every_rank(clients, run)):
        np.testing.assert_array_equal(got.view(np.uint32), tree.view(np.uint32), "rank %d" % rank)
    for c in clients:
        c.close()
