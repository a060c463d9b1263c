"""Queue allocation strategies for consumer-group rebalancing: the pure functions live in
``onceq._allocation`` (the broker's RocketMQ endpoint allocates with them too)."""

from .._allocation import (
    STRATEGIES,
    AllocateConfig,
    AllocateConsistentHash,
    AllocateNearby,
    AllocateStrategy,
    MessageQueue,
    allocate_average,
    allocate_average_by_circle,
    get_strategy,
)

__all__ = [
    "STRATEGIES",
    "AllocateConfig",
    "AllocateConsistentHash",
    "AllocateNearby",
    "AllocateStrategy",
    "MessageQueue",
    "allocate_average",
    "allocate_average_by_circle",
    "get_strategy",
]
