"""onceq: a Python message bus that ends repeated consumption.

The clients import without the broker: ``Broker``, ``BrokerConfig`` and ``StoreConfig`` are
imported when first used (a client process need not load the broker's modules).
"""

from typing import TYPE_CHECKING, Any

from .client.admin import Admin
from .client.consume import orderly
from .client.message import Message, MessageExt, SendResult
from .client.producer import Producer
from .client.pull import PullConsumer, PullResult
from .client.push import ConsumeContext, ConsumeResult, ConsumeStatus, PushConsumer
from .client.push_config import ConsumeFrom, MessageModel, PushConsumerConfig
from .client.security import ClientSecurity
from .client.sync import SyncProducer, SyncPullConsumer, SyncPushConsumer
from .idempotency import option as _idempotency  # noqa: F401  (provides idempotency=)
from .protocol.codes import PullStatus
from .protocol.errors import ErrorCode, OnceqError

if TYPE_CHECKING:
    from .broker.broker import Broker
    from .broker.config import BrokerConfig
    from .storage.config import StoreConfig

__all__ = [
    "Admin",
    "Broker",
    "BrokerConfig",
    "ClientSecurity",
    "ConsumeContext",
    "ConsumeFrom",
    "ConsumeResult",
    "ConsumeStatus",
    "ErrorCode",
    "Message",
    "MessageExt",
    "MessageModel",
    "OnceqError",
    "Producer",
    "PullConsumer",
    "PullResult",
    "PullStatus",
    "PushConsumer",
    "PushConsumerConfig",
    "SendResult",
    "StoreConfig",
    "SyncProducer",
    "SyncPullConsumer",
    "SyncPushConsumer",
    "orderly",
]
__version__ = "0.1.0"

_LAZY = {"Broker": ".broker.broker", "BrokerConfig": ".broker.config",
         "StoreConfig": ".storage.config"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onceq' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
