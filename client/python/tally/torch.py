"""PyTorch DistributedDataParallel communication hook over a tally pool.

    import tally, tally.torch
    ddp = torch.nn.parallel.DistributedDataParallel(model)   # process group: gloo
    client = tally.Client()                                  # TALLY_* environment
    ddp.register_comm_hook(client, tally.torch.allreduce_hook)

Each gradient bucket DDP hands over is averaged through the pool, in place,
as one tally op; DDP's other collectives (the initial broadcast of
parameters, buffers) stay on its process group. DDP launches buckets in
bucket-index order on every rank, which keeps tally's op numbering the same
on every rank (docs/pytorch.md). A failed op fails the returned future, so
``loss.backward()`` raises with tally's message; the pool's op timeout bounds
how long that takes.
"""

import torch as _torch


def allreduce_hook(state, bucket):
    """DDP comm hook: averages ``bucket.buffer()`` over the job's ranks.

    ``state`` is a connected tally.Client (one per process, its world size
    the DDP world size). Returns a torch.futures.Future of the bucket's
    tensor, completed by the client's completion thread with the GIL held
    (which is what DDP's Python hook path requires).
    """
    buffer = bucket.buffer()
    future = _torch.futures.Future()

    def done(error):
        if error is None:
            future.set_result(buffer)
        else:
            future.set_exception(error)

    try:
        state.allreduce_async(buffer, "avg", done)
    except Exception as e:  # refused at once (a GPU bucket, say): fail the future the same way
        future.set_exception(e)
    # Returned through then(): DDP (1.13) reads a failed future's value as the
    # bucket ("Unable to cast <error> to Tensor"); a then() callback that
    # raises marks its future failed for real, and backward() raises
    # "RuntimeError: ... PeerLostError: lost reducer ...".
    return future.then(_value)


def _value(future):
    return future.value()
