"""PyTorch through a tally pool: a DDP communication hook, and a
torch.distributed backend named "tally".

The hook, beside any process group:

    import tally, tally.torch
    ddp = torch.nn.parallel.DistributedDataParallel(model)   # process group: gloo or nccl
    ddp.register_comm_hook(tally.Client(), tally.torch.allreduce_hook)

The backend, registered when this module is imported:

    import tally.torch
    torch.distributed.init_process_group("tally")            # RANK, WORLD_SIZE, MASTER_ADDR, ... as for gloo
    ddp = torch.nn.parallel.DistributedDataParallel(model)   # its all-reduces go through the pool

Each gradient bucket (or all_reduce tensor) goes through the pool in place,
CPU tensors directly and CUDA tensors staged through pinned host memory
(tally.staging). DDP launches buckets in bucket-index order on every rank,
which keeps tally's op numbering the same on every rank (docs/pytorch.md).
A failed op fails its future, so ``loss.backward()`` raises with tally's
message; the pool's op timeout bounds how long that takes.
"""

import inspect
import os
import threading
import uuid

import torch as _torch
import torch.distributed as _dist
from torch._C import _distributed_c10d as _c10d

import tally as _tally
import tally.staging as _staging


def _future_of(client, tensor, op):
    """A torch.futures.Future of ``tensor`` once the pool has reduced it in
    place (CUDA-aware for a CUDA tensor: its waiters' streams wait for the
    copies back to the device). ``client`` is a tally.Client, or a
    tally.staging.Stager, which stages every tensor."""
    if isinstance(client, _staging.Stager):
        return client.start(tensor, op).future
    if tensor.device.type == "cuda":
        return client.allreduce_async(tensor, op).future
    future = _torch.futures.Future()

    def done(error):
        # On the client's completion thread, with the GIL: what DDP's Python
        # hook path needs of a future completed from another thread.
        if error is None:
            future.set_result(tensor)
        else:
            future.set_exception(error)

    client.allreduce_async(tensor, op, done)
    return future


def allreduce_hook(state, bucket):
    """DDP comm hook: averages ``bucket.buffer()`` over the job's ranks.

    ``state`` is a connected tally.Client (one per process, its world size
    the DDP world size), or a tally.staging.Stager over one. Returns a
    torch.futures.Future of the bucket's tensor. A bucket on a CUDA device is staged through pinned host memory,
    piece by piece (tally.staging); on any other device than cpu or cuda the
    future fails with tally.InvalidArgumentError.
    """
    buffer = bucket.buffer()
    try:
        future = _future_of(state, buffer, "avg")
    except Exception as e:  # refused at once: fail the future the same way
        future = _torch.futures.Future()
        future.set_exception(e)
    # Returned through then(): DDP (1.13) reads a failed future's value as the
    # bucket ("Unable to cast <error> to Tensor"); a then() callback that
    # raises marks its future failed for real, and backward() raises
    # "RuntimeError: ... PeerLostError: lost reducer ...".
    return future.then(_value)


def _value(future):
    return future.value()


# --- the torch.distributed backend -------------------------------------------

# Reductions the pool does; the others go to the inner process group.
_POOL_OPS = {"SUM": "sum", "AVG": "avg"}
_POOL_DTYPES = {
    _torch.float32,
    _torch.float64,
    _torch.float16,
    _torch.bfloat16,
    _torch.int32,
    _torch.int64,
}


def _job_name(store, rank):
    """The job's name when the environment gives none: made by rank 0 and
    shared through the process group's store, so every rank of this process
    group (and only of this one) joins the same job."""
    key = "tally/job"
    if rank == 0:
        store.set(key, "pg-" + uuid.uuid4().hex)
    return store.get(key).decode()


class ProcessGroupTally(_dist.ProcessGroup):
    """all_reduce (sum and avg of the dtypes tally reduces) through the pool;
    every other collective through an inner process group: gloo for CPU
    tensors, nccl for CUDA tensors where it is available (else gloo).

    The pool and its options come from the TALLY_* environment (TALLY_POOL
    at least); rank and world size from the process group; the job name from
    TALLY_JOB, else torchrun's TORCHELASTIC_RUN_ID, else one made for this
    process group and shared through its store. TALLY_INNER_BACKEND=gloo
    keeps CUDA tensors' other collectives on gloo too (nccl refuses ranks
    that share a GPU).
    """

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        inner = os.environ.get("TALLY_INNER_BACKEND", "nccl")
        if inner not in ("gloo", "nccl"):
            raise _tally.InvalidArgumentError(
                "TALLY_INNER_BACKEND=%r: expected gloo or nccl" % inner
            )
        self._cuda_inner = inner if _dist.is_nccl_available() else "gloo"
        self._store, self._timeout = store, timeout
        self._gloo = _dist.ProcessGroupGloo(
            _dist.PrefixStore("tally-gloo", store), rank, size, timeout
        )
        self._nccl = None
        self._nccl_lock = threading.Lock()
        job = None
        if not os.environ.get("TALLY_JOB") and not os.environ.get("TORCHELASTIC_RUN_ID"):
            job = _job_name(store, rank)
        self.client = _tally.Client(rank=rank, world_size=size, job=job)

    def _inner(self, tensors):
        """The process group for collectives tally does not do."""
        if tensors and tensors[0].device.type == "cuda" and self._cuda_inner == "nccl":
            with self._nccl_lock:
                if self._nccl is None:
                    self._nccl = _dist.ProcessGroupNCCL(
                        _dist.PrefixStore("tally-nccl", self._store),
                        self.rank(),
                        self.size(),
                        _nccl_options(self._timeout),
                    )
                return self._nccl
        return self._gloo

    def allreduce(self, tensors, opts=None):
        if not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        if opts is None:
            opts = _c10d.AllreduceOptions()
        op = _POOL_OPS.get(_op_name(opts.reduceOp))
        if op is None or any(t.dtype not in _POOL_DTYPES for t in tensors):
            return self._inner(tensors).allreduce(tensors, opts)
        futures = [_future_of(self.client, t, op) for t in tensors]
        if len(futures) == 1:
            future = futures[0].then(lambda f: [f.value()])
        else:
            future = _torch.futures.collect_all(futures).then(
                lambda f: [g.value() for g in f.value()]
            )
        return _work_of(future)

    # Every other collective: the inner process group's.
    def broadcast(self, tensors, opts=None):
        return self._inner(tensors).broadcast(tensors, opts or _c10d.BroadcastOptions())

    def allgather(self, outputs, inputs, opts=None):
        return self._inner(inputs).allgather(outputs, inputs, opts or _c10d.AllgatherOptions())

    def _allgather_base(self, output, input, opts=None):
        return self._inner([input])._allgather_base(output, input, opts or _c10d.AllgatherOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return self._inner(tensors).allreduce_coalesced(
            tensors, opts or _c10d.AllreduceCoalescedOptions()
        )

    def reduce(self, tensors, opts=None):
        return self._inner(tensors).reduce(tensors, opts or _c10d.ReduceOptions())

    def gather(self, outputs, inputs, opts=None):
        return self._inner(inputs).gather(outputs, inputs, opts or _c10d.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):
        return self._inner(outputs).scatter(outputs, inputs, opts or _c10d.ScatterOptions())

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self._inner(outputs).reduce_scatter(
            outputs, inputs, opts or _c10d.ReduceScatterOptions()
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._inner([output])._reduce_scatter_base(
            output, input, opts or _c10d.ReduceScatterOptions()
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._inner([output]).alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts or _c10d.AllToAllOptions()
        )

    def alltoall(self, outputs, inputs, opts=None):
        return self._inner(outputs).alltoall(outputs, inputs, opts or _c10d.AllToAllOptions())

    def send(self, tensors, dst, tag=0):
        return self._inner(tensors).send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._inner(tensors).recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._inner(tensors).recv_anysource(tensors, tag)

    def barrier(self, opts=None):
        return self._gloo.barrier(opts or _c10d.BarrierOptions())

    def getBackendName(self):
        return "tally"

    def __del__(self):
        client = getattr(self, "client", None)
        if client is not None:
            client.close()


def _op_name(reduce_op):
    """ "SUM", "AVG", ... of the ReduceOp an options object holds (torch 1.13
    and 2.x compare it with the class's members; "" for any other)."""
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        if reduce_op == getattr(_dist.ReduceOp, name):
            return name
    return ""


def _work_of(future):
    """A c10d Work whose get_future() is ``future`` (what DDP waits on)."""
    return _c10d._create_work_from_future(future)


def _nccl_options(timeout):
    options = _dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def _create(store, rank, size, timeout):
    return ProcessGroupTally(store, rank, size, timeout)


def _register():
    if hasattr(_dist.Backend, "TALLY"):
        return  # imported twice
    params = inspect.signature(_dist.Backend.register_backend).parameters
    if "devices" in params:
        _dist.Backend.register_backend("tally", _create, devices=["cpu", "cuda"])
    else:
        _dist.Backend.register_backend("tally", _create)


_register()
