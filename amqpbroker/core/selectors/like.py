"""LIKE (JMS 2.0 §3.8.1.1: `_` one character, `%` any sequence, an optional escape
character) compiled to a matcher whose cost is in proportion to the value, and the
per-evaluation budget every selector evaluation runs under.

A pattern is cut at its `%` into fixed-width parts.  The first is matched at the
start, the last at the end, each in time proportional to its width.  Those between
are found left-most in turn, which is exact for fixed-width parts (the left-most
place leaves the most room for the rest).  Within a part, a run of `_` at either
end is no search at all: it only moves the place where the search starts or ends,
so `'%____…b%'` is one `str.find` of 'b' (linear), however long the run.  A middle
part with literal characters only is a `str.find` too (CPython: linear).  Only a
middle part with `_` *between* literal characters (`'%a_b%'`) is a regular
expression search, which may cost len(value) x its width: that cost is charged to
the evaluation's budget before the search runs.

The budget (`EVALUATION_BUDGET` steps; a step is about one character examined)
bounds what one evaluation of one selector against one message may cost: past it
`SelectorBudgetExceeded` says which LIKE and how much it would have cost.
"""

from __future__ import annotations

import re
import threading
from typing import Callable

EVALUATION_BUDGET = 32 << 20   # steps (characters examined) per evaluation
# Steps one loop turn's run of evaluations (a consumer's or a browser's scan in one
# dispatch, a move's slice, a browse slice) may spend before it yields: evaluations
# each within their budget still add up (40 messages with a 1 MiB property and ten
# LIKEs of ~3 Mi steps each held the loop 7.8 s in one scan).  The caller compares
# `spent()` before and after and goes on at the next turn once this is spent.
TURN_BUDGET = 4 << 20

_left = threading.local()       # what the evaluation running on this thread may still spend


class SelectorBudgetExceeded(ValueError):
    """An evaluation would spend more than EVALUATION_BUDGET steps."""


def begin_evaluation() -> None:
    """A new evaluation starts with the whole budget, unless it is one of several
    that share one (`share_budget`)."""
    if not getattr(_left, "shared", False):
        _left.steps = EVALUATION_BUDGET


def share_budget() -> None:
    """The evaluations from now until `end_shared` share one budget: the binding
    filters (subscriptions' selectors) one message is routed through.  Each within
    its own budget, twenty subscriptions with the same costly selector held the loop
    3.3 s for one 1 MiB message; past the shared budget the rest do not match."""
    _left.steps = EVALUATION_BUDGET
    _left.shared = True


def end_shared() -> None:
    _left.shared = False


def charge(steps: int, what: Callable[[], str]) -> None:
    """Spend `steps`; SelectorBudgetExceeded (naming `what()`) when they are not there."""
    left = getattr(_left, "steps", EVALUATION_BUDGET) - steps
    if left < 0:
        raise SelectorBudgetExceeded(f"selector evaluation over its budget of {EVALUATION_BUDGET:,} steps: "
                                     f"{what()} would cost {steps:,}")
    _left.steps = left
    _left.spent = spent() + steps


def spent() -> int:
    """Steps charged on this thread so far, all evaluations together (a running
    total: callers compare two readings against TURN_BUDGET)."""
    return getattr(_left, "spent", 0)


Part = list  # of str (a literal character) and None (`_`)


def _parts(pattern: str, escape: str | None) -> list[Part]:
    parts: list[Part] = [[]]
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == escape:
            i += 1
            if i == len(pattern):
                raise ValueError("LIKE pattern ends with the escape character")
            parts[-1].append(pattern[i])
        elif ch == "%":
            parts.append([])
        else:
            parts[-1].append(None if ch == "_" else ch)
        i += 1
    return parts


def _rx(part: Part) -> re.Pattern[str]:
    return re.compile("".join("." if c is None else re.escape(c) for c in part), re.DOTALL)


def _anchored(part: Part) -> Callable[[str, int], bool]:
    """Whether `part` matches the value at a given position (time: its width)."""
    if None not in part:
        literal = "".join(part)
        return lambda s, at: s.startswith(literal, at)
    rx = _rx(part)
    return lambda s, at: rx.match(s, at) is not None


def _middle(part: Part) -> tuple[int, str | re.Pattern[str] | None, int, int]:
    """(leading `_`, what to find — a literal, a pattern, or None — , trailing `_`,
    the width of what to find)."""
    lead = 0
    while lead < len(part) and part[lead] is None:
        lead += 1
    trail = 0
    while trail < len(part) - lead and part[-1 - trail] is None:
        trail += 1
    core = part[lead:len(part) - trail]
    if not core:
        return lead + trail, None, 0, 0
    if None not in core:
        return lead, "".join(core), trail, len(core)
    return lead, _rx(core), trail, len(core)


def _literal_shape(lits: list[str]) -> Callable[[str], bool] | None:
    """'x', 'x%', '%x' without `_`: one string test each, in time of the pattern."""
    if len(lits) == 1:
        return lits[0].__eq__
    if len(lits) == 2 and not lits[1]:
        return lambda s, p=lits[0]: s.startswith(p)
    if len(lits) == 2 and not lits[0]:
        return lambda s, p=lits[1]: s.endswith(p)
    return None


def like_matcher(pattern: str, escape: str | None) -> Callable[[str], bool]:
    """Compile a LIKE pattern. Raises ValueError if it ends with the escape character."""
    parts = _parts(pattern, escape)
    what = f"LIKE '{pattern[:40]}{'…' if len(pattern) > 40 else ''}'"
    if all(None not in p for p in parts) and len(parts) <= 2:
        shortcut = _literal_shape(["".join(p) for p in parts])   # type: ignore[arg-type]
        if shortcut is not None:
            return shortcut
    if len(parts) == 1:
        whole, width = _anchored(parts[0]), len(parts[0])
        return lambda s: len(s) == width and whole(s, 0)
    head, *middle, tail = parts
    at_start = _anchored(head) if head else None
    at_end = _anchored(tail) if tail else None
    head_len, tail_len = len(head), len(tail)
    min_len = sum(len(p) for p in parts)
    steps = [_middle(m) for m in middle if m]

    def match(s: str) -> bool:
        n = len(s)
        if n < min_len:
            return False
        if (at_start is not None and not at_start(s, 0)) or (at_end is not None and not at_end(s, n - tail_len)):
            return False
        end = n - tail_len
        pos = head_len
        for lead, core, trail, width in steps:
            if core is None:                      # only `_`: a fixed step
                pos += lead
            elif type(core) is str:               # literal: str.find, linear
                charge(end - pos, lambda: what)
                i = s.find(core, pos + lead, end - trail)
                if i < 0:
                    return False
                pos = i + len(core) + trail
            else:                                 # `_` inside: a search of cost up to (room x width)
                charge((end - pos) * width, lambda: f"{what} on {n:,} characters")
                m = core.search(s, pos + lead, end - trail)
                if m is None:
                    return False
                pos = m.end() + trail
            if pos > end:
                return False
        return True
    return match
