"""Fixtures for the in-process management API tests."""

import pytest

from tests.management.support import Harness


@pytest.fixture
def h():
    """A BrokerServer that is never started, with its API reached over ASGI."""
    harness = Harness()
    yield harness
    harness.close()
