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
