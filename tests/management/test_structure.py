"""Management depends on core, security, config and store interfaces, never on
server/: no module under amqpbroker/management imports amqpbroker.server (not even
under TYPE_CHECKING), and BrokerServer satisfies the ManagedBroker port by its
attribute names alone."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import amqpbroker.management as management
from amqpbroker.config import Settings, StoreConfig
from amqpbroker.management.port import ManagedBroker

PACKAGE = Path(management.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it, relative imports resolved."""
    here = ["amqpbroker", "management"]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_no_management_module_imports_the_server():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10
    offenders = {f.name: sorted(m for m in imported_modules(f) if m.startswith("amqpbroker.server"))
                 for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_check_sees_type_checking_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..server.app import X\n")
    assert "amqpbroker.server.app" in imported_modules(sample)


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
