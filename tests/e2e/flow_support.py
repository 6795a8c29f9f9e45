"""What the producer flow-control tests share: a broker whose log must stay free of
unexpected errors, and the management figures they read (queue depth, producers held)."""

from __future__ import annotations

from typing import Any, Iterator

import httpx


def broker_without_errors(broker_factory: Any, config: str) -> Iterator[Any]:
    """For a fixture: a broker with `config`; after the test, its log has no traceback."""
    b = broker_factory(config)
    yield b
    assert "Traceback" not in b.log_text(), "the broker met an error it did not expect"


def api(broker: Any) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{broker.ports['management']}", timeout=10)


def depth(broker: Any, queue: str) -> int:
    with api(broker) as c:
        return c.get(f"/api/queues/{queue}").json()["depth"]


def held(broker: Any) -> int:
    """Producer links the broker gives no credit now."""
    with api(broker) as c:
        return c.get("/api/alarms").json()["producers_held"]


__all__ = ["api", "broker_without_errors", "depth", "held"]
