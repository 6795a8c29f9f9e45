"""Duplicate-detection windows (core/dedup.py): bounded, LRU by arrival, per address."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, strategies as st
from proton import ulong

from amqpbroker.core.dedup import (
    DedupRule,
    DedupWindow,
    DedupWindows,
    id_key,
    split_store_key,
    store_key,
)


def test_window_remembers_up_to_capacity_and_evicts_oldest_arrival():
    w = DedupWindow(3)
    for k in (b"a", b"b", b"c"):
        assert w.add(k)[1] == []
    assert b"a" in w
    n, evicted = w.add(b"d")
    assert n == 4 and evicted == [b"a"]
    assert b"a" not in w and len(w) == 3


def test_a_duplicate_does_not_refresh_its_arrival():
    ws = DedupWindows([DedupRule("q", 2)])
    ws.record("q", b"a")
    ws.record("q", b"b")
    assert ws.is_duplicate("q", b"a")          # seen again: not re-recorded
    ws.record("q", b"c")                       # evicts a (oldest arrival), not b
    assert not ws.is_duplicate("q", b"a")
    assert ws.is_duplicate("q", b"b") and ws.is_duplicate("q", b"c")


def test_windows_are_per_address_and_only_where_a_rule_matches():
    ws = DedupWindows([DedupRule("orders.*", 10), DedupRule("results", 5)])
    assert ws.record("orders.eu", b"1") is not None
    assert ws.is_duplicate("orders.eu", b"1")
    assert not ws.is_duplicate("orders.us", b"1")
    assert ws.record("other", b"1") is None and not ws.is_duplicate("other", b"1")
    ws.record("results", b"1")
    assert ws.windows["results"].capacity == 5 and ws.windows["orders.eu"].capacity == 10


def test_first_matching_rule_wins():
    ws = DedupWindows([DedupRule("a*", 1), DedupRule("ab*", 7)])
    ws.record("abc", b"x")
    assert ws.windows["abc"].capacity == 1


def test_messages_without_id_are_never_duplicates():
    ws = DedupWindows([DedupRule("*")])
    assert ws.record("q", None) is None
    assert not ws.is_duplicate("q", None)


def test_id_keys_keep_the_amqp_type_apart():
    u = uuid.uuid4()
    keys = [id_key("1"), id_key(ulong(1)), id_key(b"1"), id_key(u)]
    assert len(set(keys)) == 4
    assert id_key(None) is None
    assert id_key(ulong(7)) == id_key(7)


def test_restore_orders_by_arrival_and_trims_to_a_smaller_window():
    w = DedupWindow(2)
    gone = w.restore([(b"c", 3), (b"a", 1), (b"b", 2)])
    assert gone == [b"a"]
    assert b"b" in w and b"c" in w
    n, evicted = w.add(b"d")
    assert n == 4 and evicted == [b"b"]       # arrival numbers continue after restore


def test_store_key_round_trip():
    assert split_store_key(store_key("dd.x/y", b"s:abc\x00def")) == ("dd.x/y", b"s:abc\x00def")


def test_window_needs_room():
    with pytest.raises(ValueError):
        DedupWindow(0)


@given(st.lists(st.integers(0, 30), max_size=200), st.integers(1, 10))
def test_window_is_exactly_the_last_distinct_new_arrivals(ids, cap):
    """Model check: the window holds the `cap` most recent *first* arrivals."""
    ws = DedupWindows([DedupRule("*", cap)])
    model: list[int] = []
    for i in ids:
        key = str(i).encode()
        dup = ws.is_duplicate("q", key)
        assert dup == (i in model)
        if not dup:
            ws.record("q", key)
            model.append(i)
            model = model[-cap:]
    assert sorted(ws.windows.get("q", DedupWindow(1))._ids) == sorted(str(i).encode() for i in model) or not ids


def test_long_ids_are_kept_as_a_bounded_digest():
    long_a, long_b = "a" * 5000, "a" * 4999 + "b"
    ka, kb = id_key(long_a), id_key(long_b)
    assert len(ka) <= 200 and ka != kb and ka == id_key("a" * 5000)
    assert len(store_key("some.address", ka)) < 511
