"""A sending link's bound on what the protocol engine holds of it unsent: the thin
I/O part of core/outbound.py, shared by LinkConsumer (server/links.py) and RangeReader
(server/sequence.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cproton import lib

from ..core import outbound

if TYPE_CHECKING:
    from .ports import LinkOwner

DELIVERY_COST = outbound.DELIVERY_COST


class BoundedOutput:
    """A sending link's bound on what the engine holds of it unsent (core/outbound.py):
    a peer whose session window stays closed gets no more than the bounds, whatever
    link credit it grants.  A link spends `_budget` as it sends; spent, it looks at the
    engine's counters again, and at a bound waits on its connection's output: the next
    flush that writes anything calls `output_moved` (from the loop)."""

    __slots__ = ()
    handler: "LinkOwner"
    impl: Any
    _session: Any
    _budget: int
    _waiting_output: bool

    def engine_room(self) -> bool:
        """Whether the link may hand the engine more now (it spent its budget)."""
        if self._waiting_output:
            return False
        budget = outbound.budget(lib.pn_link_queued(self.impl), lib.pn_session_outgoing_bytes(self._session))
        if budget <= 0:
            self._waiting_output = True
            self.handler.protocol.output_waiters.append(self)
            return False
        self._budget = budget
        return True

    def output_moved(self) -> None:
        self._waiting_output = False


__all__ = ["DELIVERY_COST", "BoundedOutput"]
