"""Selectors are cheap or refused (core/selectors): LIKE costs time in proportion to
the value, not to value x pattern; an evaluation has a budget and says clearly when
it is spent; every entry point has the same length limit (the AMQP attach, the
management API and the CLI through it: tests/management/test_messages_api.py).

Timings compare two patterns on the same value in the same run (best of several
runs each), never an absolute bound."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amqpbroker.core.selectors import (
    EVALUATION_BUDGET, SelectorBudgetExceeded, SelectorError, check_length, compile_selector,
)
from amqpbroker.core.selectors.evaluator import like_matcher


def best_of(fn, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_a_long_run_of_underscores_costs_what_a_short_one_does():
    """The finding: '%____…b%' (4,012 characters) against a 1 MB string property
    was O(len(value) x len(pattern)): seconds per message."""
    value = "a" * (1 << 20)
    lookup = {"v": value}.get
    long_pattern = "%" + "_" * 4009 + "b%"
    assert len(long_pattern) == 4012
    long_sel = compile_selector(f"v LIKE '{long_pattern}'")
    short_sel = compile_selector("v LIKE '%" + "_" * 10 + "b%'")
    assert long_sel.matches(lookup) is False and short_sel.matches(lookup) is False
    short = best_of(lambda: short_sel.matches(lookup))
    long = best_of(lambda: long_sel.matches(lookup), runs=3)
    assert long < 20 * short + 0.002, f"{long * 1000:.1f} ms against {short * 1000:.1f} ms"
    assert long_sel.matches({"v": value + "b" * 5000}.get) is True


def _reference(pattern: str, escape: str | None, value: str) -> bool:
    """LIKE by its definition (§3.8.1.1), as a regular expression (small inputs only)."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == escape:
            i += 1
            out.append(re.escape(pattern[i]))
        elif ch == "%":
            out.append(".*")
        elif ch == "_":
            out.append(".")
        else:
            out.append(re.escape(ch))
        i += 1
    return re.fullmatch("".join(out), value, re.DOTALL) is not None


@settings(max_examples=600, deadline=None)
@given(st.text(alphabet="ab_%!", max_size=12), st.text(alphabet="ab_%!\n", max_size=16))
def test_like_means_what_the_specification_says(pattern, value):
    escape = "!"
    if pattern.endswith("!") and (len(pattern) - len(pattern.rstrip("!"))) % 2:
        with pytest.raises(ValueError):
            like_matcher(pattern, escape)
        return
    assert like_matcher(pattern, escape)(value) is _reference(pattern, escape, value)


def test_an_evaluation_over_its_budget_is_refused_clearly():
    """A LIKE whose %-free part has '_' inside it is matched by a scan that may cost
    len(value) x its width: past the budget, the evaluation stops before the work
    and says why (consumers: the message does not match; the management API: 400)."""
    width = 4000
    sel = compile_selector("v LIKE '%a" + "_" * width + "b%'")
    big = "a" * (EVALUATION_BUDGET // width + 10)
    with pytest.raises(SelectorBudgetExceeded, match="budget"):
        sel.matches({"v": big}.get)
    assert sel.matches({"v": "a" + "x" * width + "b"}.get) is True   # small values are fine
    assert compile_selector("v LIKE '%needle%'").matches({"v": big}.get) is False   # a plain scan is cheap


def test_the_length_limit_is_one_function_for_every_entry_point():
    check_length("a = 1", 16)
    with pytest.raises(SelectorError, match=r"longer than 16 characters \(limits.max_selector_length\)"):
        check_length("a = 1 AND b = 2 AND c = 3", 16)


# A selector whose every evaluation stays within its budget can still cost a lot per
# message: ten LIKEs with `_` between literals, each charged (and costing) about
# len(value) x 3 steps.  Against 40 messages with a 1 MiB property, a consumer's
# attach held the loop 7.8 s while its scan evaluated them all in one dispatch.  What
# one loop turn spends on selector evaluation is bounded too (TURN_BUDGET): past it,
# the scan (a consumer's, a browser's, a move's slice) goes on at the next turn.
COSTLY = " OR ".join(f"p LIKE '%a_{c}%'" for c in "bcdefghijk")
COSTLY_VALUE = "a" * (1 << 18)      # 10 x 768 Ki steps an evaluation: within its budget


def _costly_queue(n: int):
    from amqpbroker.core.queues import Queue
    from tests.core.helpers import make_message
    q = Queue("q")
    turns: list = []
    q.defer = turns.append           # the next loop turn, run by the test
    for i in range(n):
        q.enqueue(make_message(i, properties={"p": COSTLY_VALUE}))
    return q, turns


def _counting_consumer(evaluated: list, **kw):
    from amqpbroker.core.message import selector_accepts
    from tests.core.helpers import RecordingConsumer
    sel = compile_selector(COSTLY)
    assert sel.matches({"p": COSTLY_VALUE}.get) is False            # within its own budget
    return RecordingConsumer(accept=lambda e: evaluated.append(e.seq) or selector_accepts(sel, e.msg, 0), **kw)


def _run_turns(turns: list) -> int:
    n = 0
    while turns:
        turns.pop(0)()
        n += 1
        assert n < 1000
    return n


def test_a_consumer_scan_yields_the_loop_once_its_selector_cost_is_spent():
    q, turns = _costly_queue(20)
    evaluated: list = []
    consumer = _counting_consumer(evaluated, credit=100)
    q.add_consumer(consumer)
    q.dispatch()
    assert 0 < len(evaluated) < 20 and turns, f"{len(evaluated)} costly evaluations in one loop turn"
    _run_turns(turns)
    assert sorted(evaluated) == list(range(1, 21))                  # each examined once, in later turns
    assert q.depth == 20 and not consumer.delivered                 # none matches, none lost


def test_a_browser_yields_the_loop_once_its_selector_cost_is_spent():
    q, turns = _costly_queue(20)
    evaluated: list = []
    browser = _counting_consumer(evaluated, credit=100, browser=True)
    q.add_consumer(browser)
    q.dispatch()
    assert 0 < len(evaluated) < 20 and turns, f"{len(evaluated)} costly evaluations in one loop turn"
    _run_turns(turns)
    assert sorted(evaluated) == list(range(1, 21)) and not browser.copies and q.depth == 20


def test_a_move_slice_yields_the_loop_once_its_selector_cost_is_spent():
    from amqpbroker.core.broker import Broker
    from amqpbroker.core.moves import Move, compile_filter
    from tests.core.helpers import make_message
    b = Broker()
    src, dst = b.declare_queue("a"), b.declare_queue("b")
    for i in range(20):
        b.publish(make_message(i, properties={"p": COSTLY_VALUE}), b.resolve("a"))
    move = Move(b, src, to="b", replay=False, selector=compile_filter(COSTLY, 4096))
    move.step()
    assert 0 < move.report.examined < 20, f"{move.report.examined} costly evaluations in one step"
    steps = 1
    while not move.step():
        steps += 1
        assert steps < 1000
    assert move.report.examined == 20 and move.report.moved == 0 and src.depth == 20 and dst.depth == 0


def test_routing_one_message_through_many_subscription_selectors_has_one_budget():
    """The same selector on 20 subscriptions of a topic: one 1 MiB message held the
    loop 3.3 s while it was routed (every subscription's evaluation within its own
    budget).  The subscriptions' selectors share one evaluation budget per message:
    past it they do not match (counted, as an evaluation over its budget is)."""
    from amqpbroker.core.broker import Broker
    from amqpbroker.core.registry import subscription_filter
    from amqpbroker.core.selectors import Stats
    from tests.core.helpers import make_message
    b = Broker()
    subs = [b.declare_queue(f"sub{i}") for i in range(20)]
    for q in subs:
        b.bind("amq.topic", "t", q, subscription_filter(COSTLY, None))
    before = Stats.budget_exceeded_total
    routed = b.route("amq.topic", "t", make_message("x", properties={"p": COSTLY_VALUE + "axk"}))   # the last LIKE
    refused = Stats.budget_exceeded_total - before
    per_evaluation = 10 * 3 * len(COSTLY_VALUE)                       # what each one costs
    ran = 20 - refused
    assert ran * per_evaluation <= EVALUATION_BUDGET + per_evaluation, f"{ran} costly evaluations for one message"
    assert routed and len(routed) == ran                              # those that ran matched
    small = b.route("amq.topic", "t", make_message("x", properties={"p": "axk"}))
    assert len(small) == 20                                           # a cheap message reaches all
