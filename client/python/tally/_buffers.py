"""Host buffers an op writes into: their address, element count and dtype.

A torch.Tensor is read through its own attributes (device, layout,
contiguity, dtype, data_ptr, numel), anything else through the buffer
protocol (numpy arrays, array.array, bytearray views). Either way the op
writes in place, with no copy, and the op keeps what it was given (and its
buffer export) until it has ended.
"""

import ctypes

from . import _lib
from .errors import InvalidArgumentError

_TORCH_DTYPES = {
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.int32": "int32",
    "torch.int64": "int64",
}


class Target:
    """One buffer of an op: ``address``, ``count`` elements of ``dtype``
    (a key of _lib.DTYPES), and ``keep``, what keeps the memory valid."""

    __slots__ = ("address", "count", "dtype", "keep")

    def __init__(self, address, count, dtype, keep):
        self.address, self.count, self.dtype, self.keep = address, count, dtype, keep


def is_tensor(obj):
    module = type(obj).__module__ or ""
    return module.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous")


def device_type(obj):
    """ "cpu" for host memory; a tensor's device type otherwise."""
    return obj.device.type if is_tensor(obj) else "cpu"


def tensor_dtype(t):
    dtype = _TORCH_DTYPES.get(str(t.dtype))
    if dtype is None:
        raise InvalidArgumentError(
            "tensor dtype %s is not supported (float32, float64, float16, bfloat16, int32, "
            "int64)" % t.dtype
        )
    return dtype


def check_tensor(t):
    """What every tensor tally reduces must be, wherever it lives."""
    if str(t.layout) != "torch.strided":
        raise InvalidArgumentError(
            "tensor has layout %s: tally reduces dense tensors only" % t.layout
        )
    if not t.is_contiguous():
        raise InvalidArgumentError(
            "tensor is not contiguous: reduce t.contiguous() and copy the result back (tally "
            "writes the result in place into one block of memory)"
        )
    if t.requires_grad:
        raise InvalidArgumentError(
            "tensor requires grad: reduce t.detach() or t.grad (an in-place write behind "
            "autograd's back would corrupt its graph)"
        )
    return tensor_dtype(t)


def _from_tensor(t):
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            "tensor is on device '%s': tally reduces host memory and CUDA tensors (staged "
            "through host memory), not %s" % (t.device, t.device.type)
        )
    dtype = check_tensor(t)
    return Target(t.data_ptr(), t.numel(), dtype, t)


_FORMATS = {
    ("f", 4): "float32",
    ("d", 8): "float64",
    ("e", 2): "float16",
    ("i", 4): "int32",
    ("l", 4): "int32",
    ("q", 4): "int32",
    ("i", 8): "int64",
    ("l", 8): "int64",
    ("q", 8): "int64",
}


def _from_buffer(obj):
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgumentError(
            "expected a torch.Tensor or an object with the buffer protocol (numpy array), got "
            + type(obj).__name__
        ) from None
    if view.readonly:
        raise InvalidArgumentError(
            "%s is read-only: tally writes the result in place (pass a writable copy, e.g. "
            "numpy.array(x))" % type(obj).__name__
        )
    if not view.c_contiguous:
        raise InvalidArgumentError(
            "%s is not contiguous: reduce a contiguous copy (numpy.ascontiguousarray) and copy "
            "the result back" % type(obj).__name__
        )
    fmt = view.format or "B"
    order = fmt[0] if fmt[0] in "@=<>!" else "@"
    if order in ">!":
        raise InvalidArgumentError("big-endian buffers are not supported")
    dtype = _FORMATS.get((fmt.lstrip("@=<>!"), view.itemsize))
    if dtype is None:
        raise InvalidArgumentError(
            "buffer format '%s' is not supported (float32, float64, " "float16, int32, int64)" % fmt
        )
    flat = view.cast("B")
    if flat.nbytes == 0:
        return Target(None, 0, dtype, (obj, view))
    window = (ctypes.c_char * flat.nbytes).from_buffer(flat)  # holds the buffer export
    return Target(
        ctypes.addressof(window), flat.nbytes // view.itemsize, dtype, (obj, view, window)
    )


def host_target(obj):
    """The Target of a host buffer; InvalidArgumentError names what is wrong."""
    return _from_tensor(obj) if is_tensor(obj) else _from_buffer(obj)


def redop_code(op):
    code = _lib.REDOPS.get(op)
    if code is None:
        raise InvalidArgumentError("op must be 'sum' or 'avg', not '%s'" % (op,))
    return code
