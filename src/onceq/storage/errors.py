"""The errors the store raises: what went wrong, in the store's own terms.

Every error of a store operation is a ``StorageError``; its subclass says what kind, its
``message`` says what happened, and ``retriable`` whether the same request may succeed later
(a full disk, writes stopped). How an error is shown to a client is the broker's business
(``broker/store_errors.py``).
"""

from __future__ import annotations


class StorageError(Exception):
    """A store operation that failed; nothing was changed unless the message says so."""

    retriable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidName(StorageError):
    """A topic or group name outside what the store accepts."""


class InvalidArgument(StorageError):
    """An argument out of its bounds (a queue count, a shrinking topic)."""


class TopicNotFound(StorageError):
    """No topic of that name."""


class QueueNotFound(StorageError):
    """A queue id outside the topic's queues."""


class MalformedMessage(StorageError):
    """A message part that does not decode."""


class MessageTooLarge(StorageError):
    """A message above the body limit, or that no commit-log segment can hold."""


class DiskFull(StorageError):
    """The disk is full or used above the limit: writes are refused for now."""

    retriable = True


class StoreUnavailable(StorageError):
    """An I/O failure, or writes stopped until a restart: reads may go on."""

    retriable = True
