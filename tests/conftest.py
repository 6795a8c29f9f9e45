"""Shared fixtures: a real broker process per test module (or per test when a test
needs its own configuration), reached over AMQP with python-qpid-proton."""

from __future__ import annotations

import pytest

from tests.broker_process import BrokerProcess


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A broker with default settings, shared by the tests of one module."""
    proc = BrokerProcess(tmp_path_factory.mktemp("broker") / "data").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def control_broker(tmp_path_factory):
    """An idle broker, for a control canary beside the canary of a broker under attack:
    the same machine load, no attack (tests/e2e/canary.py Canary.assert_like)."""
    proc = BrokerProcess(tmp_path_factory.mktemp("control") / "data").start()
    yield proc
    proc.stop()


@pytest.fixture
def broker_factory(tmp_path):
    """Start brokers with a given TOML config / env; all stopped after the test."""
    started: list[BrokerProcess] = []

    def make(config: str | None = None, env: dict | None = None, start: bool = True,
             name: str = "data") -> BrokerProcess:
        proc = BrokerProcess(tmp_path / name, config=config, env=env)
        started.append(proc)
        return proc.start() if start else proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def zookeeper(tmp_path):
    """A real ZooKeeper of this test's own (tests/e2e/ha_harness.py: the Debian package;
    skipped, or failed under CI, when it cannot be had)."""
    from tests.e2e.ha_harness import ZooKeeper
    zk = ZooKeeper(tmp_path / "zk").start()
    yield zk
    zk.stop()
