"""Broker settings: a TOML file plus AMQPBROKER_* environment variables
(pydantic-settings).  Precedence: command-line flags > environment > TOML > defaults.

Nested fields use `__` in environment variables, e.g. AMQPBROKER_LIMITS__MAX_MESSAGE_SIZE.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from .core.dn import dn_map
from .core.durations import parse_duration


class StrictModel(BaseModel):
    """The base of every settings section: an unknown key is an error, never
    silently ignored (a misspelt `[[acl]] permisions` must not start a broker that
    grants nothing, or everything).  `load_settings` turns the error into one line
    with a "did you mean" suggestion.  tests/test_config_strict.py checks that every
    model reachable from `Settings` forbids unknown keys, this base or not."""
    model_config = ConfigDict(extra="forbid")


def word_pattern(value: str) -> str:
    """A pattern of `.`-separated words, `*` one word and `#` any number (`[[acl]]`,
    `[anonymous]`, `[[queue_limits]]`).  Refused: an empty one (security/acl.py reads
    it as '#': everything) and a word that mixes `*` or `#` with other characters
    (`telemetry*`, a glob as `[[expiry_policies]]` takes: it matches only a name
    spelt so, and the rule silently applies to nothing)."""
    if not value.strip():
        raise ValueError("a pattern must not be empty ('#' is every address)")
    for word in value.split("."):
        if word not in ("*", "#") and ("*" in word or "#" in word):
            raise ValueError(f"'{value}': `*` and `#` stand for whole words between dots "
                             f"(did you mean '{word.replace('*', '').replace('#', '') or word}.*' or "
                             f"'{word.replace('*', '').replace('#', '') or word}.#'?)")
    return value


def not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


class ClientIdPolicy(str, enum.Enum):
    """WebLogic's client-id policy: `restricted` allows one connection per container-id
    when the client asks for sole-connection-for-container (Qpid JMS turns the refusal
    into InvalidClientIDException)."""
    RESTRICTED = "restricted"
    UNRESTRICTED = "unrestricted"


class TlsConfig(StrictModel):
    host: str = "127.0.0.1"
    port: int = Field(5671, ge=0, le=65535)
    cert_file: Path
    key_file: Path
    allow_anonymous: bool | None = None
    client_id_policy: ClientIdPolicy = ClientIdPolicy.RESTRICTED
    # CA certificates (PEM) client certificates must be signed by.  Set: every client
    # must present one (a TLS handshake without, or from another CA, fails), and SASL
    # EXTERNAL is offered: the certificate names the user (security/certs.py).
    client_ca_file: Path | None = None
    cert_user: Literal["cn", "subject"] = "cn"    # the user: the subject's CN, or the RFC 4514 subject
    # Whole subjects (RFC 4514 DNs, "CN=app1,O=Example") → user name; compared as DNs
    # (security/certs.py), never with a CN.  Checked before cert_user.
    cert_users: dict[str, str] = Field({}, description="subject DN (RFC 4514) -> user; keys must be DNs")
    cert_cn_users: dict[str, str] = Field({}, description="common name -> user, for subjects with one CN; "
                                                          "never compared with a DN")

    @field_validator("cert_users")
    @classmethod
    def _dn_keys(cls, value: dict[str, str]) -> dict[str, str]:
        dn_map(value)     # ValueError names the key that is no DN
        return value


class WebSocketConfig(BaseModel):
    """AMQP over WebSocket (subprotocol `amqp`, the AMQP WebSocket binding): a listener
    for browsers and clients behind HTTP proxies.  With cert_file and key_file: wss."""
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(5673, ge=0, le=65535)
    cert_file: Path | None = None
    key_file: Path | None = None
    allow_anonymous: bool | None = None                 # unset: the top-level setting
    client_id_policy: ClientIdPolicy = ClientIdPolicy.RESTRICTED
    allowed_origins: list[str] = Field([], description=(
        "web pages that may connect (the upgrade's Origin, core/origins.py): origins such as "
        "\"https://app.example.com\", \"same-host\", \"null\" or \"*\"; empty (default): no page, only clients "
        "that send no Origin (not browsers)"))

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        from .core.origins import check_allowed
        return check_allowed(value)

    @model_validator(mode="after")
    def _tls_pair(self) -> "WebSocketConfig":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class UserConfig(StrictModel):
    # A hash from `amqpbroker hash-password` (scram-sha-256$…); plaintext is accepted
    # and hashed at start-up, but a production config should store hashes only.
    # None: the user authenticates with a TLS client certificate only (SASL EXTERNAL).
    password: str | None = None
    groups: list[str] = []


class LimitsConfig(StrictModel):
    max_connections: int = Field(10_000, ge=1)
    max_sessions_per_connection: int = Field(256, ge=1)     # also the advertised channel-max + 1
    max_links_per_connection: int = Field(4096, ge=1)
    max_frame_size: int = Field(65_536, ge=512)              # AMQP 1.0 §2.7.1 minimum is 512
    max_message_size: int = Field(100 * 1024 * 1024, ge=1024)
    idle_timeout: float = Field(60.0, ge=0)                  # seconds; 0 disables
    sasl_timeout: float = Field(30.0, gt=0)                  # seconds from accept to the AMQP open
    # Sockets that have not opened their connection yet (header, SASL, open): in all,
    # and from one source address.  Beyond, new sockets are closed at once.
    max_handshakes: int = Field(1000, ge=1)
    max_handshakes_per_address: int = Field(100, ge=1)
    # Failed authentications from one address (SASL and the management API's basic
    # auth together) before its next attempts wait; the first wait, doubling per
    # failure up to the longest (security/throttle.py).
    auth_free_failures: int = Field(5, ge=0)
    auth_free_failures_per_user: int = Field(20, ge=0, description=(
        "failed authentications for one user name, from all addresses together, before attempts for that "
        "name wait too (security/throttle.py)"))
    auth_base_delay: float = Field(0.2, ge=0)
    auth_max_delay: float = Field(10.0, ge=0)
    link_credit: int = Field(1000, ge=1)                     # most credit a producer is granted at a time
                                                              # (it starts at 64 and grows: core/credit.py)
    # Deliveries a consumer link may hold unsettled; beyond, nothing more is sent on it
    # until it settles some, whatever credit it granted (memory stays bounded).
    max_unsettled_per_link: int = Field(10_000, ge=1)
    # Characters of a JMS selector in an attach (parsing costs ~4 µs a character, on
    # the loop every client shares); longer ones are refused amqp:invalid-field.
    max_selector_length: int = Field(4096, ge=16)
    # (No implicit producer flow control by consumer speed: producers are held back
    # only by explicit queue limits with overflow "block", [[queue_limits]], and by
    # the memory and disk alarms.  docs/operations.md "Queue limits and overflow".)


class PolicyConfig(StrictModel):
    auto_create_queues: bool = True
    # Safe defaults (docs/operations.md "Dead letters"): a message rejected, or handed
    # out 10 times without being settled, goes to the queue DLQ (declared at start).
    max_delivery_attempts: int = Field(10, ge=0)             # 0: unlimited
    dead_letter_address: str | None = "DLQ"                  # "": no dead-lettering (dropped)
    max_consumers_per_subscription: int = Field(0, ge=0)     # 0: unlimited

    @field_validator("dead_letter_address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value and not value.strip():
            raise ValueError('an address of spaces only; "" turns dead-lettering off')
        return value
    # Queues one user's addresses may create (auto_create_queues), anonymous counted
    # as one user; beyond, the attach or message gets resource-limit-exceeded. 0: unlimited
    max_queues_per_user: int = Field(0, ge=0)


class StoreConfig(StrictModel):
    enabled: bool = True                                      # false: nothing survives a restart
    initial_map_size: int = Field(64 << 20, ge=1 << 20)       # bytes; the map doubles as needed
    max_map_size: int = Field(64 << 30, ge=1 << 20)           # bytes; beyond: resource-limit-exceeded
    # Per durable queue: message bodies kept in memory beyond this many bytes are
    # dropped once stored and read back from the store on dispatch (0: no limit).
    queue_memory_budget: int = Field(16 << 20, ge=0)
    memory_budget: int = Field(128 << 20, ge=0, description=(
        "Bytes of queued messages (entries and their bodies) all queues together keep in memory; "
        "beyond it durable queues keep new persistent messages in the store only and read them back "
        "as consumers need them (0: no broker-wide budget). Keep it well below the memory alarm."))
    # Walk every page of the store (in a child process) before opening it, so that a
    # damaged file stops the broker with a clear line instead of a SIGBUS later.
    # Costs about a second per million stored messages at start.
    verify_at_start: bool = True


class AlarmsConfig(BaseModel):
    """Memory and disk alarms (core/alarms.py; docs/operations.md "Alarms"): while one
    is raised, producers get no new credit and consumers keep draining.  Unknown keys
    are refused: a misspelt threshold must not leave the default in force unnoticed."""
    model_config = ConfigDict(extra="forbid")

    # Fraction of the memory available (physical, or the cgroup's limit when lower)
    # the broker's RSS may reach; RabbitMQ's vm_memory_high_watermark default.
    memory_high_watermark: float = Field(0.4, gt=0, le=1)
    # Bytes (or "512MiB", "2GB"); replaces the fraction when set.
    memory_high_watermark_absolute: int | None = Field(None, ge=1)
    # Free bytes the data dir's filesystem must keep (RabbitMQ's default, 50 MB); 0: off.
    disk_free_limit: int = Field(50_000_000, ge=0)
    check_interval: float = Field(1.0, gt=0)                 # seconds between readings

    @field_validator("memory_high_watermark_absolute", "disk_free_limit", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        from .core.alarms import parse_bytes
        return value if value is None else parse_bytes(value)


class HaConfig(BaseModel):
    """`[ha]`: a replicated primary/backup pair fenced by ZooKeeper (docs/ha.md).
    Without this section the broker runs alone and nothing of HA is loaded."""
    model_config = ConfigDict(extra="forbid")

    role: Literal["primary", "backup", "auto"] = "auto"
    zookeeper: str                                            # "host:port[,host:port...]"
    # Seconds: a killed live broker's lock goes this long after ZooKeeper last heard
    # from it, so failover takes about this long (+ ~1 s); a live broker stops
    # accepting 2/3 of it after ZooKeeper's last answer.  Shorter: faster failover,
    # but a live broker on a loaded machine or network fences itself (and clients
    # fail over) more often.  ZooKeeper's tickTime must allow it (docs/ha.md).
    zookeeper_session_timeout: float = Field(3.0, ge=1.0)
    cluster: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$",
                         description="The pair's name (its node under `/amqpbroker` in ZooKeeper). With `[cluster]` "
                                     "(a cluster node that is a pair), unset: `<[cluster] name>.<[cluster] "
                                     "node_id>`.")
    node_id: str | None = None                                # default: made once, kept in the data dir
    # The replication stream between the two brokers: where this one listens for
    # its backup, and the address the backup is told (default: host:port as bound).
    # Two brokers of a pair on one machine need two ports (and two management ports).
    replication_host: str = "127.0.0.1"
    replication_port: int = Field(5691, ge=0, le=65535)
    advertised_replication: str | None = None
    # Both brokers prove knowledge of it before any store data crosses (HMAC).
    secret: str = Field(min_length=16)
    synchronous: bool = True                                  # Accepted only once the backup has it too
    # Seconds a live broker waits for a backup that stopped acknowledging (or went
    # away) before it raises the activation sequence and goes on alone: producers
    # wait this long when the backup dies.  Shorter: a backup that stalls (an fsync,
    # a busy machine) is given up sooner and must catch up again.
    backup_timeout: float = Field(2.0, gt=0)
    catch_up_window: int = Field(
        128 << 20, ge=0,
        description="Bytes of the most recent sealed store batches the live broker keeps in memory, so "
                    "that a backup which comes back gets only the batches it lacks (0: always a full "
                    "copy of the store).")
    replication_tls: bool = Field(
        False, description="TLS on the replication link: the live broker serves replication_cert_file / "
                           "replication_key_file (default: [tls] cert_file / key_file), the backup checks "
                           "it against replication_ca_file (default: that certificate file).")
    replication_cert_file: Path | None = Field(None, description="PEM certificate of the replication listener.")
    replication_key_file: Path | None = Field(None, description="PEM private key of the replication listener.")
    replication_ca_file: Path | None = Field(
        None, description="PEM CA certificates a backup accepts the live broker's replication certificate from.")

    @model_validator(mode="after")
    def _replication_tls_pair(self) -> "HaConfig":
        if (self.replication_cert_file is None) != (self.replication_key_file is None):
            raise ValueError("replication_cert_file and replication_key_file go together")
        return self


class PartitionedDecl(StrictModel):
    """A `[[cluster.partitioned]]` destination: `members` normal destinations
    (`<address>.p0` …), each owned by another node (docs/cluster.md)."""
    address: str = Field(min_length=1, description="the queue, or the topic with `topic = true`")
    members: int = Field(ge=2, le=64, description="how many members (at most the nodes that own slots)")
    topic: bool = Field(False, description="a topic (amq.topic/<address>), not a queue")


class ClusterConfig(StrictModel):
    """`[cluster]`: this broker is a node of a cluster (docs/cluster.md): every queue,
    topic and subscription is owned by one node, and a client of any node reaches them
    all.  With `zookeeper`: one node of a cluster of machines (the slot map and who is
    live kept in ZooKeeper); without it, options of `serve --workers N` (one machine).
    Without this section and without --workers, nothing of the cluster is loaded."""

    zookeeper: str | None = Field(None, description='ZooKeeper ensemble, "host:port[,host:port...]"; '
                                  "None: the options of serve --workers")
    zookeeper_session_timeout: float = Field(10.0, ge=1.0, description="seconds; a dead node's slots are "
                                             "unavailable after about this long")
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$",
                      description="the cluster's name: /amqpbroker-cluster/<name> in ZooKeeper")
    node_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+$",
                                description="this node's name (one of `nodes`); the two brokers of a node that "
                                            "is an HA pair ([ha]) share it, each its own listen_port/advertised")
    nodes: list[str] = Field([], description="every node of the cluster, the same list on each (the slot map "
                             "is made from it when the cluster first starts)")
    weights: dict[str, int] = Field({}, description="slots per node in proportion (default 1; 0: the node "
                                    "owns nothing and only forwards)")
    slots: int = Field(256, ge=1, le=16384, description="slots of the map (fixed once the cluster exists)")
    pinned_exchanges: list[str] = Field([], description="exchanges owned whole by one node (their topics "
                                        "are not spread; wildcard subscriptions allowed)")
    partitioned: list[PartitionedDecl] = Field([], description="partitioned destinations")
    redirect: bool = Field(False, description="answer a client's open with amqp:connection:redirect to the "
                           "node that owns its client-id (for failover: clients), never mid-connection")
    handoff: bool = Field(True, description="serve --workers: a plain (not TLS, not WebSocket) client "
                          "connection whose first link's address another worker owns is handed, socket and "
                          "all, to that worker, and those of a partitioned destination are dealt over its "
                          "members' workers (docs/cluster.md); false: their links are forwarded there")
    listen_host: str = Field("127.0.0.1", description="where this node listens for the other nodes")
    listen_port: int = Field(5680, ge=0, le=65535, description="0: a free port")
    advertised: str | None = Field(None, description='"host:port" the other nodes connect to '
                                   "(default: listen_host:port as bound)")
    advertised_amqp: str | None = Field(None, description='"host:port" clients are told to reach this node at '
                                        "(placement redirects, the Spark source); default: the AMQP listener's")
    secret: str | None = Field(None, min_length=16, description="every node proves it (HMAC) before any "
                               "AMQP frame (with zookeeper; the workers of one machine make their own)")
    tls: bool = Field(False, description="inter-node connections in TLS, verified both ways: each node presents "
                      "tls_cert_file and checks the other's against tls_ca_file (with zookeeper)")
    tls_cert_file: Path | None = Field(None, description="this node's certificate (PEM; default: [tls] cert_file)")
    tls_key_file: Path | None = Field(None, description="its private key (default: [tls] key_file)")
    tls_ca_file: Path | None = Field(None, description="CA certificates the nodes' certificates are signed by "
                                     "(default: [tls] client_ca_file)")
    tls_verify_hostname: bool = Field(True, description="a node's certificate must name the host it is reached "
                                      "at (its advertised address)")

    @model_validator(mode="after")
    def _member(self) -> "ClusterConfig":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.zookeeper is None:
            if self.node_id or self.nodes or self.weights or self.secret:
                raise ValueError("node_id, nodes, weights and secret go with zookeeper (a cluster of machines)")
            if self.tls or self.tls_cert_file or self.tls_ca_file:
                raise ValueError("tls goes with zookeeper (the workers of one machine speak over Unix sockets)")
            return self
        if self.node_id is None or self.secret is None or not self.nodes:
            raise ValueError("with zookeeper, node_id, nodes and secret are needed")
        if self.node_id not in self.nodes:
            raise ValueError(f"node_id '{self.node_id}' is not one of nodes {self.nodes}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes must not repeat a name")
        unknown = set(self.weights) - set(self.nodes)
        if unknown:
            raise ValueError(f"weights name nodes that are not in nodes: {sorted(unknown)}")
        owning = sum(1 for n in self.nodes if self.weights.get(n, 1))
        if not owning:
            raise ValueError("at least one node must own slots (every weight is 0)")
        too_many = [p.address for p in self.partitioned if p.members > owning]
        if too_many:
            raise ValueError(f"partitioned {too_many}: more members than nodes that own slots ({owning})")
        return self


class ExchangeDecl(StrictModel):
    name: str
    type: Literal["direct", "topic", "fanout"] = "topic"
    durable: bool = True

    _name = field_validator("name")(lambda cls, v: not_blank(v))


_OVERFLOW = Literal["block", "reject", "drop-head"]


class _LimitFields(StrictModel):
    """Queue limits (core/limits.py): 0 is no limit; `overflow` says what a message
    meets when the queue is full (docs/operations.md "Queue limits and overflow")."""
    max_depth: int = Field(0, ge=0)                           # messages held
    max_bytes: int = Field(0, ge=0)                           # bytes of bodies held ("64MiB")
    overflow: _OVERFLOW = "block"

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        from .core.alarms import parse_bytes
        return parse_bytes(value)

    def queue_limits(self) -> Any:
        from .core.limits import Overflow, QueueLimits
        return QueueLimits(self.max_depth, self.max_bytes, Overflow(self.overflow))


class QueueLimitDecl(_LimitFields):
    """A [[queue_limits]] entry: limits for every queue whose name matches `pattern`
    (`.`-separated words, `*` one word, `#` any number, as [[acl]] patterns); the
    first match wins.  Unknown keys are refused (a misspelt limit must not vanish)."""
    model_config = ConfigDict(extra="forbid")
    pattern: str

    _pattern = field_validator("pattern")(lambda cls, v: word_pattern(v))


class QueueDecl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    durable: bool = True
    # None: the policy's; 0: unlimited; never negative (ActiveMQ Artemis's -1, "unlimited", dead-lettered
    # at the first failure here).
    max_delivery_attempts: int | None = Field(None, ge=0)

    _name = field_validator("name")(lambda cls, v: not_blank(v))
    # Limits declared with the queue (override any [[queue_limits]] pattern); None: the pattern's.
    max_depth: int | None = Field(None, ge=0)
    max_bytes: int | None = Field(None, ge=0)
    overflow: _OVERFLOW | None = None

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        from .core.alarms import parse_bytes
        return value if value is None else parse_bytes(value)

    def queue_limits(self) -> Any:
        """The declared limits, or None when none of the three is set."""
        if self.max_depth is None and self.max_bytes is None and self.overflow is None:
            return None
        from .core.limits import Overflow, QueueLimits
        return QueueLimits(self.max_depth or 0, self.max_bytes or 0, Overflow(self.overflow or "block"))


class BindingDecl(StrictModel):
    exchange: str
    queue: str
    key: str = ""

    _names = field_validator("exchange", "queue")(lambda cls, v: not_blank(v))


class ManagementConfig(StrictModel):
    """The management listener: REST API, console, /metrics (docs/operations.md)."""
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8161, ge=0, le=65535)                  # 0: a free port, logged
    cert_file: Path | None = None                            # both set: HTTPS
    key_file: Path | None = None
    # Host names the listener answers to besides IP addresses and localhost (and `host`
    # when it is a name): a DNS name of the broker, a reverse proxy's.  Any other Host
    # header is refused 421 (DNS rebinding: management/request_policy.py).
    allowed_hosts: list[str] = []
    # /metrics carries per-queue series for at most this many queues (the deepest) and
    # as many subscriptions; /metrics/per-object carries all of them.
    metrics_queue_limit: int = Field(1000, ge=0)
    allow_anonymous: bool = Field(False, description=(
        "with ACLs: a request without credentials acts as the anonymous identity (what [anonymous] grants, "
        "`manage` included); false (default): every request authenticates, whatever [anonymous] grants"))

    @model_validator(mode="after")
    def _tls_pair(self) -> "ManagementConfig":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class ExpiryPolicyDecl(StrictModel):
    pattern: str
    idle: float | None = None                                # seconds, or text like "7d"
    max_backlog: int | None = Field(None, ge=0)
    action: Literal["report", "delete"] = "report"
    match: Literal["any", "all"] = "any"

    @field_validator("idle", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return None if value is None else parse_duration(value)

    @model_validator(mode="after")
    def _some_condition(self) -> "ExpiryPolicyDecl":
        if self.idle is None and self.max_backlog is None:
            raise ValueError("an expiry policy needs idle and/or max_backlog")
        return self


_PERMISSION = Literal["send", "consume", "browse", "manage", "all"]


class AclRuleDecl(StrictModel):
    user: str | None = None
    group: str | None = None
    pattern: str = "#"
    permissions: list[_PERMISSION]

    _pattern = field_validator("pattern")(lambda cls, v: word_pattern(v))

    @model_validator(mode="after")
    def _one_principal(self) -> "AclRuleDecl":
        if (self.user is None) == (self.group is None):
            raise ValueError("an [[acl]] rule names exactly one of user or group")
        return self


class AnonymousDecl(StrictModel):
    permissions: list[_PERMISSION] = []
    pattern: str = "#"

    _pattern = field_validator("pattern")(lambda cls, v: word_pattern(v))


class DuplicateDetectionDecl(StrictModel):
    pattern: str                                              # fnmatch glob on the address
    window: int = Field(100_000, ge=1)                        # ids remembered per address


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AMQPBROKER_", env_nested_delimiter="__",
                                      extra="forbid")

    container_id: str = "amqpbroker"
    host: str = "127.0.0.1"
    port: int = Field(5672, ge=0, le=65535)
    # None: ANONYMOUS only on loopback listeners (AMQP clients on this machine).
    allow_anonymous: bool | None = None
    # None: SASL PLAIN (the password in clear) only on TLS and loopback listeners;
    # true offers it on a plain TCP listener on the network too.
    allow_insecure_plain: bool | None = None
    client_id_policy: ClientIdPolicy = ClientIdPolicy.RESTRICTED
    tls: TlsConfig | None = None
    websocket: WebSocketConfig | None = None                 # AMQP over WebSocket listener
    data_dir: Path = Path("data")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    users: dict[str, UserConfig] = {}
    limits: LimitsConfig = LimitsConfig()
    policy: PolicyConfig = PolicyConfig()
    store: StoreConfig = StoreConfig()
    alarms: AlarmsConfig = AlarmsConfig()
    exchanges: list[ExchangeDecl] = []
    queues: list[QueueDecl] = []
    queue_limits: list[QueueLimitDecl] = []                  # limits and overflow by queue-name pattern
    bindings: list[BindingDecl] = []
    duplicate_detection: list[DuplicateDetectionDecl] = []
    management: ManagementConfig = ManagementConfig()
    expiry_policies: list[ExpiryPolicyDecl] = []
    expiry_interval: float = Field(60.0, gt=0)               # seconds between policy runs
    acl: list[AclRuleDecl] = []
    anonymous: AnonymousDecl | None = None                   # permissions of the anonymous user
    ha: HaConfig | None = None                               # a replicated pair (docs/ha.md); None: alone
    cluster: ClusterConfig | None = None                     # one node of a cluster (docs/cluster.md)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("cluster")
    @classmethod
    def _partitioned(cls, cluster: "ClusterConfig | None", info: ValidationInfo) -> "ClusterConfig | None":
        """`[[cluster.partitioned]]` read against the exchanges configured above it: each
        must mean one destination (core/placement.py `partitioned_keys`)."""
        if cluster is not None and cluster.partitioned:
            from .core.broker import BUILTIN_EXCHANGES
            from .core.placement import partitioned_keys
            exchanges = {name: kind.value for name, kind in BUILTIN_EXCHANGES}
            exchanges.update({e.name: e.type for e in info.data.get("exchanges", [])})
            partitioned_keys(((p.address, p.topic, p.members) for p in cluster.partitioned),
                             exchanges=exchanges, pinned=frozenset(cluster.pinned_exchanges))
        return cluster

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml = _CONFIG_FILE.get("path")
        parsed = _CONFIG_FILE.get("parsed")
        if parsed is not None:      # the file's text, read once by the caller (live reload)
            sources.append(InitSettingsSource(settings_cls, parsed))
        elif toml is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml))
        return tuple(sources)


_CONFIG_FILE: dict[str, Any] = {"path": None, "parsed": None}


class ConfigError(Exception):
    """A configuration problem, with one line a person can act on per problem
    (`problems`); str() joins them on one line (a log line, an API answer)."""

    def __init__(self, *problems: str):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


def load_settings(config_file: Path | None = None, *, text: str | None = None, **overrides: Any) -> Settings:
    """Load settings; raise ConfigError naming each offending field (an unknown key
    with the nearest known one: config_help.py).  `text`: the file's content as
    already read (a live reload validates exactly what it read)."""
    if text is None and config_file is not None and not Path(config_file).is_file():
        raise ConfigError(f"config file {config_file} does not exist")
    _CONFIG_FILE["path"] = Path(config_file) if config_file else None
    try:
        if text is not None:
            _CONFIG_FILE["parsed"] = tomllib.loads(text)
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        from .config_help import problem_lines
        raise ConfigError(*problem_lines(Settings, exc.errors(), os.environ)) from None
    except (ValueError, OSError) as exc:  # TOML syntax errors
        raise ConfigError(f"cannot read config {config_file}: {exc}") from None
    finally:
        _CONFIG_FILE["path"] = None
        _CONFIG_FILE["parsed"] = None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def anonymous_allowed(setting: bool | None, host: str) -> bool:
    return is_loopback(host) if setting is None else setting


def plain_allowed(setting: bool | None, host: str, tls: bool) -> bool:
    """SASL PLAIN sends the password itself: by default only where nobody else can
    read it (a TLS listener, or loopback)."""
    if setting is not None:
        return setting or tls
    return tls or is_loopback(host)
