"""tally: all-reduce through a tally reduction server pool.

    import tally
    client = tally.Client()                       # TALLY_POOL, TALLY_JOB, TALLY_RANK, ... from the environment
    client = tally.Client(pool="r0:7070,r1:7070", job="run-1", rank=0, world_size=4)
    client.allreduce(tensor, op="avg")            # in place, no copy; torch tensors or numpy arrays
    h = client.allreduce_async(tensor)            # ... h.wait()

Every rank of a job must issue the same ops (same sizes, dtypes and
reductions) in the same order: ops are numbered in call order on each
client, and rank r's n-th op is summed with every other rank's n-th op.
See docs/pytorch.md.
"""

import atexit
import os
import threading
import weakref

# libtally links libfabric, which loads libinfinipath (PSM); unless told not
# to, that library's constructor replaces the handlers of SIGINT, SIGTERM,
# SIGSEGV, ... with one that prints a backtrace and calls exit() from the
# signal handler, which can deadlock (seen: a DDP rank terminated by
# torch.multiprocessing hung in exit handlers) and breaks KeyboardInterrupt.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")

from . import _core  # noqa: E402 - after the variable above
from .errors import (  # noqa: F401 - re-exported
    AlreadyExistsError,
    CancelledError,
    Error,
    InternalError,
    UnauthenticatedError,
    InvalidArgumentError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    ResourceExhaustedError,
    TimeoutError,
    UnavailableError,
    UnimplementedError,
    VersionMismatchError,
)

__version__ = _core.version().split(" ")[0]
Handle = _core.Handle
DEFAULT_FUSE_BYTES = _core.DEFAULT_FUSE_BYTES

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
    "tcp_congestion": "TALLY_TCP_CONGESTION",
    "link_rate": "TALLY_LINK_RATE",
}
_REQUIRED = ("pool", "job", "rank", "world_size")

_live = weakref.WeakSet()
_live_lock = threading.Lock()


def version():
    """libtally's version and commit, e.g. "0.1.0 (ce44315)"."""
    return _core.version()


def _text(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


class Client:
    """A worker's connection to a tally pool, joined to one job.

    Keyword arguments override the ``TALLY_*`` environment variable of the
    same meaning (docs/configuration.md): pool (a "host:port,..." string or a
    list, in (group, shard) order), job, rank, world_size, groups, group,
    group_sizes, chunk_bytes, op_timeout_ms, connect_timeout_ms, heartbeat_ms,
    peer_timeout_ms, transport, fabric_provider, fabric_force_registration,
    fabric_max_msg_bytes, wire_dtype, wire_result, resume_bytes,
    tcp_congestion, link_rate (this worker's link rate in tc's units, e.g.
    "10gbit": its streams are paced to their share of it). With
    ``env=False`` the environment is not read.

    Connecting blocks (without the GIL) up to the connect timeout, and raises
    a tally.Error naming the reducer that could not be reached or refused.
    Methods are thread-safe; ops are numbered in call order.
    """

    def __init__(self, *, env=True, **kwargs):
        unknown = set(kwargs) - set(_KEYWORDS)
        if unknown:
            raise TypeError("tally.Client got unknown keyword(s): " + ", ".join(sorted(unknown)))
        settings = {}
        if env:
            for name in _core.option_names():
                if os.environ.get(name):
                    settings[name] = os.environ[name]
        for key, value in kwargs.items():
            if value is not None:
                settings[_KEYWORDS[key]] = _text(value)
        missing = [k for k in _REQUIRED if _KEYWORDS[k] not in settings]
        if missing:
            raise InvalidArgumentError(
                "tally.Client needs " + ", ".join(
                    "%s= (or %s)" % (k, _KEYWORDS[k]) for k in missing))
        self._core = _core.Client(settings)
        with _live_lock:
            _live.add(self)

    # The op runs in place; `op` is "sum" or "avg" (divided by the world size
    # once, by the reducer). Returns the buffer.
    def allreduce(self, buffer, op="sum"):
        """All-reduces ``buffer`` in place and returns it; blocks without the GIL.

        ``buffer``: a contiguous CPU torch.Tensor (not requiring grad) or a
        writable, contiguous buffer-protocol object (numpy array) of float32,
        float64, int32 or int64. Raises a tally.Error subclass on failure.
        """
        return self._client().allreduce_async(buffer, op).wait()

    def allreduce_async(self, buffer, op="sum", callback=None):
        """Starts the all-reduce and returns a tally.Handle (wait(), done(), op).

        The op keeps ``buffer`` alive until it ends, whatever happens to the
        handle. ``callback(error)``, if given, runs once when the op ends, on
        the client's completion thread with the GIL held: ``error`` is None or
        the tally.Error. It should be quick (it delays later callbacks).
        """
        return self._client().allreduce_async(buffer, op, callback)

    def allreduce_fused(self, buffers, op="sum", fuse_bytes=DEFAULT_FUSE_BYTES):
        """All-reduces a list of buffers of one dtype, fusing those below
        ``fuse_bytes`` into one op per group (copied in and out); returns the list."""
        return self._client().allreduce_fused_async(list(buffers), op, fuse_bytes).wait()

    def allreduce_fused_async(self, buffers, op="sum", fuse_bytes=DEFAULT_FUSE_BYTES,
                              callback=None):
        """The async form of allreduce_fused; the handle's wait() returns the list."""
        return self._client().allreduce_fused_async(list(buffers), op, fuse_bytes, callback)

    def close(self):
        """Leaves the job (Goodbye) and closes; ops in flight end with
        tally.CancelledError. Idempotent."""
        core, self._core = getattr(self, "_core", None), None
        if core is not None:
            core.close()

    def _client(self):
        if getattr(self, "_core", None) is None:
            raise CancelledError("the client is closed")
        return self._core

    rank = property(lambda self: self._client().rank)
    world_size = property(lambda self: self._client().world_size)
    shards = property(lambda self: self._client().shards)
    groups = property(lambda self: self._client().groups)
    group = property(lambda self: self._client().group)

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
