"""The engine library's one error type: :class:`KvtierError`, with a subclass per status code a caller acts on.

Every failure is a :class:`KvtierError` carrying a gRPC status code and the daemon's message
(or the client's, for a misuse found before calling); the codes a caller acts on have
subclasses (:class:`InvalidArgument`, also a ``ValueError``, :class:`FailedPrecondition`,
:class:`ResourceExhausted`, :class:`Unavailable`, :class:`DeadlineExceeded`,
:class:`Unauthenticated`, :class:`PermissionDenied`). :func:`rpc_error` maps a
``grpc.RpcError`` to one; :meth:`kvtier.client.engine.endpoint.Endpoint.error` does too, naming
the daemon when it is not there.

Import these from :mod:`kvtier.client.engine.transport` (or :mod:`kvtier.client.engine`).
"""

from __future__ import annotations

from typing import ClassVar

import grpc

# A FAILED_PRECONDITION (unknown session or layout) or UNAVAILABLE answer may mean the daemon restarted.
RESTART_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
# A background call that failed with one of these lost nothing the caller must hear about: the
# session it named is gone and its pins with it (CANCELLED: the daemon's shutdown cancels calls;
# UNAUTHENTICATED: the token died with the daemon that issued it).
GONE_CODES = (*RESTART_CODES, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAUTHENTICATED)


class KvtierError(Exception):
    """A call the daemon (or the client, before calling) refused; ``code`` is a grpc.StatusCode,
    ``details`` the message saying what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class _CodedError(KvtierError):
    CODE: ClassVar[grpc.StatusCode]

    def __init__(self, message: str) -> None:
        super().__init__(self.CODE, message)


class InvalidArgument(_CodedError, ValueError):
    """A malformed argument (found by the client, or refused by the daemon)."""

    CODE = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(_CodedError):
    """Not now, or not this way: an unregistered layout, a feature the daemon was started without."""

    CODE = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(_CodedError):
    """The daemon lacks the memory or room asked for."""

    CODE = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(_CodedError):
    """No daemon answered at the target."""

    CODE = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(_CodedError):
    """No answer within the client's timeout."""

    CODE = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(_CodedError):
    """The daemon does not know who is calling: no valid token (unix socket) or certificate (TCP)."""

    CODE = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(_CodedError):
    """The caller may not do this: its uid is not admitted, or it names another caller's id."""

    CODE = grpc.StatusCode.PERMISSION_DENIED


_ERROR_BY_CODE: dict[grpc.StatusCode, type[_CodedError]] = {
    cls.CODE: cls for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, Unavailable, DeadlineExceeded,
                              Unauthenticated, PermissionDenied)}


def coded_error(code: grpc.StatusCode, details: str) -> KvtierError:
    """The :class:`KvtierError` of ``code``: its subclass where the code has one."""
    cls = _ERROR_BY_CODE.get(code)
    return cls(details) if cls is not None else KvtierError(code, details)


def rpc_error(e: grpc.RpcError) -> KvtierError:
    """The :class:`KvtierError` (subclass, where the code has one) of a failed RPC."""
    return coded_error(e.code(), e.details() or "")
