"""``PushConsumer(..., idempotency=...)``: the idempotency layer as a consumer option.

The option is a store URL, a ``DedupStore`` or an ``Idempotency`` (a store and the options
of ``idempotent``): listener middleware (``client/middleware.py``). The consumer wraps its
listener when it starts and closes the store it opened when it shuts down;
``consumer.idempotent_listener`` is the wrapper (its ``stats``).
"""

from __future__ import annotations

import inspect
from typing import Any

from ..client import middleware
from ..client.consume import Listener
from .listener import IdempotentListener, KeySpec
from .store import DedupStore

__all__ = ["Idempotency"]

_OPTIONS = frozenset(inspect.signature(IdempotentListener.__init__).parameters) - {
    "self", "listener", "store", "key"}


class Idempotency:
    """The settings of a consumer's idempotency layer::

        PushConsumer(addr, "billing", handle,
                     idempotency=Idempotency("redis://127.0.0.1:6379/0", key="keys",
                                             ambiguous="park"))

    ``store``: a URL or a ``DedupStore``; ``key`` and ``options`` as for ``idempotent``
    (``lease_s``, ``retention_s``, ``ambiguous``, ``reconcile``, ``check_payload``,
    ``fail_open``, ``extend_leases``, ``strict_retention``, ``purge_interval_s``, ...).
    """

    def __init__(self, store: str | DedupStore, *, key: KeySpec = None, **options: Any
                 ) -> None:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise TypeError(f"unknown idempotency option(s) {', '.join(unknown)}: use "
                            f"{', '.join(sorted(_OPTIONS))}")
        if not isinstance(store, str | DedupStore):
            raise TypeError(f"idempotency store must be a URL or a DedupStore, not "
                            f"{type(store).__name__}")
        self.store = store
        self.key = key
        self.options = options

    def wrap(self, listener: Listener) -> IdempotentListener:
        return IdempotentListener(listener, store=self.store, key=self.key, **self.options)


# ``PushConsumer(idempotency=URL | DedupStore)``: the client builds the layer through this
middleware.provide("idempotency", Idempotency)
