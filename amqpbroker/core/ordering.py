"""The order in which a session's transfers are answered.  Pure: slots in, slots out.

AMQP 1.0 lets a receiver settle deliveries in any order, but dispositions name
delivery-ids on the *session* (§2.7.6), and Qpid JMS completes a session's
asynchronous sends (CompletionListener, non-persistent and transacted sends) by
matching the broker's settlements to its sends in send order across the whole session
(shared/notes/qpid-jms-wire.md).  A reject answered at once while an earlier accept of
another link of the same session waits for the store's commit is reported to the
application as the outcome of the earlier send.  So every answer of a session goes out
in the order its transfer arrived: an answer that is ready waits behind the earlier
ones that are not (an accept waiting for its commit, a discharge waiting for its
commit, a relay transfer waiting for room in a `block` queue).

A slot is a list `[item, state, condition, ready, data, owner]`: `item` is what the
answer is for (a delivery), `owner` the link it arrived on, which counts its slots
still waiting in `waiting`.  `cancel` empties an owner's slots when its session or
connection is gone: nothing can be answered on it any more (§2.5.2).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

ITEM, STATE, CONDITION, READY, DATA, OWNER = range(6)


class Owner(Protocol):
    waiting: int   # its slots in the order, not yet taken


class SettlementOrder:
    """One session's answers, in the order the transfers arrived."""

    __slots__ = ("slots", "batched")

    def __init__(self) -> None:
        self.slots: deque[list] = deque()
        # Set by the I/O layer: answers given that the engine may still hold back to
        # batch them (server/producers.py, Producer._answer).
        self.batched = False

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, slot: list) -> None:
        self.slots.append(slot)
        slot[OWNER].waiting += 1

    def take_ready(self) -> list[list]:
        """The slots at the head that are ready, removed, in order (cancelled ones are
        dropped on the way)."""
        out = []
        slots = self.slots
        while slots and slots[0][READY]:
            slot = slots.popleft()
            if slot[ITEM] is not None:
                slot[OWNER].waiting -= 1
                out.append(slot)
        return out

    def cancel(self, owner: Any) -> None:
        """Nothing of `owner`'s will be answered: its slots no longer hold the others."""
        for slot in self.slots:
            if slot[OWNER] is owner:
                slot[ITEM] = None
                slot[READY] = True
        owner.waiting = 0

    def holds(self, owner: Any, item: Any) -> bool:
        return any(slot[OWNER] is owner and slot[ITEM] == item for slot in self.slots)


__all__ = ["CONDITION", "DATA", "ITEM", "OWNER", "READY", "STATE", "Owner", "SettlementOrder"]
