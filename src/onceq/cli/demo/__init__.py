"""``onceq demo``: onceq's story with real trouble injected, then the proof.

``scenario`` runs the story (a broker child process, a consumer group, an order stream,
the trouble from ``trouble``) and records; ``counting`` computes the figures from the
records; ``live`` shows progress; ``report`` writes the final tables and the HTML report
(``html``); ``spark_step`` runs the Spark exactly-once pipeline over the same topic.
"""
