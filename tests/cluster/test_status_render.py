"""`amqpbroker cluster status` as text (cluster/cli.py `render`, pure): a node that is not
live shows what it reported at its last clean stop, so that an operator sees whether a
node about to leave the map is empty (`cluster remap` refuses otherwise)."""

from __future__ import annotations

import pytest

from amqpbroker.cluster.cli import render


def view(node: dict) -> dict:
    here = {"node": "a", "live": True, "slots": 256, "here": True, "connections": 0, "last_stop": None}
    return {"enabled": True, "node": "a", "serving": True, "epoch": 2, "slots": 256, "nodes": [here, node],
            "forwarded": {"links": 0, "clients": 0, "connections": 0, "waiting_on_owners": 0, "links_total": 0}}


def b(**fields) -> dict:
    return {"node": "b", "live": False, "slots": 0, "here": False, "connections": 0, **fields}


@pytest.mark.parametrize("node, shown", [
    (b(last_stop={"epoch": 2, "messages": 0, "subscriptions": 0, "queues": []}),
     "(stopped under epoch 2 holding 0 message(s), 0 durable subscription(s))"),
    (b(last_stop={"epoch": 1, "messages": 7, "subscriptions": 1, "queues": ["q"]}),
     "(stopped under epoch 1 holding 7 message(s), 1 durable subscription(s))"),
    (b(last_stop=None), "(no report of a clean stop: killed, or never run)"),
])
def test_a_node_not_live_shows_its_last_report(node, shown):
    line = next(ln for ln in render(view(node)).splitlines() if ln.startswith("b "))
    assert line.endswith(shown)


@pytest.mark.parametrize("node", [
    b(),                                                              # --workers: no reports kept
    {**b(last_stop={"epoch": 2, "messages": 5, "subscriptions": 0, "queues": []}), "live": True},
])
def test_no_report_is_shown_for_a_live_node_or_without_zookeeper(node):
    line = next(ln for ln in render(view(node)).splitlines() if ln.startswith("b "))
    assert "stop" not in line and "report" not in line
