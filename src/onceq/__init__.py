"""onceq: a Python message bus that ends repeated consumption."""

from .broker.broker import Broker
from .broker.config import BrokerConfig
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
