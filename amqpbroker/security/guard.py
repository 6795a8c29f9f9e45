"""Access control on the AMQP side: the I/O glue around the pure `acl.AclPolicy`.

* a consumer attach (the broker's sending link) needs `consume` on the source
  address — `browse` for a distribution-mode `copy` source on a queue; a
  null-source attach (Qpid JMS's unsubscribe / re-subscribe lookup) is checked
  against the stored subscription's topic address;
* a producer attach needs `send` on the target address; an anonymous-relay link
  (no target address) is checked per message against its `to`
  (`relay_denied`), and a denied message is rejected;
* dynamic (temporary) nodes and transaction coordinators are always allowed.

A refusal raises `AttachRefused("amqp:unauthorized-access", …)`, which the handler
answers with a null terminus and a detach carrying the error.  With no ACL
configured every check returns at once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .acl import BROWSE, CONSUME, SEND, AclPolicy

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger("amqpbroker.acl")

UNAUTHORIZED = "amqp:unauthorized-access"


class AccessGuard:
    def __init__(self, settings: "Settings"):
        self.policy = AclPolicy.from_config([r.model_dump() for r in settings.acl],
                                            settings.anonymous.model_dump() if settings.anonymous else None)
        self.enabled = self.policy.enabled
        self.groups = {name: frozenset(u.groups) for name, u in settings.users.items()}
        self.denied: dict[str, int] = {}      # action → count (metrics)

    def groups_of(self, user: str | None) -> frozenset[str]:
        return self.groups.get(user or "", frozenset())

    def _deny(self, action: str, description: str) -> None:
        self.denied[action] = self.denied.get(action, 0) + 1
        log.warning("access denied: %s", description)

    def check(self, user: str | None, action: str, address: str) -> str | None:
        """None when allowed, else a description of the refusal (logged, counted)."""
        if not self.enabled:
            return None
        if self.policy.allows(user, self.groups_of(user), action, address):
            return None
        who = "anonymous" if AclPolicy.is_anonymous(user) else f"user '{user}'"
        description = f"{who} is not allowed to {action} on '{address}'"
        self._deny(action, description)
        return description

    # ------------------------------------------------------------------ attach

    def check_attach(self, handler: Any, link: Any) -> None:
        """Raise AttachRefused(amqp:unauthorized-access) when the link is not allowed."""
        if not self.enabled:
            return
        from ..server.attach import AttachRefused
        from ..server.terminus import read_source, read_target

        user = handler.protocol.user
        if link.is_sender:
            source = read_source(link.remote_source)
            if source.dynamic:
                return
            if source.is_null:
                address = self._subscription_topic(handler, link)
                action = CONSUME
            else:
                address = source.address or ""
                action = BROWSE if (source.distribution_mode == "copy"
                                    and self._is_queue(handler, address, source)) else CONSUME
            if address is None:
                return          # nothing to look up: the attach is answered amqp:not-found
        else:
            target = read_target(link.remote_target)
            if target.coordinator or target.dynamic or not target.address:
                return          # anonymous relay: checked per message
            address, action = target.address, SEND
        refusal = self.check(user, action, address)
        if refusal is not None:
            raise AttachRefused(UNAUTHORIZED, refusal)

    @staticmethod
    def _is_queue(handler: Any, address: str, source: Any) -> bool:
        from ..core.addresses import AddressKind, AddressNotFound
        try:
            kind = handler.broker.resolve(address, topic=source.has("topic")).kind
        except AddressNotFound:
            return False
        return kind in (AddressKind.QUEUE, AddressKind.NEW_QUEUE)

    @staticmethod
    def _subscription_topic(handler: Any, link: Any) -> str | None:
        from ..core.subscriptions import SubscriptionKey, identity
        namespace, name, _, _ = identity(link.name, handler.container_id, None)
        sub = handler.server.subscriptions.subscriptions.get(SubscriptionKey(namespace, name, True))
        if sub is None:
            return None
        b = sub.binding
        return sub.source.address or (f"{b.exchange}/{b.key}" if b.key else b.exchange)

    # ------------------------------------------------------------------ anonymous relay

    def relay_denied(self, handler: Any, msg: Any) -> str | None:
        """For a message on an anonymous-relay link: None if its `to` may be sent to."""
        if not self.enabled:
            return None
        to = msg.prop("to")
        if not to:
            return None
        return self.check(handler.protocol.user, SEND, str(to))
