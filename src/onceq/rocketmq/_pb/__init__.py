"""Generated apache.rocketmq.v2 messages (scripts/rocketmq_stubs.py)."""
