"""The broker-wide memory budget for queued messages (pure decisions, no I/O).

Every queue charges what it holds in memory to one `MemoryBudget`: `ENTRY_COST`
bytes for each entry (the index object, its place in a ready list) and the size of
each body it has loaded.  A fan-out shares one body between its entries, and each
entry is charged for it: the budget over-counts shared bodies, so it pages early,
never late.

What the budget decides (the table in tests/core/test_budget.py):

* `pages_new`: whether a new persistent entry of a durable queue goes to the store
  only (its paged region, core/paging.py) rather than into memory: while the queue
  already pages (entries must stay in order), over its own budget, or while the
  broker's budget is used up.
* `page_in_count` / `page_in_low`: how many stored entries a page-in takes, and below
  how many ready entries it runs: what the queue's consumers may take now (their
  credit; twice that is read), within what fits in the room left, never fewer than
  MIN_PAGE_IN (a queue whose consumers wait always makes progress), never more than
  the queue's own batch.  With 10,000 subscriptions re-attached at once, memory
  follows what their consumers ask for instead of 10,000 × the batch.
* `body_room`: how many bytes of bodies a page-in may read at once.

The memory alarm (core/alarms.py) stays the last resort: the budget keeps the
normal path below it, and producers are held only when the whole process grows.
"""

from __future__ import annotations

ENTRY_COST = 160          # bytes an entry held in memory costs beyond its body (measured: Entry + slot)
MIN_PAGE_IN = 16          # entries a page-in takes even with the budget used up
UNLIMITED = 1 << 62


class MemoryBudget:
    """Bytes of entries and bodies held in memory by every queue of the broker;
    `limit` 0 is no limit (nothing is paged for the broker's sake)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int = 0):
        self.limit = limit
        self.used = 0

    @property
    def over(self) -> bool:
        return 0 < self.limit < self.used

    def room(self) -> int:
        """Bytes that may still come into memory (UNLIMITED without a limit)."""
        if not self.limit:
            return UNLIMITED
        return max(0, self.limit - self.used)


def pages_new(paging: bool, queue_budget: int, queue_bytes: int, budget: MemoryBudget | None) -> bool:
    """A new persistent entry of a durable queue that can page (`queue_budget` > 0):
    whether it goes to the store only.  `paging`: the queue has a paged region
    already (what comes after must stay behind it); `queue_bytes`: the bodies it holds
    in memory, this one included."""
    if not queue_budget:
        return False
    return paging or queue_bytes > queue_budget or (budget is not None and budget.over)


def page_in_count(batch: int, room: int, entry_bytes: int, demand: int | None = None) -> int:
    """Entries a page-in takes under a broker budget: twice what the queue's
    consumers may take now (`demand`: their credit), within [MIN_PAGE_IN, batch] and
    what `room` bytes hold at `entry_bytes` each (never fewer than MIN_PAGE_IN).
    Without a budget (room UNLIMITED): the queue's batch."""
    if room >= UNLIMITED:
        return batch
    want = batch if demand is None else max(MIN_PAGE_IN, min(batch, 2 * demand))
    return max(min(batch, MIN_PAGE_IN), min(want, room // max(1, entry_bytes)))


def page_in_low(low: int, room: int, entry_bytes: int, demand: int | None = None) -> int:
    """Below how many ready entries a queue with a paged region pages in: under a
    broker budget, what its consumers may take now, within [MIN_PAGE_IN, low] and
    what the room holds (0 while they may take nothing: a consumer attaching
    without credit reads nothing yet); without one, its own low-water mark."""
    if room >= UNLIMITED:
        return low
    if demand == 0:
        return 0
    want = low if demand is None else max(MIN_PAGE_IN, min(low, demand))
    return max(min(low, MIN_PAGE_IN), min(want, room // max(1, entry_bytes)))


def body_room(queue_room: int, budget: MemoryBudget | None) -> int:
    """Bytes of bodies a page-in may read now: the least of the queue's room and the
    broker's."""
    if budget is None:
        return queue_room
    return min(queue_room, budget.room())


def entry_bytes(paged_bytes: int, paged_count: int) -> int:
    """What one paged-in entry is expected to cost: ENTRY_COST and the average body
    of the paged region."""
    return ENTRY_COST + (paged_bytes // paged_count if paged_count else 0)
