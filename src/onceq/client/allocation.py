"""Queue allocation strategies for consumer-group rebalancing: the pure functions live in
``onceq._allocation`` (the broker's RocketMQ endpoint allocates with them too); their
public names are listed there once."""

from .. import _allocation
from .._allocation import *  # noqa: F403

__all__ = _allocation.__all__
