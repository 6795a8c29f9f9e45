"""The policies a queue is declared with: who may consume from it (exclusivity) and
how long it lives (lifetime), as Qpid Broker-J names them for subscription queues."""

from __future__ import annotations

import enum


class ExclusivityPolicy(str, enum.Enum):
    NONE = "none"                      # any number of consumers (plain queues)
    LINK = "link"                      # one consumer link at a time
    SHARED_SUBSCRIPTION = "shared-subscription"


class LifetimePolicy(str, enum.Enum):
    """From the source expiry policy (AMQP 1.0 §3.5.6), as in the seed table."""
    PERMANENT = "permanent"                          # expiry-policy never
    DELETE_ON_NO_LINKS = "delete-on-no-links"        # link-detach
    DELETE_ON_SESSION_END = "delete-on-session-end"  # session-end
    DELETE_ON_CONNECTION_CLOSE = "delete-on-connection-close"  # connection-close
