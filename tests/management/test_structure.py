"""Management depends on core, security, config and store interfaces, never on
server/ (tests/test_layering.py checks every room's imports, TYPE_CHECKING ones
included), and BrokerServer satisfies the ManagedBroker port by its attribute names
alone."""

from __future__ import annotations

import asyncio

from amqpbroker.config import Settings, StoreConfig
from amqpbroker.management.port import ManagedBroker


def test_broker_server_satisfies_the_port():
    from amqpbroker.server.app import BrokerServer
    loop = asyncio.new_event_loop()
    try:
        server = BrokerServer(Settings(store=StoreConfig(enabled=False)), loop)
        assert isinstance(server, ManagedBroker)
        assert server.operations.managed is server
        members = {name: getattr(server, name) for name in dir(server) if not name.startswith("__")}
        del members["forget_link"]
        assert not isinstance(type("Partial", (), members)(), ManagedBroker), "the check can fail"
    finally:
        loop.close()
