"""tally's exceptions: one tally.Error subclass per error code of the core.

The message is the one libtally produced; it names the rank, reducer, op or
option involved. ``e.code`` is the numeric code (tally.proto's ErrorCode),
``e.code_name`` its name ("peer_lost", ...).
"""

import builtins


class Error(RuntimeError):
    """Base class of every error tally raises."""

    code = -1
    code_name = "unknown"

    def __init__(self, message):
        super().__init__(message)
        self.message = message


class InvalidArgumentError(Error, ValueError):
    """The caller passed something unusable (a bad option, buffer or dtype)."""

    code, code_name = 1, "invalid_argument"


class ProtocolError(Error):
    """A reducer sent a malformed or unexpected frame."""

    code, code_name = 2, "protocol_error"


class VersionMismatchError(Error):
    """A reducer speaks another protocol version."""

    code, code_name = 3, "version_mismatch"


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - tally.TimeoutError on purpose
    """An op or connect deadline passed (the message names the missing ranks)."""

    code, code_name = 4, "timeout"


class PeerLostError(Error):
    """A reducer or a rank of the job was lost: drop the client and reconnect."""

    code, code_name = 5, "peer_lost"


class MismatchError(Error):
    """Ranks' contributions to one op disagree (count, dtype, reduction)."""

    code, code_name = 6, "mismatch"


class ResourceExhaustedError(Error):
    """A reducer's memory budget or the job's quota."""

    code, code_name = 7, "resource_exhausted"


class CancelledError(Error):
    """The client was closed while the op was in flight."""

    code, code_name = 8, "cancelled"


class UnavailableError(Error):
    """A reducer could not be reached, or is shutting down."""

    code, code_name = 9, "unavailable"


class AlreadyExistsError(Error):
    """Another worker already holds this rank in the job."""

    code, code_name = 10, "already_exists"


class UnimplementedError(Error):
    """A valid request this build cannot serve (float16 sums, say)."""

    code, code_name = 11, "unimplemented"


class InternalError(Error):
    """A bug on the other side."""

    code, code_name = 12, "internal"


class UnauthenticatedError(Error, PermissionError):
    """A missing or wrong job secret (TALLY_JOB_SECRET, TALLY_JOB_SECRET_FILE), or a
    reducer that could not prove it holds it."""

    code, code_name = 13, "unauthenticated"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        ProtocolError,
        VersionMismatchError,
        TimeoutError,
        PeerLostError,
        MismatchError,
        ResourceExhaustedError,
        CancelledError,
        UnavailableError,
        AlreadyExistsError,
        UnimplementedError,
        InternalError,
        UnauthenticatedError,
    )
}


def error_for(code, message):
    """The exception instance for a core error code and the library's
    message ("peer_lost: lost reducer ..."; the code's name is the class's)."""
    cls = _BY_CODE.get(code, Error)
    prefix = cls.code_name + ": "
    return cls(message[len(prefix) :] if message.startswith(prefix) else message)
