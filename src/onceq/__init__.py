"""onceq: a Python message bus that ends repeated consumption."""

from .broker.broker import Broker
from .broker.config import BrokerConfig
from .client.admin import Admin
from .client.message import Message, MessageExt, SendResult
from .client.producer import Producer
from .client.pull import PullConsumer, PullResult
from .client.sync import SyncProducer, SyncPullConsumer
from .protocol.codes import PullStatus
from .protocol.errors import ErrorCode, OnceqError
from .storage.config import StoreConfig

__all__ = [
    "Admin",
    "Broker",
    "BrokerConfig",
    "ErrorCode",
    "Message",
    "MessageExt",
    "OnceqError",
    "Producer",
    "PullConsumer",
    "PullResult",
    "PullStatus",
    "SendResult",
    "StoreConfig",
    "SyncProducer",
    "SyncPullConsumer",
]
__version__ = "0.1.0"
