"""A real local SparkSession (one per test run) and a broker for the Spark tests.

Settings from shared/notes/containers-and-spark.md: no UI, driver on 127.0.0.1,
PYSPARK_PYTHON = this interpreter (the venv with amqpbroker installed), few
shuffle partitions.  Skipped when pyspark (the `spark` extra) is not installed."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from tests.broker_process import BrokerProcess  # noqa: E402

BROKER_CONFIG = """
[limits]
max_message_size = 1048576

[[duplicate_detection]]
pattern = "out-*"
window = 100000
"""


@pytest.fixture(scope="session")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    from amqpbroker.spark import register

    session = (SparkSession.builder
               .master("local[2]")
               .appName("amqpbroker-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.streaming.stopTimeout", "30s")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def sbroker(tmp_path_factory):
    """A broker with duplicate detection on `out-*` addresses."""
    proc = BrokerProcess(tmp_path_factory.mktemp("spark-broker") / "data", config=BROKER_CONFIG,
                         env={"AMQPBROKER_MANAGEMENT__PORT": "0"}).start()
    yield proc
    proc.stop()
