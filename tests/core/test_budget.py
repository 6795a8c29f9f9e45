"""core/budget.py: the broker-wide memory budget's decisions, a test per row."""

from __future__ import annotations

import pytest

from amqpbroker.core.budget import (ENTRY_COST, MIN_PAGE_IN, UNLIMITED, MemoryBudget, body_room, entry_bytes,
                                    page_in_count, page_in_low, pages_new)


def budget(limit: int, used: int) -> MemoryBudget:
    b = MemoryBudget(limit)
    b.used = used
    return b


@pytest.mark.parametrize("paging, queue_budget, queue_bytes, broker, pages", [
    (False, 0, 10**9, budget(100, 10**6), False),   # a queue that cannot page never does
    (False, 1000, 500, budget(0, 10**9), False),     # under its own budget, no broker budget
    (False, 1000, 1500, None, True),                 # over its own budget
    (True, 1000, 10, budget(100, 0), True),          # paging already: what follows stays behind
    (False, 1000, 10, budget(100, 101), True),       # the broker's budget is used up
    (False, 1000, 10, budget(100, 100), False),      # at the limit, not over it
])
def test_pages_new(paging, queue_budget, queue_bytes, broker, pages):
    assert pages_new(paging, queue_budget, queue_bytes, broker) is pages


@pytest.mark.parametrize("batch, room, each, count", [
    (2000, UNLIMITED, 400, 2000),                     # no limit: the whole batch
    (2000, 400 * 100, 400, 100),                      # what the room holds
    (2000, 0, 400, MIN_PAGE_IN),                      # no room: still a few (consumers wait)
    (4, 0, 400, 4),                                   # never more than the batch
    (2000, 10**12, 400, 2000),
])
def test_page_in_count(batch, room, each, count):
    assert page_in_count(batch, room, each) == count


@pytest.mark.parametrize("batch, room, each, demand, count", [
    (2000, 10**9, 400, 20, 40),                       # twice what the consumers may take
    (2000, 10**9, 400, 0, MIN_PAGE_IN),               # no credit yet: a few, ready for it
    (2000, 10**9, 400, 5000, 2000),                   # never more than the batch
    (2000, 400 * 30, 400, 100, 30),                   # nor than the room holds
    (2000, 0, 400, 100, MIN_PAGE_IN),                 # nor fewer than MIN_PAGE_IN
    (2000, UNLIMITED, 400, 20, 2000),                 # no broker budget: the queue's batch
])
def test_page_in_count_follows_the_consumers_demand(batch, room, each, demand, count):
    assert page_in_count(batch, room, each, demand) == count


@pytest.mark.parametrize("low, room, each, result", [
    (1000, UNLIMITED, 400, 1000),
    (1000, 400 * 50, 400, 50),
    (1000, 0, 400, MIN_PAGE_IN),
    (3, 0, 400, 3),
])
def test_page_in_low(low, room, each, result):
    assert page_in_low(low, room, each) == result


@pytest.mark.parametrize("low, room, each, demand, result", [
    (1000, 10**9, 400, 20, 20),
    (1000, 10**9, 400, 0, 0),                         # nobody may take anything: nothing is read
    (1000, 10**9, 400, 1, MIN_PAGE_IN),
    (1000, 10**9, 400, 5000, 1000),
    (1000, 400 * 10, 400, 100, MIN_PAGE_IN),
    (1000, UNLIMITED, 400, 20, 1000),
])
def test_page_in_low_follows_the_consumers_demand(low, room, each, demand, result):
    assert page_in_low(low, room, each, demand) == result


def test_body_room_is_the_least_of_the_queue_and_the_broker():
    assert body_room(1000, None) == 1000
    assert body_room(1000, budget(500, 100)) == 400
    assert body_room(100, budget(500, 100)) == 100
    assert body_room(100, budget(0, 10**9)) == 100


def test_over_and_room():
    assert not MemoryBudget(0).over and MemoryBudget(0).room() == UNLIMITED
    assert budget(10, 11).over and budget(10, 11).room() == 0
    assert budget(10, 4).room() == 6


def test_entry_bytes_is_the_entry_cost_and_the_average_body():
    assert entry_bytes(0, 0) == ENTRY_COST
    assert entry_bytes(3000, 10) == ENTRY_COST + 300
