"""core/remap.py: the new slot map of `amqpbroker cluster remap`, row by row."""

from __future__ import annotations

import pytest

from amqpbroker.core.placement import spread
from amqpbroker.core.remap import RemapRefused, describe, plan_remap, rebalance, targets


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
