"""Helpers for measuring the management API at scale against a real broker
(tests/e2e/test_management_scale.py, bench/management_scale.py):

* `populate(url, names)`: one message to each address through the anonymous relay, so
  the broker auto-creates one queue per name (one connection, as fast as credit allows).

The canary that measures AMQP round trips meanwhile is tests/e2e/canary.py.
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence


# ---------------------------------------------------------------------- populate

def populate(url: str, names: Sequence[str], timeout: float = 120.0, body: str = "x") -> None:
    """Send one non-durable message to each name (anonymous relay: `to` = the name) and
    wait until the broker has accepted all of them.  Raises on a refusal or timeout."""
    from proton import Message
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Populate(MessagingHandler):
        def __init__(self) -> None:
            super().__init__(prefetch=0, auto_settle=True)
            self.sent = 0
            self.accepted = 0
            self.error: str | None = None
            self.conn: Any = None
            self.timer: Any = None

        def on_start(self, event: Any) -> None:
            self.conn = event.container.connect(url, sasl_enabled=True, allowed_mechs="ANONYMOUS")
            event.container.create_sender(self.conn, None, name=f"populate-{uuid.uuid4().hex[:8]}")
            self.timer = event.container.schedule(timeout, self)

        def on_sendable(self, event: Any) -> None:
            snd = event.sender
            while snd.credit and self.sent < len(names):
                snd.send(Message(address=names[self.sent], body=body, durable=False))
                self.sent += 1

        def on_accepted(self, event: Any) -> None:
            self.accepted += 1
            if self.accepted == len(names):
                self._done()

        def on_rejected(self, event: Any) -> None:
            self.error = f"message {self.accepted} rejected: {event.delivery.remote.condition}"
            self._done()

        def on_timer_task(self, event: Any) -> None:
            self.error = f"timed out: {self.accepted} of {len(names)} accepted"
            self.conn.close()

        def on_transport_error(self, event: Any) -> None:
            self.error = f"transport error: {event.transport.condition}"

        def _done(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
            self.conn.close()

    handler = Populate()
    Container(handler).run()
    if handler.error is not None or handler.accepted != len(names):
        raise RuntimeError(f"populate: {handler.error or f'{handler.accepted} of {len(names)} accepted'}")
