"""What the management room needs from the running broker: one narrow, structural port.

Management depends on the core model (Broker, SubscriptionRegistry, Queue), on
security (AccessGuard, UserStore) and on config, never on server/.  Everything else
it reads or calls on the running broker is listed here as typing Protocols;
`BrokerServer` (server/app.py) satisfies them by its attribute names alone, without
importing or naming them (tests/management/test_structure.py checks both: no import of
amqpbroker.server under amqpbroker/management, and `isinstance(BrokerServer(...),
ManagedBroker)`).

Members are read-only properties: management reads these attributes and never
rebinds them (it does change what they refer to, through their own methods).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Collection, Mapping, Protocol, Sequence, Sized, runtime_checkable

from ..config import Settings
from ..core.alarms import Alarms
from ..core.broker import Broker
from ..core.registry import SubscriptionRegistry
from ..security.guard import AccessGuard


class ListenerInfo(Protocol):
    """The AMQP listener a connection came in on."""

    @property
    def name(self) -> str: ...            # "amqp" | "amqps" | "ws" | "wss"

    @property
    def ssl_context(self) -> Any: ...     # None without TLS


class ConnectionSocket(Protocol):
    """The socket side of an AMQP connection (server/engine.py AmqpProtocol)."""

    @property
    def peer(self) -> str: ...            # "host:port"

    @property
    def user(self) -> str | None: ...     # the authenticated user, "anonymous", or None

    @property
    def listener(self) -> ListenerInfo: ...

    def mark_dirty(self) -> None: ...     # output is waiting: flush it this loop turn

    def abort(self) -> None: ...          # drop the socket now


class ManagedConnection(Protocol):
    """An open AMQP connection (server/handlers.py ConnectionHandler), as listed and
    closed by the API.  `conn` is the proton Connection: management sets its
    `condition` and calls `close()` (amqp:connection:forced)."""

    @property
    def container_id(self) -> str: ...

    @property
    def protocol(self) -> ConnectionSocket: ...

    @property
    def conn(self) -> Any: ...

    @property
    def sessions(self) -> int: ...

    @property
    def links(self) -> int: ...

    @property
    def consumers(self) -> Sized: ...

    @property
    def ended(self) -> bool: ...

    def link_ended(self, link: Any) -> None: ...   # a consumer link the admin closed: release it


class ManagedStore(Protocol):
    """The store as management uses it.  Statistics (`commits`, `last_batch_ops`,
    `degraded`, `failed_batches`, `pending_batches`, `outbox_bytes`, `commit_stats`)
    exist on the persistent store only and are read with getattr."""

    @property
    def persistent(self) -> bool: ...

    def save_exchange(self, name: str, kind: str) -> None: ...

    def delete_exchange(self, name: str) -> None: ...

    def after_commit(self, callback: Callable[[BaseException | None], None]) -> None: ...


class UserDirectory(Protocol):
    def verify_plain(self, user: str, password: str) -> bool: ...


@runtime_checkable
class ManagedBroker(Protocol):
    """The running broker, as the management API, metrics and expiry policy see it."""

    @property
    def settings(self) -> Settings: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def broker(self) -> Broker: ...                          # the core model

    @property
    def subscriptions(self) -> SubscriptionRegistry: ...

    @property
    def store(self) -> ManagedStore: ...

    @property
    def access(self) -> AccessGuard: ...                     # [[acl]] policy, users' groups, denials

    @property
    def users(self) -> UserDirectory: ...                    # HTTP basic checks the broker's users

    @property
    def handlers_by_container(self) -> Mapping[str, Sequence[ManagedConnection]]: ...

    @property
    def protocols(self) -> Collection[Any]: ...              # live sockets (is one still open?)

    @property
    def alarms(self) -> Alarms: ...                          # memory and disk alarms; PUT /api/alarms

    @property
    def flow(self) -> Any: ...                               # producers held (server/flow.py FlowGate: held, held_total)

    @property
    def metrics_refused(self) -> Mapping[str, int]: ...      # refused attaches by condition

    @property
    def metrics_auth_failures(self) -> int: ...              # failed SASL authentications

    @property
    def ha(self) -> Any: ...                                 # the HA pair's node (describe()), None alone

    @property
    def cluster(self) -> Any: ...                            # the cluster's router (describe()), None alone

    def forget_link(self, handler: Any, link: Any) -> None: ...   # a link the admin detached

    async def reload_config(self, who: str, allow_open: bool = False) -> dict: ...   # live reload; ValueError: nothing changed


# ---------------------------------------------------------------- the operations, as the HTTP side sees them
# service.py `Operations` builds the authenticator, the metrics and the API: the
# modules it builds name it through these ports, never by importing it
# (tests/test_layering.py).  Members named `Any` are management's own lower parts
# (admin.Admin, messages.MessageOps, auth.Authenticator, metrics.Metrics).


class AuthOperations(Protocol):
    """What auth.py (`Principal`, `Authenticator`) uses of the operations."""

    managed: ManagedBroker
    settings: Settings
    auth_throttle: Any             # security/throttle.py: failed attempts, per address and user
    http_auth_failures: int        # counted here, shown in /metrics


class MetricsOperations(Protocol):
    """What metrics.py (`Metrics`) reads of the operations."""

    managed: ManagedBroker
    settings: Settings
    admin: Any
    auth_throttle: Any
    expiry_actions: dict[str, int]   # expiry policy actions taken, by action

    @property
    def auth_failures(self) -> int: ...   # SASL and HTTP together

    def clock(self) -> float: ...

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any: ...


class MessageOperations(Protocol):
    """What message_api.py (the message routes) uses of the operations."""

    messages: Any

    async def reload(self, who: str, allow_open: bool = False) -> dict: ...


class ApiOperations(MessageOperations, Protocol):
    """What api.py (`build_app`) uses of the operations (and hands to the message routes)."""

    settings: Settings
    admin: Any
    authenticator: Any
    metrics: Any

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any: ...


__all__ = ["ApiOperations", "AuthOperations", "ConnectionSocket", "ListenerInfo", "ManagedBroker",
           "ManagedConnection", "ManagedStore", "MessageOperations", "MetricsOperations", "UserDirectory"]
