"""The fuzz run's broker, and its settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.broker_process import BrokerProcess

FUZZ_ENV = {
    # The fuzzer fails SASL on purpose thousands of times from 127.0.0.1 (mechanism
    # names with a flipped bit); the per-address throttle would then hold every
    # later case back up to 10 s.  The throttle has its own tests.
    "AMQPBROKER_LIMITS__AUTH_MAX_DELAY": "0",
    # Off while a durable transfer followed at once by detach and end crashes the
    # broker (SIGSEGV: test_regressions.py::
    # test_durable_transfer_then_detach_and_end_before_the_commit); a fuzz run
    # would hit it by chance and stop.  AMQPBROKER_FUZZ_STORE=1 turns it on.
    "AMQPBROKER_STORE__ENABLED": "true" if os.environ.get("AMQPBROKER_FUZZ_STORE") == "1" else "false",
    # gcprobe/sitecustomize.py logs the broker's garbage-collection pauses (instrumentation
    # only), so that a slow canary round trip can be told apart from one.
    "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "gcprobe"),
                                                os.environ.get("PYTHONPATH")])),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: the wire fuzzer (tests/fuzz): many mutants against one broker")


@pytest.fixture(scope="module")
def fuzz_broker(tmp_path_factory):
    proc = BrokerProcess(tmp_path_factory.mktemp("fuzz-broker") / "data", env=FUZZ_ENV).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def fuzz_control(tmp_path_factory):
    """An idle broker with the same settings, for the control canary: the machine's load
    without the mutants (tests/e2e/canary.py)."""
    proc = BrokerProcess(tmp_path_factory.mktemp("fuzz-control") / "data", env=FUZZ_ENV).start()
    yield proc
    proc.stop()
