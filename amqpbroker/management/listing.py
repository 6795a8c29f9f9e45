"""Paging, filtering and sorting of the queue listing (pure: plain names and numbers).

The API takes the names (and, to sort by depth, each queue's depth) from the broker
on its loop, runs `select_page` in a worker thread (filtering and sorting 50,000
names costs tens of milliseconds), and builds full views for the chosen page only.
"""

from __future__ import annotations

import fnmatch
import heapq
import re
from typing import Callable, Collection, Mapping, Sequence
from urllib.parse import urlencode

SORTS = ("name", "depth")
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
_GLOB_CHARS = frozenset("*?[")


def name_matcher(pattern: str | None) -> Callable[[str], bool]:
    """A glob (`orders.*`, `q-[0-9]*`) when the pattern has a glob character, else a
    prefix (`orders.` matches every name starting so).  Case-sensitive, like names."""
    if not pattern:
        return lambda name: True
    if _GLOB_CHARS & set(pattern):
        match = re.compile(fnmatch.translate(pattern)).match
        return lambda name: match(name) is not None
    return lambda name: name.startswith(pattern)


def select_page(names: Sequence[str], *, pattern: str | None = None, sort: str = "name",
                depths: Mapping[str, int] | None = None, offset: int = 0, limit: int = DEFAULT_LIMIT,
                subscription_queues: Collection[str] = (), subscription: bool | None = None
                ) -> tuple[int, list[str]]:
    """(how many names match, the names of the page asked for).

    `sort`: "name" (ascending) or "depth" (deepest first, then by name; needs `depths`;
    a name missing from it counts as empty).  `subscription`: True keeps only the
    queues of topic subscriptions (`subscription_queues`), False leaves them out."""
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(SORTS)}")
    matches = name_matcher(pattern)
    if subscription is None:
        chosen = [n for n in names if matches(n)]
    else:
        chosen = [n for n in names if matches(n) and (n in subscription_queues) == subscription]
    key = None
    if sort == "depth":
        depth = (depths or {}).get
        key = lambda n: (-depth(n, 0), n)   # noqa: E731
    # A small first page of many names: a heap selection, a Python loop the worker
    # thread can be interrupted in; a whole sort is one C call that keeps the GIL
    # (and so the event loop) for ~20 ms per 50,000 names.
    wanted = offset + limit
    if wanted < len(chosen) // 4:
        ordered = heapq.nsmallest(wanted, chosen, key=key)
    else:
        ordered = sorted(chosen, key=key)
    return len(chosen), ordered[offset:wanted]


def next_link(path: str, query: Mapping[str, str], total: int, offset: int, limit: int) -> str | None:
    """An RFC 8288 `Link: <…>; rel="next"` value when more follow, else None."""
    if offset + limit >= total:
        return None
    params = {**{k: v for k, v in query.items() if k not in ("offset", "limit")},
              "offset": str(offset + limit), "limit": str(limit)}
    return f'<{path}?{urlencode(params)}>; rel="next"'


__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "SORTS", "name_matcher", "next_link", "select_page"]
