"""Access control on the AMQP side: the AMQP rules around the pure `acl.AclPolicy`.

* a consumer attach (the broker's sending link) needs `consume` on the source
  address — `browse` for a distribution-mode `copy` source on a queue; a
  null-source attach (Qpid JMS's unsubscribe / re-subscribe lookup) is checked
  against the stored subscription's topic address;
* a producer attach needs `send` on the target address; an anonymous-relay link
  (no target address) is checked per message against its `to`
  (`relay_denied`), and a denied message is rejected;
* dynamic (temporary) nodes and transaction coordinators are always allowed.

The guard reads the broker model (core) it is given and plain terminus terms
(core/terms.py); it returns a refusal's description and the server answers it
(`amqp:unauthorized-access`, a null terminus and a detach carrying the error).
With no ACL configured every check returns at once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..core.addresses import AddressKind, AddressNotFound
from ..core.subscriptions import SubscriptionKey, identity
from ..core.terms import SourceTerms, TargetTerms
from .acl import BROWSE, CONSUME, SEND, AclPolicy

if TYPE_CHECKING:
    from ..config import Settings
    from ..core.broker import Broker
    from ..core.registry import SubscriptionRegistry

log = logging.getLogger("amqpbroker.acl")

UNAUTHORIZED = "amqp:unauthorized-access"


class AccessGuard:
    def __init__(self, settings: "Settings", broker: "Broker", subscriptions: "SubscriptionRegistry"):
        self.broker = broker
        self.subscriptions = subscriptions
        self.policy = policy_from(settings)
        self.enabled = self.policy.enabled
        self.groups = groups_from(settings)
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

    def consumer_refusal(self, user: str | None, source: SourceTerms, link_name: str,
                         container_id: str) -> str | None:
        """A consumer attach (the broker's sending link): None when allowed."""
        if not self.enabled:
            return None
        need = self.consumer_requirement(source, link_name, container_id)
        return None if need is None else self.check(user, *need)

    def producer_refusal(self, user: str | None, target: TargetTerms) -> str | None:
        """A producer attach (the broker's receiving link): None when allowed."""
        if not self.enabled:
            return None
        need = self.producer_requirement(target)
        return None if need is None else self.check(user, *need)

    def consumer_requirement(self, source: SourceTerms, link_name: str,
                             container_id: str) -> tuple[str, str] | None:
        """(action, address) a consumer link needs, or None when no permission
        applies (a dynamic node; a null source with no stored subscription, which
        the attach answers amqp:not-found).  Also what a live reload checks again."""
        if source.dynamic:
            return None
        if source.is_null:
            address = self._subscription_topic(link_name, container_id)
            return None if address is None else (CONSUME, address)
        action = BROWSE if source.distribution_mode == "copy" and self._is_queue(source) else CONSUME
        return (action, source.address or "")

    @staticmethod
    def producer_requirement(target: TargetTerms) -> tuple[str, str] | None:
        """(action, address) a producer link needs; None for coordinators, dynamic
        nodes and anonymous relays (those are checked per message)."""
        if target.coordinator or target.dynamic or not target.address:
            return None
        return (SEND, target.address)

    def reconfigure(self, policy: AclPolicy, groups: dict[str, frozenset[str]]) -> None:
        """A live reload's new rules and users' groups (links already attached are
        checked again by the server: security/reload.py decides which lose theirs)."""
        self.policy = policy
        self.enabled = policy.enabled
        self.groups = groups

    def _is_queue(self, source: SourceTerms) -> bool:
        try:
            kind = self.broker.resolve(source.address or "", topic=source.has("topic")).kind
        except AddressNotFound:
            return False
        return kind in (AddressKind.QUEUE, AddressKind.NEW_QUEUE)

    def _subscription_topic(self, link_name: str, container_id: str) -> str | None:
        namespace, name, _, _ = identity(link_name, container_id, None)
        sub = self.subscriptions.subscriptions.get(SubscriptionKey(namespace, name, True))
        return None if sub is None else subscription_address(sub)

    def replace_refusal(self, user: str | None, sub: Any) -> str | None:
        """Recreating an existing subscription (another topic, selector or no-local:
        its backlog is dropped) needs `consume` on the address it is bound to *now*,
        not only on the new one: otherwise anyone allowed some topic could take over
        another application's durable subscription by name.  (Unsubscribing goes
        through the null-source attach, checked against the same address.)"""
        if not self.enabled:
            return None
        return self.check(user, CONSUME, subscription_address(sub))

    # ------------------------------------------------------------------ anonymous relay

    def relay_denied(self, user: str | None, msg: Any) -> str | None:
        """For a message on an anonymous-relay link: None if its `to` may be sent to."""
        if not self.enabled:
            return None
        to = msg.prop("to")
        if not to:
            return None
        return self.check(user, SEND, str(to))


def policy_from(settings: "Settings") -> AclPolicy:
    """The ACL policy a configuration describes (ValueError on a bad permission)."""
    return AclPolicy.from_config([r.model_dump() for r in settings.acl],
                                 settings.anonymous.model_dump() if settings.anonymous else None)


def groups_from(settings: "Settings") -> dict[str, frozenset[str]]:
    return {name: frozenset(u.groups) for name, u in settings.users.items()}


def subscription_address(sub: Any) -> str:
    """The address a subscription consumes from, as its attach named it."""
    b = sub.binding
    return sub.source.address or (f"{b.exchange}/{b.key}" if b.key else b.exchange)
