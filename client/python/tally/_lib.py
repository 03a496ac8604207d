"""libtally_c through ctypes: the C API of tally/tally.h, and nothing else.

The package is pure Python over this one shared library, so one build
serves every CPython from 3.9 and every torch: nothing here is compiled
against an interpreter or against torch. The library is found, in order, at
$TALLY_LIBRARY, beside this file in _lib/ (a wheel, and the build tree's
package), or by the system's loader. ctypes releases the GIL during every
call, so a blocking call (connect, a wait) never holds up other threads.
"""

import ctypes
import os

C_API_VERSION = 3  # the tally.h this file declares

# tally_code values that are not errors.
OK = 0
IN_PROGRESS = 100
CANCELLED = 8

DTYPES = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4, "int32": 5, "int64": 6}
REDOPS = {"sum": 1, "avg": 2, "average": 2, "mean": 2}


OP_SECONDS_BUCKETS = 16  # TALLY_OP_SECONDS_BUCKETS


class Stats(ctypes.Structure):
    """tally_stats (tally.h)."""

    _fields_ = [
        ("ops_completed", ctypes.c_uint64),
        ("ops_failed", ctypes.c_uint64),
        ("bytes_sent", ctypes.c_uint64),
        ("bytes_received", ctypes.c_uint64),
        ("reconnects", ctypes.c_uint64),
        ("replays", ctypes.c_uint64),
        ("op_seconds_sum", ctypes.c_double),
        ("op_seconds_max", ctypes.c_double),
        ("op_seconds_buckets", ctypes.c_uint64 * OP_SECONDS_BUCKETS),
    ]


def _find():
    path = os.environ.get("TALLY_LIBRARY")
    if path:
        return path
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", "libtally_c.so")
    return beside if os.path.exists(beside) else "libtally_c.so"


def _load():
    path = _find()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(
            "tally cannot load its native library %s: %s (set TALLY_LIBRARY to libtally_c.so, "
            "or reinstall the package)" % (path, e)
        ) from None
    c = ctypes
    p = c.c_void_p
    u32, u64, size = c.c_uint32, c.c_uint64, c.c_size_t
    code = c.c_int
    signatures = {
        "tally_version": (c.c_char_p, []),
        "tally_c_api_version": (c.c_int, []),
        "tally_code_name": (c.c_char_p, [code]),
        "tally_last_error": (c.c_char_p, []),
        "tally_options_create": (code, [c.POINTER(p)]),
        "tally_options_read_env": (code, [p]),
        "tally_options_set": (code, [p, c.c_char_p, c.c_char_p]),
        "tally_options_missing": (c.c_char_p, [p]),
        "tally_option_name": (c.c_char_p, [size]),
        "tally_options_destroy": (None, [p]),
        "tally_client_connect": (code, [p, c.POINTER(p)]),
        "tally_client_destroy": (None, [p]),
        "tally_client_rank": (u32, [p]),
        "tally_client_world_size": (u32, [p]),
        "tally_client_shards": (u32, [p]),
        "tally_client_groups": (u32, [p]),
        "tally_client_group": (u32, [p]),
        "tally_default_fuse_bytes": (size, []),
        "tally_client_stats": (code, [p, c.POINTER(Stats)]),
        "tally_op_seconds_bound": (c.c_double, [size]),
        "tally_stats_op_seconds_quantile": (c.c_double, [c.POINTER(Stats), c.c_double]),
        "tally_queue_create": (code, [c.POINTER(p)]),
        "tally_queue_next": (code, [p, u64, c.POINTER(u64)]),
        "tally_queue_close": (None, [p]),
        "tally_queue_destroy": (None, [p]),
        "tally_allreduce_async_to": (code, [p, p, size, c.c_int, c.c_int, p, u64, c.POINTER(p)]),
        "tally_allreduce_fused_async_to": (
            code,
            [p, c.POINTER(p), c.POINTER(size), size, c.c_int, c.c_int, size, p, u64, c.POINTER(p)],
        ),
        "tally_op_wait_for": (code, [p, u64]),
        "tally_op_test": (code, [p]),
        "tally_op_message": (c.c_char_p, [p]),
        "tally_op_number": (u64, [p]),
        "tally_op_destroy": (None, [p]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    if lib.tally_c_api_version() < C_API_VERSION:
        raise ImportError(
            "%s is C API version %d; this package needs %d or later (an older "
            "libtally_c.so was found first)" % (path, lib.tally_c_api_version(), C_API_VERSION)
        )
    return lib


lib = _load()


def text(value):
    """A char* result as str."""
    return value.decode("utf-8", "replace") if value else ""


def last_error():
    return text(lib.tally_last_error())
