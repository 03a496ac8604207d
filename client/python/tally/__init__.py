"""tally: all-reduce through a tally reduction server pool.

    import tally
    client = tally.Client()                       # TALLY_POOL, TALLY_JOB, TALLY_RANK, ... from the environment
    client = tally.Client(pool="r0:7070,r1:7070", job="run-1", rank=0, world_size=4)
    client.allreduce(tensor, op="avg")            # in place; CPU or CUDA torch tensors, numpy arrays
    h = client.allreduce_async(tensor)            # ... h.wait()

Every rank of a job must issue the same ops (same sizes, dtypes and
reductions) in the same order: ops are numbered in call order on each
client, and rank r's n-th op is summed with every other rank's n-th op.
The package is pure Python over libtally's C API (ctypes), so it runs under
any CPython from 3.9 and any torch from 1.13. See docs/pytorch.md.
"""

import atexit
import builtins
import collections
import ctypes
import os
import sys
import threading
import time
import traceback
import weakref

# libtally links libfabric, which loads libinfinipath (PSM); unless told not
# to, that library's constructor replaces the handlers of SIGINT, SIGTERM,
# SIGSEGV, ... with one that prints a backtrace and calls exit() from the
# signal handler, which can deadlock (seen: a DDP rank terminated by
# torch.multiprocessing hung in exit handlers) and breaks KeyboardInterrupt.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")

from . import _buffers, _lib  # noqa: E402 - after the variable above
from ._lib import lib as _c  # noqa: E402
from .errors import (  # noqa: E402 - re-exported (__all__)
    AlreadyExistsError,
    CancelledError,
    Error,
    InternalError,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    ResourceExhaustedError,
    TimeoutError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    VersionMismatchError,
    error_for,
)

__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "Client",
    "DEFAULT_FUSE_BYTES",
    "Error",
    "Handle",
    "InternalError",
    "InvalidArgumentError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "ResourceExhaustedError",
    "TimeoutError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "VersionMismatchError",
    "error_for",
    "option_names",
    "version",
]

__version__ = _lib.text(_c.tally_version()).split(" ")[0]
DEFAULT_FUSE_BYTES = _c.tally_default_fuse_bytes()

# Keyword arguments of Client and the environment variables they override.
_KEYWORDS = {
    "pool": "TALLY_POOL",
    "job": "TALLY_JOB",
    "rank": "TALLY_RANK",
    "world_size": "TALLY_WORLD_SIZE",
    "groups": "TALLY_GROUPS",
    "group": "TALLY_GROUP",
    "group_sizes": "TALLY_GROUP_SIZES",
    "chunk_bytes": "TALLY_CHUNK_BYTES",
    "op_timeout_ms": "TALLY_OP_TIMEOUT_MS",
    "connect_timeout_ms": "TALLY_CONNECT_TIMEOUT_MS",
    "heartbeat_ms": "TALLY_HEARTBEAT_MS",
    "peer_timeout_ms": "TALLY_PEER_TIMEOUT_MS",
    "transport": "TALLY_TRANSPORT",
    "fabric_provider": "TALLY_FABRIC_PROVIDER",
    "fabric_force_registration": "TALLY_FABRIC_FORCE_REGISTRATION",
    "fabric_max_msg_bytes": "TALLY_FABRIC_MAX_MSG_BYTES",
    "wire_dtype": "TALLY_WIRE_DTYPE",
    "wire_result": "TALLY_WIRE_RESULT",
    "resume_bytes": "TALLY_RESUME_BYTES",
    "deterministic": "TALLY_DETERMINISTIC",
    "tcp_congestion": "TALLY_TCP_CONGESTION",
    "link_rate": "TALLY_LINK_RATE",
    "receive_budget": "TALLY_RECEIVE_BUDGET",
    "secret": "TALLY_JOB_SECRET",
    "secret_file": "TALLY_JOB_SECRET_FILE",
    "log_level": "TALLY_LOG_LEVEL",
}
_NAMES = {v: k for k, v in _KEYWORDS.items()}

# How long a blocked wait sleeps in the library before Python looks for a
# signal (Ctrl-C) again.
_SIGNAL_POLL_MS = 100

_live = weakref.WeakSet()
_live_lock = threading.Lock()


def version():
    """libtally's version and commit, e.g. "0.1.0 (ce44315)"."""
    return _lib.text(_c.tally_version())


def option_names():
    """Every TALLY_* name the client reads (docs/configuration.md)."""
    names = []
    while True:
        name = _c.tally_option_name(len(names))
        if not name:
            return names
        names.append(name.decode())


def _text(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _check(code, what=""):
    if code != _lib.OK:
        raise error_for(code, _lib.last_error() or what)


class _Op:
    """One started op of the library: its handle, and what it keeps alive."""

    __slots__ = ("ptr", "keep", "result", "callback", "__weakref__")

    def __init__(self, keep, result, callback):
        self.ptr = ctypes.c_void_p()
        self.keep, self.result, self.callback = keep, result, callback

    def number(self):
        n = _c.tally_op_number(self.ptr)
        return None if n == 2**64 - 1 else n

    def error(self, code):
        """The exception for an ended op's code (None when it succeeded)."""
        if code == _lib.OK:
            return None
        return error_for(code, _lib.text(_c.tally_op_message(self.ptr)) or _lib.last_error())

    def __del__(self):
        if self.ptr:
            _c.tally_op_destroy(self.ptr)


class Handle:
    """An all-reduce in flight (tally.Client.allreduce_async)."""

    def __init__(self, op=None):
        self._op = op  # None until it starts (behind ops waiting for their data)
        self._failure = None  # why it never started
        self._started = threading.Event()
        if op is not None:
            self._started.set()

    def _begin(self, op):
        self._op = op
        self._started.set()

    def _never(self, error):
        self._failure = error
        self._started.set()

    def wait(self, timeout=None):
        """Blocks (GIL released) until the op ends; returns the reduced buffer(s)
        or raises its tally.Error. With ``timeout`` (seconds), raises the
        builtin TimeoutError if it is still in flight then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        still = "tally op %s still in flight after the wait's timeout"
        while not self._started.wait(_SIGNAL_POLL_MS / 1000):
            if deadline is not None and time.monotonic() >= deadline:
                raise builtins.TimeoutError(still % "(not started yet)")
        if self._failure is not None:
            raise self._failure
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        code = _wait(
            lambda ms: _c.tally_op_wait_for(self._op.ptr, ms), left, lambda: still % self.op
        )
        error = self._op.error(code)
        if error is not None:
            raise error
        return self._op.result

    def done(self):
        """True once the op has ended (never blocks)."""
        if not self._started.is_set():
            return False
        return self._op is None or _c.tally_op_test(self._op.ptr) != _lib.IN_PROGRESS

    @property
    def op(self):
        """The op's collective number (None if it took none, or has not started yet)."""
        return self._op.number() if self._op is not None else None


def _wait(wait_ms, timeout, still):
    """Calls wait_ms(step) until it gives a code other than IN_PROGRESS,
    letting signals through between steps; builtin TimeoutError after
    ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step = _SIGNAL_POLL_MS
        if deadline is not None:
            step = max(0, min(step, int((deadline - time.monotonic()) * 1000)))
        code = wait_ms(step)
        if code != _lib.IN_PROGRESS:
            return code
        if deadline is not None and time.monotonic() >= deadline:
            raise builtins.TimeoutError(still())


class Client:
    """A worker's connection to a tally pool, joined to one job.

    Keyword arguments override the ``TALLY_*`` environment variable of the
    same meaning (docs/configuration.md): pool (a "host:port,..." string or a
    list, in (group, shard) order), job, rank, world_size, groups, group,
    group_sizes, chunk_bytes, op_timeout_ms, connect_timeout_ms, heartbeat_ms,
    peer_timeout_ms, transport, fabric_provider, fabric_force_registration,
    fabric_max_msg_bytes, wire_dtype, wire_result, resume_bytes,
    deterministic (reproducible sums), tcp_congestion, link_rate (this worker's link rate in tc's units, e.g.
    "10gbit": its streams are paced to their share of it), secret,
    secret_file, log_level (tally's log lines, on stderr). With ``env=False`` the environment is not read. Where
    TALLY_RANK, TALLY_WORLD_SIZE or TALLY_JOB are unset, a launcher's RANK,
    WORLD_SIZE and TORCHELASTIC_RUN_ID (with TORCHELASTIC_RESTART_COUNT) stand
    in for them (torchrun, Kubeflow's PyTorchJob).

    Connecting blocks (without the GIL) up to the connect timeout, and raises
    a tally.Error naming the reducer that could not be reached or refused.
    Methods are thread-safe; ops are numbered in call order, CUDA tensors'
    included (tally.staging).
    """

    def __init__(self, *, env=True, **kwargs):
        unknown = set(kwargs) - set(_KEYWORDS)
        if unknown:
            raise TypeError("tally.Client got unknown keyword(s): " + ", ".join(sorted(unknown)))
        options = ctypes.c_void_p()
        _check(_c.tally_options_create(ctypes.byref(options)))
        try:
            if env:
                _check(_c.tally_options_read_env(options))
            for key, value in kwargs.items():
                if value is not None:
                    _check(
                        _c.tally_options_set(
                            options, _KEYWORDS[key].encode(), _text(value).encode()
                        )
                    )
            missing = _lib.text(_c.tally_options_missing(options))
            if missing:
                raise InvalidArgumentError(
                    "tally.Client needs "
                    + ", ".join(
                        "%s= (or %s)" % (_NAMES[name], name) for name in missing.split(", ")
                    )
                )
            self._client = ctypes.c_void_p()
            _check(_c.tally_client_connect(options, ctypes.byref(self._client)))
        finally:
            _c.tally_options_destroy(options)
        self._queue = ctypes.c_void_p()
        _check(_c.tally_queue_create(ctypes.byref(self._queue)))
        self._ops = {}  # tag -> _Op, until its end is taken from the queue
        self._tags = iter(range(2**63))
        self._lock = threading.Lock()  # _ops, _tags, and the order in which ops start
        self._deferred = collections.deque()  # ops waiting for their data (tally.staging)
        self._deferred_cv = threading.Condition(self._lock)
        self._closing = False
        self._stagers = {}
        self._completer = threading.Thread(
            target=self._complete, name="tally-completions", daemon=True
        )
        self._completer.start()
        self._feeder = None
        with _live_lock:
            _live.add(self)

    # --- starting ops -----------------------------------------------------

    def allreduce(self, buffer, op="sum"):
        """All-reduces ``buffer`` in place and returns it; blocks without the GIL.

        ``buffer``: a contiguous torch.Tensor (not requiring grad) on the CPU
        or on a CUDA device (staged through pinned host memory, tally.staging),
        or a writable, contiguous buffer-protocol object (numpy array) of
        float32, float64, int32 or int64 (torch also float16 and bfloat16).
        Raises a tally.Error subclass on failure.
        """
        return self.allreduce_async(buffer, op).wait()

    def allreduce_async(self, buffer, op="sum", callback=None):
        """Starts the all-reduce and returns a handle (wait(), done(), op).

        The op keeps ``buffer`` alive until it ends, whatever happens to the
        handle. ``callback(error)``, if given, runs once when the op ends, on
        the client's completion thread with the GIL held: ``error`` is None or
        the tally.Error. It should be quick (it delays later callbacks).
        """
        self._open()
        redop = _buffers.redop_code(op)
        if _buffers.device_type(buffer) == "cuda":
            return self._stager(buffer).start(buffer, op, callback)
        target = _buffers.host_target(buffer)
        return self._submit(lambda: self._start(target, redop, buffer, callback), callback=callback)

    def allreduce_fused(self, buffers, op="sum", fuse_bytes=DEFAULT_FUSE_BYTES):
        """All-reduces a list of host buffers of one dtype, fusing those below
        ``fuse_bytes`` into one op per group (copied in and out); returns the list."""
        return self.allreduce_fused_async(buffers, op, fuse_bytes).wait()

    def allreduce_fused_async(
        self, buffers, op="sum", fuse_bytes=DEFAULT_FUSE_BYTES, callback=None
    ):
        """The async form of allreduce_fused; the handle's wait() returns the list."""
        self._open()
        redop = _buffers.redop_code(op)
        buffers = list(buffers)
        targets = [_buffers.host_target(b) for b in buffers]
        for i, t in enumerate(targets):
            if t.dtype != targets[0].dtype:
                raise InvalidArgumentError(
                    "fused buffers must share one dtype: item %d is %s, "
                    "item 0 is %s" % (i, t.dtype, targets[0].dtype)
                )
        dtype = targets[0].dtype if targets else "float32"

        def start():
            addresses = (ctypes.c_void_p * max(1, len(targets)))(*[t.address for t in targets])
            counts = (ctypes.c_size_t * max(1, len(targets)))(*[t.count for t in targets])
            record = _Op((targets, addresses, counts), buffers, callback)
            tag = self._register(record)
            _c.tally_allreduce_fused_async_to(
                self._client,
                addresses,
                counts,
                len(targets),
                _lib.DTYPES[dtype],
                redop,
                fuse_bytes,
                self._queue,
                tag,
                ctypes.byref(record.ptr),
            )
            return record

        return self._submit(start, callback=callback)

    def _start(self, target, redop, result, callback):
        """Starts one host op now; its lock held (the op takes the next number)."""
        record = _Op(target, result, callback)
        tag = self._register(record)
        # A refused call has ended already, and posted its tag too.
        _c.tally_allreduce_async_to(
            self._client,
            target.address,
            target.count,
            _lib.DTYPES[target.dtype],
            redop,
            self._queue,
            tag,
            ctypes.byref(record.ptr),
        )
        return record

    def _register(self, record):
        tag = next(self._tags)
        self._ops[tag] = record
        return tag

    def _submit(self, start, ready=None, callback=None):
        """Starts an op in call order and returns its Handle: now, unless ops
        before it wait for their data (``ready``, with wait(): tally.staging),
        in which case the feeder thread starts it after them. If the client
        closes first, the op never starts: its handle and ``callback`` get
        CancelledError."""
        with self._lock:
            if ready is None and not self._deferred:
                return Handle(start())
            handle = Handle()
            self._deferred.append((handle, start, ready, callback))
            if self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name="tally-feeder", daemon=True)
                self._feeder.start()
            self._deferred_cv.notify()
            return handle

    def _feed(self):
        while True:
            with self._lock:
                while not self._deferred and not self._closing:
                    self._deferred_cv.wait()
                if not self._deferred:
                    return
                handle, start, ready, callback = self._deferred[0]
            if ready is not None and not self._closing:
                ready.wait()  # without the lock: later calls queue behind it
            with self._lock:
                self._deferred.popleft()
                if not self._closing:
                    handle._begin(start())
                    continue
            error = CancelledError("the client was closed before the op started")
            handle._never(error)
            if callback is not None:
                callback(error)

    def _stager(self, tensor):
        from . import staging

        with self._lock:
            key = str(tensor.device)
            if key not in self._stagers:
                self._stagers[key] = staging.Stager(self, staging.CudaCopier(tensor.device))
            return self._stagers[key]

    # --- ending ops ---------------------------------------------------------

    def _complete(self):
        tag = ctypes.c_uint64()
        while True:
            code = _c.tally_queue_next(self._queue, 1000, ctypes.byref(tag))
            if code == _lib.IN_PROGRESS:
                continue
            if code != _lib.OK:
                return  # closed, and every end taken
            self._end(tag.value)

    def _end(self, tag):
        # A method of its own: nothing of the op outlives it on this thread.
        with self._lock:
            record = self._ops.pop(tag)
        callback, record.callback = record.callback, None
        record.keep = None  # the library is done with the buffer; the result stays for wait()
        if callback is not None:
            try:
                callback(record.error(_c.tally_op_test(record.ptr)))
            except Exception:
                sys.stderr.write("Exception in a tally callback:\n" + traceback.format_exc())

    # --- the rest -----------------------------------------------------------

    def close(self):
        """Leaves the job (Goodbye) and closes; ops in flight end with
        tally.CancelledError. Idempotent."""
        client = getattr(self, "_client", None)
        if client is None or not client:
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._deferred_cv.notify_all()
        if self._feeder is not None and self._feeder is not threading.current_thread():
            self._feeder.join()
        _c.tally_client_destroy(client)  # ops in flight end, cancelled, and post their tags
        self._client = ctypes.c_void_p()
        _c.tally_queue_close(self._queue)
        if self._completer is not threading.current_thread():
            self._completer.join()
        _c.tally_queue_destroy(self._queue)
        self._queue = ctypes.c_void_p()

    def _open(self):
        if getattr(self, "_closing", True) or not self._client:
            raise CancelledError("the client is closed")

    def _get(self, fn):
        self._open()
        return fn(self._client)

    rank = property(lambda self: self._get(_c.tally_client_rank))
    world_size = property(lambda self: self._get(_c.tally_client_world_size))
    shards = property(lambda self: self._get(_c.tally_client_shards))
    groups = property(lambda self: self._get(_c.tally_client_groups))
    group = property(lambda self: self._get(_c.tally_client_group))

    def stats(self):
        """This client's counters since it connected, as a dict (each is
        described in tally/client/stats.h): ops_completed, ops_failed,
        bytes_sent, bytes_received, reconnects, replays, op_seconds_sum,
        op_seconds_max, op_seconds_buckets (a list of (upper bound in
        seconds, ops), the last bound inf), and op_seconds_p50 and
        op_seconds_p99, the bounds within which half and 99% of the ops
        ended. Thread-safe."""
        s = _lib.Stats()
        self._open()
        _check(_c.tally_client_stats(self._client, ctypes.byref(s)))
        out = {name: getattr(s, name) for name, _ in _lib.Stats._fields_[:-1]}
        out["op_seconds_buckets"] = [
            (_c.tally_op_seconds_bound(i), s.op_seconds_buckets[i])
            for i in range(_lib.OP_SECONDS_BUCKETS)
        ]
        for name, q in (("op_seconds_p50", 0.5), ("op_seconds_p99", 0.99)):
            out[name] = _c.tally_stats_op_seconds_quantile(ctypes.byref(s), q)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


@atexit.register
def _close_all():
    # Completion threads must end before the interpreter does.
    with _live_lock:
        clients = list(_live)
    for c in clients:
        c.close()
