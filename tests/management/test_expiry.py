"""The idle-expiry policy and the `abandoned` test (amqpbroker/management/expiry.py),
its durations (amqpbroker/core/durations.py),
with an injected clock: no sleeping."""

from __future__ import annotations

import pytest

from amqpbroker.management.expiry import (
    DELETE,
    REPORT,
    ExpiryRule,
    ExpiryTracker,
    SubscriptionState,
    evaluate,
    evaluate_one,
    is_abandoned,
)
from amqpbroker.core.durations import format_duration, parse_duration

DAY = 86400.0
NOW = 1_000 * DAY


def sub(name="audit", topic="orders.eu", *, consumers=0, pending=0, idle_days=None, created_days=30,
        durable=True, namespace="app") -> SubscriptionState:
    return SubscriptionState(namespace=namespace, name=name, topic=topic, durable=durable,
                             consumers=consumers, pending=pending, created_at=NOW - created_days * DAY,
                             idle_since=None if idle_days is None else NOW - idle_days * DAY)


# ---------------------------------------------------------------------- durations

@pytest.mark.parametrize("text,seconds", [
    ("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("7d", 7 * DAY), ("2w", 14 * DAY),
    ("1d12h", 1.5 * DAY), ("1.5h", 5400), (" 7D ", 7 * DAY), (30, 30), (2.5, 2.5), ("7 d", 7 * DAY),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "abc", "7x", "-5", "d7", "1d12", True, -1])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_duration():
    assert format_duration(None) == "-"
    assert format_duration(5) == "5s"
    assert format_duration(90) == "1.5m"
    assert format_duration(7 * DAY) == "7.0d"
    assert format_duration(12 * DAY) == "12d"


# ---------------------------------------------------------------------- idle and abandoned

def test_idle_for_counts_from_last_consumer_or_creation():
    assert sub(idle_days=3).idle_for(NOW) == 3 * DAY
    assert sub(idle_days=None, created_days=5).idle_for(NOW) == 5 * DAY
    assert sub(consumers=1, idle_days=3).idle_for(NOW) is None


def test_abandoned_needs_durable_no_consumer_and_idle_time():
    assert is_abandoned(sub(idle_days=8), 7 * DAY, NOW)
    assert is_abandoned(sub(idle_days=7), 7 * DAY, NOW), "exactly the limit counts"
    assert not is_abandoned(sub(idle_days=6), 7 * DAY, NOW)
    assert not is_abandoned(sub(idle_days=8, consumers=1), 7 * DAY, NOW)
    assert not is_abandoned(sub(idle_days=8, durable=False), 7 * DAY, NOW)


# ---------------------------------------------------------------------- rules

def test_rule_needs_a_condition_and_known_action():
    with pytest.raises(ValueError):
        ExpiryRule("x")
    with pytest.raises(ValueError):
        ExpiryRule("x", idle=1, action="archive")
    with pytest.raises(ValueError):
        ExpiryRule("x", idle=1, match="some")


def test_pattern_globs_topic_or_name():
    rule = ExpiryRule("orders.*", idle=DAY)
    assert rule.covers(sub(topic="orders.eu"))
    assert not rule.covers(sub(topic="invoices.eu", name="x"))
    assert ExpiryRule("audit-*", idle=DAY).covers(sub(name="audit-7", topic="invoices"))


def test_idle_rule_fires_after_idle_time():
    rule = ExpiryRule("*", idle=7 * DAY)
    assert evaluate_one(rule, sub(idle_days=6), NOW) is None
    act = evaluate_one(rule, sub(idle_days=8), NOW)
    assert act is not None and act.action == REPORT
    assert "no consumer for 8.0d" in act.describe()


def test_idle_rule_never_fires_with_a_consumer():
    assert evaluate_one(ExpiryRule("*", idle=0), sub(consumers=1), NOW) is None


def test_backlog_rule_fires_over_the_limit_only():
    rule = ExpiryRule("*", max_backlog=100)
    assert evaluate_one(rule, sub(pending=100), NOW) is None
    act = evaluate_one(rule, sub(pending=101), NOW)
    assert act is not None and "backlog of 101 message(s) over 100" in act.reasons


def test_match_any_fires_on_either_condition():
    rule = ExpiryRule("*", idle=7 * DAY, max_backlog=100)
    assert evaluate_one(rule, sub(idle_days=8, pending=0), NOW) is not None
    assert evaluate_one(rule, sub(idle_days=1, pending=500), NOW) is not None
    assert evaluate_one(rule, sub(idle_days=1, pending=5), NOW) is None


def test_match_all_needs_both_conditions():
    rule = ExpiryRule("*", idle=7 * DAY, max_backlog=100, match="all")
    assert evaluate_one(rule, sub(idle_days=8, pending=0), NOW) is None
    assert evaluate_one(rule, sub(idle_days=1, pending=500), NOW) is None
    act = evaluate_one(rule, sub(idle_days=8, pending=500), NOW)
    assert act is not None and len(act.reasons) == 2


def test_delete_action_for_idle_subscription():
    act = evaluate_one(ExpiryRule("*", idle=DAY, action=DELETE), sub(idle_days=2), NOW)
    assert act.action == DELETE


def test_delete_never_removes_a_consumed_subscription():
    act = evaluate_one(ExpiryRule("*", max_backlog=10, action=DELETE), sub(consumers=2, pending=50), NOW)
    assert act.action == REPORT
    assert any("2 consumer(s) attached: not deleted" in r for r in act.reasons)


def test_evaluate_skips_non_durable_and_uses_the_first_matching_rule():
    rules = [ExpiryRule("orders.*", idle=30 * DAY, action=DELETE), ExpiryRule("*", idle=DAY)]
    subs = [sub("a", "orders.eu", idle_days=10),      # first rule covers it: not 30 days yet
            sub("b", "invoices", idle_days=10),       # second rule
            sub("c", "invoices", idle_days=10, durable=False)]
    acts = evaluate(rules, subs, NOW)
    assert [(a.sub.name, a.rule.pattern) for a in acts] == [("b", "*")]


def test_evaluate_with_clock_moving_forward():
    rules = [ExpiryRule("*", idle=7 * DAY, action=DELETE)]
    s = sub(idle_days=0)
    assert evaluate(rules, [s], NOW) == []
    assert evaluate(rules, [s], NOW + 6 * DAY) == []
    assert [a.action for a in evaluate(rules, [s], NOW + 7 * DAY)] == [DELETE]


# ---------------------------------------------------------------------- reporting once

def test_tracker_reports_once_until_the_subscription_recovers():
    rules = [ExpiryRule("*", idle=DAY)]
    tracker = ExpiryTracker()
    idle = sub(idle_days=2)
    assert len(tracker.due(evaluate(rules, [idle], NOW))) == 1
    assert tracker.due(evaluate(rules, [idle], NOW + 60)) == [], "not again on the next run"
    consumed = sub(consumers=1)
    assert tracker.due(evaluate(rules, [consumed], NOW + 120)) == []
    assert len(tracker.due(evaluate(rules, [sub(idle_days=2)], NOW + 180))) == 1, "again after recovering"


def test_tracker_passes_deletions_every_time():
    rules = [ExpiryRule("*", idle=DAY, action=DELETE)]
    tracker = ExpiryTracker()
    s = sub(idle_days=2)
    assert len(tracker.due(evaluate(rules, [s], NOW))) == 1
    assert len(tracker.due(evaluate(rules, [s], NOW))) == 1
