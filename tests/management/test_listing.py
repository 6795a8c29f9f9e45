"""The queue listing's paging, filtering and sorting (management/listing.py, pure)."""

from __future__ import annotations

import pytest

from amqpbroker.management.listing import name_matcher, next_link, select_page

NAMES = ["orders.eu", "orders.us", "invoices", "orders", "qpidsub_/app_/s_/durable", "a[1]"]


@pytest.mark.parametrize("pattern,name,matches", [
    (None, "anything", True),
    ("", "anything", True),
    ("orders", "orders.eu", True),           # no glob character: a prefix
    ("orders", "order", False),
    ("orders.*", "orders.eu", True),
    ("orders.*", "orders", False),
    ("*.eu", "orders.eu", True),
    ("orders.?u", "orders.eu", True),
    ("q-[0-9]*", "q-7x", True),
    ("q-[0-9]*", "q-x7", False),
    ("Orders", "orders.eu", False),          # names are case-sensitive
    ("a[1]", "a[1]", False),                 # a glob: [1] is a character class
    ("a[[]1]", "a[1]", True),
])
def test_name_matcher(pattern, name, matches):
    assert name_matcher(pattern)(name) is matches


def test_sorted_by_name_and_paged():
    assert select_page(NAMES) == (6, sorted(NAMES))
    assert select_page(NAMES, offset=1, limit=2) == (6, ["invoices", "orders"])
    assert select_page(NAMES, offset=10, limit=2) == (6, [])
    assert select_page(NAMES, pattern="orders") == (3, ["orders", "orders.eu", "orders.us"])


def test_sorted_by_depth_deepest_first_then_by_name():
    depths = {"orders.eu": 5, "orders.us": 5, "invoices": 9, "orders": 0}
    total, page = select_page(NAMES, sort="depth", depths=depths)
    assert total == 6 and page[:4] == ["invoices", "orders.eu", "orders.us", "a[1]"]
    assert select_page(NAMES, sort="depth", depths=depths, pattern="orders", limit=2) == (3, ["orders.eu",
                                                                                              "orders.us"])


def test_subscription_queues_in_or_out():
    subs = {"qpidsub_/app_/s_/durable"}
    assert select_page(NAMES, subscription_queues=subs, subscription=True) == (1, ["qpidsub_/app_/s_/durable"])
    total, page = select_page(NAMES, subscription_queues=subs, subscription=False)
    assert total == 5 and "qpidsub_/app_/s_/durable" not in page


def test_unknown_sort_is_refused():
    with pytest.raises(ValueError):
        select_page(NAMES, sort="colour")


def test_next_link():
    assert next_link("/api/queues", {}, total=10, offset=0, limit=10) is None
    assert next_link("/api/queues", {"name": "o*", "limit": "3"}, total=10, offset=3, limit=3) == \
        '</api/queues?name=o%2A&offset=6&limit=3>; rel="next"'
