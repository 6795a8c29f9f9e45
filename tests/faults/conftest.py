"""Fixtures of the fault-injection suite: a real ZooKeeper (the Debian package) and
an HA pair behind relays (tests/faults/harness.py)."""

from __future__ import annotations

import pytest

from tests.faults.harness import FaultPair


@pytest.fixture
def make_pair(zookeeper, tmp_path):
    made: list[FaultPair] = []

    def make(**kw) -> FaultPair:
        pair = FaultPair(zookeeper, tmp_path, **kw)
        made.append(pair)
        return pair

    yield make
    zookeeper.resume()
    for pair in made:
        pair.close()
