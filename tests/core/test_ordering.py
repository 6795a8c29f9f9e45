"""core/ordering.py: a session's answers go out in the order its transfers arrived."""

from __future__ import annotations

import pytest

from amqpbroker.core.ordering import ITEM, READY, SettlementOrder


class Link:
    def __init__(self, name: str):
        self.name = name
        self.waiting = 0


def slot(item, owner, ready):
    return [item, "state", None, ready, None, owner]


A, B = Link("a"), Link("b")


# Each row: the slots added in arrival order (item, owner, ready), the items made ready
# afterwards (in that order), what goes out at each step (after the adds, then after
# each item made ready).
@pytest.mark.parametrize("added, made_ready, out", [
    ([("a1", A, True)], [], [["a1"]]),
    ([("a1", A, False), ("b1", B, True)], ["a1"], [[], ["a1", "b1"]]),          # a reject waits behind an accept
    ([("a1", A, False), ("a2", A, False), ("b1", B, True)], ["a2", "a1"],
     [[], [], ["a1", "a2", "b1"]]),                                                 # the commit of a later batch first
    ([("b1", B, True), ("a1", A, False), ("b2", B, True)], ["a1"], [["b1"], ["a1", "b2"]]),
    ([("a1", A, False), ("b1", B, False)], ["b1", "a1"], [[], [], ["a1", "b1"]]),
])
def test_answers_leave_in_arrival_order(added, made_ready, out):
    order = SettlementOrder()
    slots = {}
    for item, owner, ready in added:
        slots[item] = s = slot(item, owner, ready)
        order.add(s)
    steps = [[s[ITEM] for s in order.take_ready()]]
    for item in made_ready:
        slots[item][READY] = True
        steps.append([s[ITEM] for s in order.take_ready()])
    assert steps == out
    assert A.waiting == 0 and B.waiting == 0 and len(order) == 0


def test_each_link_counts_what_waits_and_cancel_frees_the_others():
    a, b = Link("a"), Link("b")
    order = SettlementOrder()
    order.add(slot("a1", a, False))
    order.add(slot("b1", b, True))
    order.add(slot("a2", a, True))
    assert (a.waiting, b.waiting) == (2, 1)
    assert order.holds(a, "a1") and not order.holds(b, "a1")
    order.cancel(a)                      # nothing of a will be answered
    assert a.waiting == 0 and not order.holds(a, "a1")
    assert [s[ITEM] for s in order.take_ready()] == ["b1"], "cancelled ones never go out"
    assert b.waiting == 0 and len(order) == 0
