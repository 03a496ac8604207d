"""Device tensors through host memory, pipelined with the network.

The reducers sum host memory. A CUDA tensor (a DDP gradient bucket) is cut
into pieces of at least PIECE_BYTES, and each piece is its own tally op:

    producer stream --event--> copy stream: D2H piece 0, event 0, D2H piece 1, event 1, ...
    feeder thread:   wait event i (GIL released) -> start piece i's op
    completion thread, as piece i's result is in:  H2D piece i on the copy stream
    after the last piece:  the future completes on the copy stream

so piece i + 1 crosses PCIe while piece i crosses the network, and results
go back to the device piece by piece; the caller's stream (DDP's) waits
for the copy stream through the future (a CUDA-aware torch.futures.Future,
which records an event where it is completed and makes its waiters' streams
wait for it), never through a device-wide synchronisation. Host buffers are
pinned, taken from a pool by (dtype, size) and given back when the op ends,
so a training loop allocates them in its first step only. Every rank cuts a
tensor into the same pieces (a function of its size alone), and pieces take
their op numbers in call order with the client's other ops, so numbering
stays the same on every rank.

The copies are done by a copier: CudaCopier for CUDA tensors; HostCopier
(plain host tensors and a copy thread standing for the stream) runs the same
pipeline where no GPU is, for the tests.
"""

import threading

from . import _buffers

# A piece's bytes, at least: large enough that an op's fixed costs (its
# headers, the reducers' release round trip) stay small beside its transfer,
# and no smaller than what the client holds rather than copies (4 MiB of
# results, docs/protocol.md "Resuming"): a held piece's results stay in its
# pinned buffer until the reducers release them, where a smaller piece's
# would be copied for resuming at its end, about 1 ms of worker CPU per
# 4 MiB (a 25 MiB bucket's staging then cost 1.4x its CPU tensor's). Small
# enough that a 25 MiB DDP bucket makes 6 pieces, so that the first piece
# is on its way while the rest are still being copied off the device.
PIECE_BYTES = 4 << 20


def pieces(numel, element_size):
    """[(start, stop), ...] element ranges of at least PIECE_BYTES each (a
    smaller tensor is one piece); one empty piece for an empty tensor (it
    still takes an op number)."""
    if numel == 0:
        return [(0, 0)]
    per = max(1, PIECE_BYTES // element_size)
    count = max(1, numel // per)
    # As even as they go: sizes differ by one element at most.
    return [(i * numel // count, (i + 1) * numel // count) for i in range(count)]


class CudaCopier:
    """Copies on a stream of its own, with events in between. `device` may
    be "cuda" or torch.device("cuda"): the current device is meant."""

    def __init__(self, device):
        import torch

        self._torch = torch
        device = torch.device(device)
        if device.index is None:
            # A CUDA-aware Future takes indexed devices only.
            device = torch.device(device.type, torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def host(self, numel, dtype):
        return self._torch.empty(numel, dtype=dtype, pin_memory=True)

    def to_host(self, src, host, ranges):
        """Copies src[r] into host[r] for each range after the work the
        current stream has queued; returns an object with wait() per range."""
        torch = self._torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        events = []
        with torch.cuda.stream(self.stream):
            for lo, hi in ranges:
                host[lo:hi].copy_(src[lo:hi], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                events.append(_EventWait(event))
        src.record_stream(self.stream)  # the caching allocator: it is in use here too
        return events

    def to_device(self, host, dst):
        with self._torch.cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)

    def future(self):
        return self._torch.futures.Future(devices=[self.device])

    def complete(self, future, value):
        # Set on the copy stream: the future records an event after the
        # results' copies, and its waiters' streams wait for that event.
        with self._torch.cuda.stream(self.stream):
            future.set_result(value)


class _EventWait:
    def __init__(self, event):
        self._event = event

    def wait(self):
        self._event.synchronize()  # torch releases the GIL meanwhile


class HostCopier:
    """The pipeline without a GPU: host tensors stand for device ones, and a
    thread of its own for the copy stream, which copies in order and sets an
    event per piece. Used by the tests, so that the staging path runs in CI."""

    def __init__(self):
        import queue

        import torch

        self._torch = torch
        self._work = queue.Queue()
        threading.Thread(target=self._run, name="tally-host-copier", daemon=True).start()

    def _run(self):
        while True:
            self._work.get()()

    def host(self, numel, dtype):
        return self._torch.empty(numel, dtype=dtype)

    def to_host(self, src, host, ranges):
        events = []
        for lo, hi in ranges:
            done = threading.Event()

            def copy(lo=lo, hi=hi, done=done):
                host[lo:hi].copy_(src[lo:hi])
                done.set()

            self._work.put(copy)
            events.append(done)
        return events

    def to_device(self, host, dst):
        self._work.put(lambda: dst.copy_(host))

    def future(self):
        return self._torch.futures.Future()

    def complete(self, future, value):
        self._work.put(lambda: future.set_result(value))  # after the copies queued before it


class Stager:
    """Runs device tensors' all-reduces for one client and one device."""

    def __init__(self, client, copier):
        self.client = client
        self.copier = copier
        self._lock = threading.Lock()
        self._spare = {}  # (dtype, numel) -> [host tensors]

    def _take(self, numel, dtype):
        with self._lock:
            spare = self._spare.get((dtype, numel))
            if spare:
                return spare.pop()
        return self.copier.host(numel, dtype)

    def _give(self, host):
        with self._lock:
            self._spare.setdefault((host.dtype, host.numel()), []).append(host)

    def start(self, tensor, op, callback=None):
        _buffers.check_tensor(tensor)
        redop = _buffers.redop_code(op)
        flat = tensor.view(-1)
        host = self._take(flat.numel(), flat.dtype)
        ranges = pieces(flat.numel(), flat.element_size())
        staged = StagedHandle(self, tensor, flat, host, ranges, callback)
        readies = self.copier.to_host(flat, host, ranges)
        for i, ((lo, hi), ready) in enumerate(zip(ranges, readies)):
            piece = host[lo:hi]
            done = staged.piece_done(i)
            staged.handles.append(
                self.client._submit(
                    lambda piece=piece, done=done: self.client._start(
                        _buffers.host_target(piece), redop, piece, done
                    ),
                    ready=ready,
                    callback=done,
                )
            )
        return staged


class StagedHandle:
    """A device tensor's all-reduce in flight: the handle Client.allreduce_async
    returns for a CUDA tensor (wait(), done(), op), and ``future``, a
    torch.futures.Future of the tensor that a CUDA stream can wait on."""

    def __init__(self, stager, tensor, flat, host, ranges, callback):
        self._stager = stager
        self._tensor, self._flat, self._host, self._ranges = tensor, flat, host, ranges
        self._callback = callback
        self._left = len(ranges)
        self._error = None
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self.handles = []  # one per piece, in order
        self.future = stager.copier.future()

    def piece_done(self, i):
        def done(error):
            copier = self._stager.copier
            with self._lock:
                if error is not None and self._error is None:
                    self._error = error
                failed = self._error is not None
                self._left -= 1
                last = self._left == 0
            if not failed:
                lo, hi = self._ranges[i]
                copier.to_device(self._host[lo:hi], self._flat[lo:hi])
            if not last:
                return
            self._stager._give(self._host)  # stream order keeps its next use after these copies
            if self._error is None:
                copier.complete(self.future, self._tensor)
            else:
                self.future.set_exception(self._error)
            self._ended.set()
            if self._callback is not None:
                self._callback(self._error)

        return done

    def wait(self, timeout=None):
        """Blocks until every piece's result is back in the tensor, as the
        calling thread's current stream sees it (it waits for the copy
        stream); returns the tensor or raises the first piece's tally.Error."""
        import builtins
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended.wait(0.1):
            if deadline is not None and time.monotonic() >= deadline:
                raise builtins.TimeoutError(
                    "tally staged op %s still in flight after the wait's " "timeout" % self.op
                )
        if self._error is not None:
            raise self._error
        return self.future.wait()

    def done(self):
        return self._ended.is_set()

    @property
    def op(self):
        """The first piece's op number (None until it starts)."""
        return self.handles[0].op if self.handles else None
