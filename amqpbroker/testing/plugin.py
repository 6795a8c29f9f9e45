"""pytest plugin: a real amqpbroker per test.

Registered through the ``pytest11`` entry point, so ``pip install amqpbroker`` is all it
takes (``-p no:amqpbroker`` turns it off).

    def test_orders(amqp_broker):
        send_order(amqp_broker.url)                       # your code, any AMQP 1.0 client
        assert amqp_broker.admin.queue_depth("orders") == 1

Fixtures:

* ``amqp_broker``: a started broker (function scope) on a free port with a temporary
  data directory; stopped after the test.  Configure it with the marker
  ``@pytest.mark.amqp_broker(mode="subprocess", policy={"max_delivery_attempts": 3})``
  (keywords of `amqpbroker.testing.AmqpBroker`: `mode`, and any broker setting), or
  parametrize it indirectly with a mode or a dict of those keywords:
  ``@pytest.mark.parametrize("amqp_broker", ["inprocess", "subprocess"], indirect=True)``.
* ``amqp_broker_factory``: ``make(**kwargs) -> AmqpBroker`` for several brokers in one
  test; each is started, and all are stopped after the test.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from . import AmqpBroker

__all__ = ["amqp_broker", "amqp_broker_factory"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "amqp_broker(mode='inprocess', **settings): configure the amqp_broker fixture "
        "(mode 'inprocess' or 'subprocess'; broker settings such as policy={...}, queues=[...])")


def _kwargs(request: pytest.FixtureRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    marker = request.node.get_closest_marker("amqp_broker")
    if marker is not None:
        if marker.args:
            kwargs["mode"] = marker.args[0]
        kwargs.update(marker.kwargs)
    param = getattr(request, "param", None)
    if isinstance(param, str):
        kwargs["mode"] = param
    elif isinstance(param, dict):
        kwargs.update(param)
    elif param is not None:
        raise TypeError(f"amqp_broker parameter must be a mode or a dict of keywords, not {param!r}")
    return kwargs


@pytest.fixture
def amqp_broker_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., AmqpBroker]]:
    started: list[AmqpBroker] = []

    def make(**kwargs: Any) -> AmqpBroker:
        kwargs.setdefault("data_dir", tmp_path_factory.mktemp("amqp-broker") / "data")
        broker = AmqpBroker(**kwargs)
        started.append(broker)
        return broker.start()

    yield make
    for broker in reversed(started):
        broker.close()


@pytest.fixture
def amqp_broker(request: pytest.FixtureRequest,
                amqp_broker_factory: Callable[..., AmqpBroker]) -> AmqpBroker:
    return amqp_broker_factory(**_kwargs(request))
