"""Async handles: many ops in flight, done()/wait(timeout), callbacks on the
completion thread, and the op keeping its buffer alive after the handle is
dropped."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import tally
from conftest import connect, new_job, on_every_rank, pattern, pattern_sum


def test_many_ops_in_flight_end_in_any_order(pool):
    clients = connect(pool.address, new_job("inflight"), 2)
    sizes = [1, 300, 5000, 7, 2048, 999]

    def run(rank, client):
        seen = []
        lock = threading.Lock()

        def cb(error, i=None):
            with lock:
                seen.append(error)

        tensors = [
            torch.from_numpy(pattern(rank, n, k).astype(np.float32)) for k, n in enumerate(sizes)
        ]
        handles = [client.allreduce_async(t, "sum", callback=cb) for t in tensors]
        assert [h.op for h in handles] == list(range(len(sizes)))
        for h, t in reversed(list(zip(handles, tensors))):
            assert h.wait(timeout=30) is t
            assert h.done()
        deadline = time.monotonic() + 10
        while len(seen) < len(sizes) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [None] * len(sizes)
        return tensors

    for tensors in on_every_rank(clients, run):
        for k, (n, t) in enumerate(zip(sizes, tensors)):
            np.testing.assert_array_equal(t.numpy(), pattern_sum(2, n, k).astype(np.float32))
    for c in clients:
        c.close()


def test_wait_timeout_while_a_rank_is_missing(pool):
    a, b = connect(pool.address, new_job("timeout"), 2)
    t0 = torch.ones(100, dtype=torch.float64)
    h = a.allreduce_async(t0, "avg")
    assert not h.done()
    start = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        h.wait(timeout=0.2)
    assert not isinstance(e.value, tally.Error)  # the wait's deadline, not the op's
    assert 0.15 < time.monotonic() - start < 5
    b.allreduce(torch.full((100,), 3.0, dtype=torch.float64), "avg")
    assert h.wait(timeout=30) is t0
    assert torch.all(t0 == 2.0)
    a.close()
    b.close()


def test_dropped_handle_keeps_the_tensor_alive_until_the_op_ends(pool):
    a, b = connect(pool.address, new_job("keepalive"), 2)
    t = torch.from_numpy(pattern(0, 4000, 0).astype(np.float32))
    ref = weakref.ref(t)
    done = threading.Event()
    a.allreduce_async(t, "sum", callback=lambda error: done.set())
    del t
    gc.collect()
    assert ref() is not None, "the op must hold its tensor"
    b.allreduce(torch.from_numpy(pattern(1, 4000, 0).astype(np.float32)), "sum")
    assert done.wait(30)
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert ref() is None, "released once the op ended"
    a.close()
    b.close()


def test_numpy_async_and_callback_error(pool):
    a, b = connect(pool.address, new_job("cb-error"), 2)
    errors = []
    done = threading.Event()

    def cb(error):
        errors.append(error)
        done.set()

    # Rank 0 sends 10 elements, rank 1 sends 11: a mismatch for both.
    h = a.allreduce_async(np.ones(10, dtype=np.int64), "sum", callback=cb)
    with pytest.raises(tally.MismatchError):
        b.allreduce(np.ones(11, dtype=np.int64))
    with pytest.raises(tally.MismatchError):
        h.wait(timeout=30)
    assert done.wait(10)
    assert isinstance(errors[0], tally.MismatchError) and errors[0].code_name == "mismatch"
    a.close()
    b.close()


def test_close_cancels_ops_in_flight(pool):
    a, b = connect(pool.address, new_job("close"), 2)
    h = a.allreduce_async(torch.ones(64))
    a.close()
    with pytest.raises(tally.Error):
        h.wait(timeout=10)
    with pytest.raises(tally.CancelledError):
        a.allreduce(torch.ones(1))
    b.close()
