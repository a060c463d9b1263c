"""The one place where the store's errors become wire errors.

The store raises ``StorageError``s (``storage/errors.py``) that know nothing of the wire;
the broker answers a request that failed with one through ``wire_error``, which gives each
kind its stable error code and keeps the store's message as it is.
"""

from __future__ import annotations

import logging

from ..protocol.errors import ErrorCode, OnceqError
from ..storage.errors import (
    DiskFull,
    InvalidArgument,
    InvalidName,
    MalformedMessage,
    MessageTooLarge,
    QueueNotFound,
    StorageError,
    StoreUnavailable,
    TopicNotFound,
)
from ..storage.failures import storage_error

__all__ = ["StorageError", "as_wire_error", "wire_error"]

log = logging.getLogger("onceq.broker")

_CODES: dict[type[StorageError], ErrorCode] = {
    InvalidName: ErrorCode.INVALID_NAME,
    InvalidArgument: ErrorCode.INVALID_ARGUMENT,
    TopicNotFound: ErrorCode.TOPIC_NOT_EXIST,
    QueueNotFound: ErrorCode.INVALID_QUEUE,
    MalformedMessage: ErrorCode.BAD_REQUEST,
    MessageTooLarge: ErrorCode.MESSAGE_TOO_LARGE,
    DiskFull: ErrorCode.DISK_FULL,
    StoreUnavailable: ErrorCode.STORAGE_ERROR,
}


def error_code(exc: StorageError) -> ErrorCode:
    """The wire code of a store error (the nearest kind it derives from)."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return ErrorCode.STORAGE_ERROR if exc.retriable else ErrorCode.SYSTEM_ERROR


def wire_error(exc: StorageError) -> OnceqError:
    """The wire error a client gets for a store error: its code and the store's message."""
    err = OnceqError(error_code(exc), exc.message)
    err.__cause__ = exc
    return err


def as_wire_error(exc: Exception) -> OnceqError:
    """An error raised serving a request later (off the dispatch path), as the broker
    answers it: a store error or a failing disk by its wire code, anything else
    ``SYSTEM_ERROR`` (and logged)."""
    if isinstance(exc, OnceqError):
        return exc
    if isinstance(exc, StorageError):
        return wire_error(exc)
    if isinstance(exc, OSError):
        return wire_error(storage_error(exc, "the request failed"))
    log.error("request failed: %r", exc, exc_info=exc)
    return OnceqError(ErrorCode.SYSTEM_ERROR, f"internal: {exc}")
