"""core/remap.py: the new slot map of `amqpbroker cluster remap`, row by row."""

from __future__ import annotations

import pytest

from amqpbroker.core.placement import spread
from amqpbroker.core.remap import (Holdings, RemapRefused, check_leaving, describe, map_record, never_served, plan_remap,
                                   rebalance, targets)


def current(nodes, weights=None, slots=256):
    weights = {n: (weights or {}).get(n, 1) for n in nodes}
    return {"nodes": list(nodes), "weights": weights, "slots": slots,
            "owners": list(spread(nodes, weights, slots)), "pinned": []}


@pytest.mark.parametrize("nodes, weights, slots, want", [
    (["a"], {}, 256, {"a": 256}),
    (["a", "b", "c"], {}, 256, {"a": 86, "b": 85, "c": 85}),
    (["a", "b", "c"], {"a": 0}, 256, {"a": 0, "b": 128, "c": 128}),
    (["a", "b"], {"a": 1, "b": 3}, 10, {"a": 3, "b": 7}),      # 2.5 and 7.5: the tie goes to a
    (["a", "b", "c"], {"a": 2}, 7, {"a": 3, "b": 2, "c": 2}),   # 3.5, 1.75, 1.75
])
def test_each_node_gets_slots_in_proportion_to_its_weight(nodes, weights, slots, want):
    got = targets(nodes, weights, slots)
    assert got == want and sum(got.values()) == slots


def test_adding_a_node_moves_only_its_share_and_each_old_node_gives_its_part():
    old = current(["a", "b"])
    plan = plan_remap(old, ["a", "b", "c"], {})
    assert plan.moved == 85 and plan.moves == {("a", "c"): 42, ("b", "c"): 43}
    assert {n: plan.owners.count(n) for n in "abc"} == {"a": 86, "b": 85, "c": 85}
    kept = sum(1 for o, n in zip(old["owners"], plan.owners) if o == n)
    assert kept == 256 - 85


def test_weight_zero_empties_a_node_and_a_node_of_weight_zero_may_then_leave():
    old = current(["a", "b", "c"])
    drained = plan_remap(old, ["a", "b", "c"], {"a": 0})
    assert "a" not in drained.owners and drained.moved == old["owners"].count("a")
    then = drained.as_map([])
    gone = plan_remap(then, ["b", "c"], {})
    assert gone.owners == drained.owners and gone.moved == 0 and gone.nodes == ("b", "c")


@pytest.mark.parametrize("nodes, weights, said", [
    (["b", "c"], {}, "node(s) a still own slots: give them weight 0 first"),
    (["a", "b", "c"], {}, "the slot map has these nodes and weights already"),
    (["a", "a", "b"], {}, "each once"),
    ([], {}, "each once"),
    (["a", "b", "c"], {"d": 1}, "weights name nodes that are not in nodes: ['d']"),
    (["a", "b", "c"], {"a": 0, "b": 0, "c": 0}, "every weight is 0"),
])
def test_a_remap_that_would_strand_or_mean_nothing_is_refused(nodes, weights, said):
    with pytest.raises(RemapRefused, match=None) as refused:
        plan_remap(current(["a", "b", "c"]), nodes, weights)
    assert said in str(refused.value)


def test_rebalance_is_deterministic_and_keeps_every_slot_owned():
    owners = spread(["a", "b"], None, 16)
    first = rebalance(owners, ["a", "b", "c", "d"], {"a": 1, "b": 1, "c": 1, "d": 1})
    assert first == rebalance(owners, ["a", "b", "c", "d"], {"a": 1, "b": 1, "c": 1, "d": 1})
    assert sorted(set(first)) == ["a", "b", "c", "d"] and all(first.count(n) == 4 for n in "abcd")


def test_the_written_map_is_gated_and_the_plan_is_told():
    plan = plan_remap(current(["a", "b"]), ["a", "b", "c"], {})
    written = plan.as_map(["fx"])
    assert written["gate"] is True and written["slots"] == 256 and written["pinned"] == ["fx"]
    text = describe(plan, 0)
    assert text.splitlines()[0] == "slot map epoch 0 -> 1: 85 of 256 slots change owner"
    assert "  a -> c: 42 slots" in text and "owned: a 86, b 85, c 85" in text


EMPTY = Holdings(epoch=3, messages=0, subscriptions=0, queues=())


@pytest.mark.parametrize("reports, refusal", [
    ({"b": EMPTY}, None),                                              # stopped empty under this map
    ({}, "node b has not reported what it holds"),                     # killed, or never stopped
    ({"b": None}, "node b has not reported what it holds"),            # a report that cannot be read
    ({"b": Holdings(2, 0, 0, ())}, "node b last stopped under slot map epoch 2, not the current 3"),
    ({"b": Holdings(3, 7, 0, ("q1",))}, "node b held 7 message(s) and 0 durable subscription(s) when it "
                                        "stopped (queues not empty: q1)"),
    ({"b": Holdings(3, 0, 1, ())}, "node b held 0 message(s) and 1 durable subscription(s) when it stopped:"),
])
def test_a_node_leaves_only_once_it_reported_being_empty_under_this_map(reports, refusal):
    if refusal is None:
        check_leaving(["b"], reports, 3)
        return
    with pytest.raises(RemapRefused) as refused:
        check_leaving(["b"], reports, 3)
    assert refusal in str(refused.value)
    assert "--force if its machine is gone for good" in str(refused.value)


def test_every_leaving_node_is_named_and_a_report_reads_back_as_written():
    with pytest.raises(RemapRefused) as refused:
        check_leaving(["b", "c", "d"], {"b": EMPTY, "d": Holdings(3, 1, 0, ())}, 3)
    assert "node b" not in str(refused.value)
    assert "node c has not reported" in str(refused.value) and "node d held 1 message(s)" in str(refused.value)
    check_leaving([], {}, 3)
    held = Holdings(5, 10, 2, ("q1", "q2"))
    assert Holdings.from_record(held.as_record()) == held


@pytest.mark.parametrize("record, served, want", [
    ({"unstarted": ["a", "b", "c"]}, ["a", "b"], {"c"}),   # c was added and never went live
    ({"unstarted": ["a", "b", "c"]}, ["a", "b", "c"], set()),
    ({"unstarted": []}, [], set()),                       # every node had served when the map was written
    ({}, [], set()),                                      # a map of an older version: nothing is known
])
def test_a_node_never_served_when_the_map_lists_it_unstarted_and_it_has_not_gone_live_since(record, served, want):
    assert never_served({"nodes": ["a", "b", "c"], **record}, served) == want


def test_a_node_that_never_served_leaves_at_once_without_weight_zero_or_a_report():
    old = {**current(["a", "b", "c"]), "unstarted": ["c"]}
    with pytest.raises(RemapRefused, match="node.s. c still own slots"):
        plan_remap(old, ["a", "b"], {})                        # c served (or nothing is known): refused
    gone = plan_remap(old, ["a", "b"], {}, unserved=frozenset({"c"}))
    assert "c" not in gone.owners and gone.nodes == ("a", "b")
    assert sum(gone.owners.count(n) for n in "ab") == 256
    check_leaving(["c"], {}, 3, frozenset({"c"}))              # no report needed
    with pytest.raises(RemapRefused, match="node b has not reported"):
        check_leaving(["b", "c"], {}, 3, frozenset({"c"}))     # the other leaving node still is checked


def test_the_written_map_lists_the_nodes_known_never_to_have_served():
    first = map_record(["a", "b"], {"a": 1, "b": 1}, spread(["a", "b"], None, 256), [], unstarted=["a", "b"])
    assert first["unstarted"] == ["a", "b"] and "gate" not in first
    added = plan_remap(first, ["a", "b", "c", "d"], {}, unserved=frozenset({"b"}))
    assert added.unstarted == ("b", "c", "d")                 # a served; c and d are new
    assert added.as_map([])["unstarted"] == ["b", "c", "d"]
    assert plan_remap(first, ["a", "b", "c"], {}).unstarted == ("c",)
