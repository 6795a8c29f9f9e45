"""Findings the fuzz run already knows (none open today): broker bugs reported with
a regression test in tests/fuzz/test_regressions.py (xfail, strict).  The run counts them and goes
on; anything else fails it.  When a bug is fixed, its regression test XPASSes
(and fails the suite): remove the marker there and the entry here together.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    name: str
    regression: str                       # test_regressions.py::<this>
    traceback: Callable[[str], bool] | None = None    # recognises a traceback block of the broker log
    hang: Callable[[object], bool] | None = None      # recognises a hung case
    # recognises a slow canary round trip by what ran meanwhile (labels, and the cases)
    slow: Callable[[list[str], list[object]], bool] | None = None


def _all(*needles: str) -> Callable[[str], bool]:
    return lambda block: all(n in block for n in needles)


KNOWN: list[Known] = [   # the first that matches names a finding
]

# --------------------------------------------------------------------------- mutants not sent
# A known bug that stops the whole broker would end the run at its first hit; the
# run leaves such mutants out (and counts them) until the fix.  Set
# AMQPBROKER_FUZZ_AVOID=0 to send them anyway.  (None today.)


@dataclass(frozen=True)
class Avoided:
    name: str
    regression: str
    matches: Callable[[object], bool]     # on a mutant's frames


AVOID: list[Avoided] = []


def avoided(frames) -> Avoided | None:
    return next((a for a in AVOID if a.matches(frames)), None)


_TRACEBACK = "Traceback (most recent call last):"


def traceback_blocks(lines: list[str]) -> list[str]:
    """Each traceback in the log with the line that introduced it and its last
    (exception) line."""
    blocks = []
    i = 0
    while i < len(lines):
        if _TRACEBACK in lines[i]:
            start = i - 1 if i and re.search(r" (ERROR|CRITICAL|WARNING) ", lines[i - 1]) else i
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()
                                      or _TRACEBACK in lines[j] or lines[j].startswith(("The above", "During"))):
                j += 1
            blocks.append("".join(lines[start:j + 1]))
            i = j + 1
        else:
            i += 1
    return blocks


def known_traceback(block: str) -> Known | None:
    return next((k for k in KNOWN if k.traceback is not None and k.traceback(block)), None)


def known_hang(case) -> Known | None:
    return next((k for k in KNOWN if k.hang is not None and k.hang(case)), None)


def known_slow(meanwhile: list[str], cases: list[object]) -> Known | None:
    return next((k for k in KNOWN if k.slow is not None and k.slow(meanwhile, cases)), None)


__all__ = [
    "AVOID",
    "KNOWN",
    "Avoided",
    "Known",
    "avoided",
    "known_hang",
    "known_slow",
    "known_traceback",
    "traceback_blocks",
]
