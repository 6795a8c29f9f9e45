"""Container tests: the same end-to-end scenarios against the broker image.

They start the image through testcontainers.  Without a container engine (or the
image) they are reported as skipped with the reason; CI starts an engine and
builds the image (scripts/containers.sh), so there they run."""

from __future__ import annotations

import pytest

from tests.container.container_broker import ContainerBroker, engine_problem


@pytest.fixture(scope="module")
def broker():
    """Overrides the subprocess `broker` fixture for the modules in this folder."""
    problem = engine_problem()
    if problem is not None:
        pytest.skip(f"container tests need an engine: {problem}")
    b = ContainerBroker().start()
    yield b
    b.stop()


@pytest.fixture
def container_factory():
    problem = engine_problem()
    if problem is not None:
        pytest.skip(f"container tests need an engine: {problem}")
    started = []

    def make(**kw) -> ContainerBroker:
        b = ContainerBroker(**kw)
        started.append(b)
        return b

    yield make
    for b in started:
        try:
            b.stop()
        except Exception:
            pass
