"""core/outbound.py, row by row: what a sending link may hand the engine before it
looks again at what the engine holds unsent."""

from __future__ import annotations

import pytest

from amqpbroker.core.outbound import DELIVERY_COST, LINK_DELIVERIES, SESSION_BYTES, budget, cost
from amqpbroker.core.queues import DISPATCH_SLICE, DISPATCH_SLICE_BYTES

MiB = 1 << 20
FULL = LINK_DELIVERIES * DELIVERY_COST      # the budget when nothing waits unsent


@pytest.mark.parametrize("link_unsent, session_bytes, expected", [
    (0, 0, FULL),                                                         # all written: a full budget
    (LINK_DELIVERIES - 10, 0, 10 * DELIVERY_COST),                         # near the link's bound
    (LINK_DELIVERIES, 0, 0),                                               # at it: wait
    (LINK_DELIVERIES + 300, 0, 0),                                         # past it (one dispatch run)
    (0, SESSION_BYTES - 1000, 1000),                                       # near the session's bound
    (0, SESSION_BYTES, 0),                                                 # at it: wait
    (0, SESSION_BYTES + 4 * MiB, 0),                                       # past it
    (LINK_DELIVERIES - 1, SESSION_BYTES - 1, 1),                           # both near: the tighter
])
def test_budget(link_unsent, session_bytes, expected):
    assert budget(link_unsent, session_bytes) == expected


def test_a_delivery_costs_its_payload_and_its_record():
    assert cost(0) == DELIVERY_COST
    assert cost(1000) == 1000 + DELIVERY_COST


def test_a_consumer_that_keeps_up_never_waits():
    """What one loop turn hands a link (a dispatch slice) leaves budget at the bounds:
    only output that stays unsent across turns makes a link wait."""
    assert budget(DISPATCH_SLICE, DISPATCH_SLICE_BYTES) > 0
    assert budget(DISPATCH_SLICE, 0) >= FULL // 2
