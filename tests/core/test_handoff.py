"""core/handoff.py: whether a connection goes to another worker, one test per row of
STAY_RULES (each the only reason to stay), and the row order."""

from __future__ import annotations

import dataclasses

import pytest

from amqpbroker.core.handoff import STAY_RULES, Candidate, decide

GOES = Candidate(recording=True, owner="n1", links=0, claims_elsewhere=False, replayable=True)

ROWS = [
    ("hand-off off", {"enabled": False}),
    ("not its first attach", {"recording": False}),
    ("its link is served here or spread", {"owner": None}),
    ("it has links here", {"links": 1}),
    ("its client-id is held at another node", {"claims_elsewhere": True}),
    ("its bytes cannot be replayed", {"replayable": False}),
]


def test_every_rule_has_a_row():
    assert [why for why, _ in STAY_RULES] == [why for why, _ in ROWS]


def test_a_first_attach_to_another_nodes_address_goes_to_that_node():
    assert decide(GOES) == ("n1", "its first link's address is another node's")


@pytest.mark.parametrize("why,change", ROWS, ids=[why for why, _ in ROWS])
def test_each_reason_alone_keeps_the_connection(why, change):
    assert decide(dataclasses.replace(GOES, **change)) == (None, why)


def test_the_first_reason_in_order_is_given():
    both = dataclasses.replace(GOES, enabled=False, links=3, replayable=False)
    assert decide(both) == (None, "hand-off off")
