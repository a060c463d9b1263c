"""onceq as a PySpark data source (needs the ``spark`` extra: ``pip install onceq[spark]``).

>>> import onceq.spark
>>> onceq.spark.register(spark)
>>> df = spark.read.format("onceq").option("topic", "orders").load()

See ``docs/spark.md`` for the options and the schema.
"""

from __future__ import annotations

from typing import Any

from .options import DataLossError, OptionError

__all__ = ["DataLossError", "OptionError", "register"]


def register(spark: Any) -> None:
    """Register the ``onceq`` data source with a SparkSession."""
    from .source import OnceqDataSource

    spark.dataSource.register(OnceqDataSource)
