"""core/handoff.py: whether a connection goes to another worker, one test per row of
STAY_RULES (each the only reason to stay), and the row order."""

from __future__ import annotations

import dataclasses

import pytest

from amqpbroker.core.handoff import STAY_RULES, Candidate, decide, spread_owner

GOES = Candidate(recording=True, owner="n1", links=0, claims_elsewhere=False, replayable=True)

ROWS = [
    ("hand-off off", {"enabled": False}),
    ("not its first attach", {"recording": False}),
    ("its link is served here (or its turn of a partitioned destination is here)", {"owner": None}),
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


# spread_owner: connections of a partitioned destination dealt over its members' nodes.
@pytest.mark.parametrize("members, here, arrivals, expected", [
    (("n0", "n1"), "n0", 0, None),          # a member's node keeps its first
    (("n0", "n1"), "n0", 1, "n1"),          # ... hands its second to the next member
    (("n0", "n1"), "n0", 2, None),
    (("n0", "n1"), "n1", 0, None),          # counted from the node's own member
    (("n0", "n1"), "n1", 1, "n0"),
    (("n1", "n2"), "n0", 0, "n1"),          # a node with no member hands every one on
    (("n1", "n2"), "n0", 1, "n2"),
    (("n1", "n2"), "n0", 2, "n1"),
    (("n0", "n1", "n2"), "n1", 1, "n2"),
    (("n0", "n1", "n2"), "n1", 2, "n0"),
    ((), "n0", 5, None),                    # no member placed: here
])
def test_spread_owner_rows(members, here, arrivals, expected):
    assert spread_owner(members, here, arrivals) == expected


@pytest.mark.parametrize("landed", [(4, 0), (3, 1), (0, 4), (1, 3), (2, 2), (5, 0), (7, 1)])
def test_any_landing_of_connections_on_two_members_ends_within_one_of_even(landed):
    """However the kernel deals connections over the two workers, each keeps its first,
    third, ... and hands the rest to the other member: the shares differ by one at most."""
    served = {"n0": 0, "n1": 0}
    for here, count in zip(("n0", "n1"), landed):
        for k in range(count):
            served[spread_owner(("n0", "n1"), here, k) or here] += 1
    assert abs(served["n0"] - served["n1"]) <= 1, served
    assert sum(served.values()) == sum(landed)
