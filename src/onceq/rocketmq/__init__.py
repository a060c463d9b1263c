"""RocketMQ 5's gRPC protocol on an onceq broker: the official RocketMQ clients produce to
and consume from onceq (``grpc_port``; docs/rocketmq.md).

A front end of the broker (``server.py``, handed to ``Broker.front_ends``): every RPC goes
through the broker's services with onceq's typed requests (``bridge.py``). The mapping of
messages, routes and status codes is pure (``mapping.py``), so are the receipt handles
(``receipt.py``) and the in-flight state of POP consumption (``pop.py``); ``consume.py``
serves SimpleConsumers' receives, acknowledgements and invisible-duration changes,
``assign.py`` PushConsumers' (onceq's allocation, the access lock), ``journal.py`` keeps
acknowledgements and the receipt key across restarts, ``service.py`` answers the RPCs;
with ``acl`` on, ``auth.py`` checks each request's signature against the users' access keys
(``access_keys.py``) and the RPC against the user's grants.
``_pb`` holds the generated ``apache.rocketmq.v2`` messages (Apache-2.0, from the Apache
RocketMQ project; scripts/rocketmq_stubs.py). Needs the ``grpc`` extra.
"""
