"""Spark integration: the `amqp` Python data source (amqpbroker.spark.source, needs
the `spark` extra) and the AMQP client it uses (amqpbroker.spark.client, proton only).
See docs/spark.md."""

from __future__ import annotations

__all__ = ["register"]


def register(spark) -> None:
    """Register the `amqp` data source with a SparkSession."""
    from .source import AmqpDataSource

    spark.dataSource.register(AmqpDataSource)
