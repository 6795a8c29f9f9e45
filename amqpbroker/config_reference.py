"""docs/configuration.md, generated from the settings models (config.py):
every key with its type, default, environment variable, whether a live reload
applies it, and what it does.

    amqpbroker config reference --output docs/configuration.md    # write it
    amqpbroker config reference --check docs/configuration.md     # exit 1 when stale

A key's text is its `Field(description=...)`; keys declared before descriptions
were the rule have theirs in KEY_DOCS below.  tests/test_config_reference.py
fails when a key has neither, or when the committed file differs from what this
module writes.
"""

from __future__ import annotations

import enum
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .config_help import ENV_PREFIX, TOOL_ENVIRONMENT, Key, env_name, sections, shape_of, toml_section, walk

# Keys a live reload applies: security/reload.py RELOADABLE names whole top-level
# settings; of a `[[queues]]` entry only the limits are applied (restart_needed there).
QUEUE_LIMIT_KEYS = ("max_depth", "max_bytes", "overflow")

SECTION_DOCS = {
    "tls": "An AMQPS listener (TLS), next to the plain one. Set it and `cert_file`/`key_file` are required.",
    "websocket": "AMQP over WebSocket (subprotocol `amqp`) for browsers and clients behind HTTP proxies; "
                 "with `cert_file` and `key_file`: wss. docs/operations.md \"AMQP over WebSocket\".",
    "users.<name>": "A user of SASL SCRAM-SHA-256 / PLAIN (and of the management API's basic auth when "
                    "`[[acl]]` rules exist). `[users.alice]` declares the user `alice`.",
    "limits": "Per-connection and per-broker limits that keep one client from stalling or exhausting the "
              "broker (docs/operations.md \"Limits and protections\").",
    "policy": "Queue creation, redelivery and dead-lettering.",
    "store": "The LMDB store under `data_dir`/store: durable queues, subscriptions and messages.",
    "exchanges[]": "Exchanges declared at start (besides the built-in `amq.direct`, `amq.topic`, `amq.fanout`).",
    "queues[]": "Queues declared at start, with optional limits.",
    "queue_limits[]": "Limits for every queue whose name matches `pattern`; the first match wins, a "
                      "`[[queues]]` entry's own limits win over patterns.",
    "bindings[]": "Bindings declared at start: `exchange` routes to `queue` for keys matching `key`.",
    "duplicate_detection[]": "Addresses whose message-ids are remembered: a resent message (same "
                             "message-id) is accepted and dropped.",
    "management": "The management listener: REST API (OpenAPI at `/docs`), console at `/`, `/metrics`.",
    "expiry_policies[]": "Report or delete durable subscriptions nobody consumes (docs/operations.md "
                         "\"Idle-expiry policy\"); the first matching policy decides.",
    "acl[]": "Access rules. With no `[[acl]]` rule and no `[anonymous]` section everything is allowed; "
             "with any, only what a rule grants (docs/operations.md \"Access control\").",
    "anonymous": "What the anonymous identity (SASL ANONYMOUS, or no SASL) may do once ACLs exist.",
    "alarms": "Memory and disk alarms: while one is raised, producers get no new credit and consumers keep "
              "draining (docs/operations.md \"Alarms\").",
    "ha": "A replicated primary/backup pair fenced by ZooKeeper (docs/ha.md). Without this section the "
          "broker runs alone.",
}

KEY_DOCS = {
    "container_id": "The broker's AMQP container-id, sent in its Open.",
    "host": "Address of the main AMQP listener (`0.0.0.0`: every interface).",
    "port": "Port of the main AMQP listener; 0 picks a free one and logs it.",
    "allow_anonymous": "Offer SASL ANONYMOUS (and accept clients without SASL). Unset: only on loopback "
                       "listeners.",
    "allow_insecure_plain": "Offer SASL PLAIN (the password in clear) on a plain TCP listener that is not "
                            "loopback. Unset or false: PLAIN only on TLS and loopback listeners, so on the "
                            "network clients must use SCRAM-SHA-256, TLS or EXTERNAL.",
    "client_id_policy": "`restricted`: one connection per container-id when the client asks for "
                        "sole-connection-for-container (Qpid JMS reports a second one as "
                        "InvalidClientIDException); `unrestricted`: no check.",
    "data_dir": "Directory of the store (`data_dir/store`) and the broker's lock file.",
    "log_level": "Log level of the broker's lines on stderr.",
    "expiry_interval": "Seconds between runs of the `[[expiry_policies]]`.",
    "tls.host": "Address of the AMQPS listener.",
    "tls.port": "Port of the AMQPS listener.",
    "tls.cert_file": "The server certificate (PEM), with its chain.",
    "tls.key_file": "The server certificate's private key (PEM).",
    "tls.allow_anonymous": "As the top-level `allow_anonymous`, for this listener. Unset: the top-level "
                           "setting.",
    "tls.client_id_policy": "As the top-level `client_id_policy`, for this listener.",
    "tls.client_ca_file": "CA certificates (PEM) client certificates must be signed by. Set: every client "
                          "must present one, and SASL EXTERNAL is offered (the certificate names the user).",
    "tls.cert_user": "Which part of a client certificate names the user: its subject's `cn`, or the whole "
                     "RFC 4514 `subject`.",
    "websocket.host": "Address of the WebSocket listener.",
    "websocket.port": "Port of the WebSocket listener.",
    "websocket.cert_file": "Server certificate (PEM) for wss; goes with `key_file`.",
    "websocket.key_file": "Private key (PEM) for wss; goes with `cert_file`.",
    "websocket.allow_anonymous": "As the top-level `allow_anonymous`, for this listener. Unset: the "
                                 "top-level setting.",
    "websocket.client_id_policy": "As the top-level `client_id_policy`, for this listener.",
    "users.<name>.password": "A hash from `amqpbroker hash-password` (`scram-sha-256$…`). A plaintext "
                             "password works but is warned about at start. Unset: the user authenticates "
                             "with a TLS client certificate only (SASL EXTERNAL).",
    "users.<name>.groups": "Groups the user belongs to, for `[[acl]]` rules naming a `group`.",
    "limits.max_connections": "Open connections, all listeners together; beyond, new ones are refused.",
    "limits.max_sessions_per_connection": "Sessions per connection (the advertised channel-max is one less).",
    "limits.max_links_per_connection": "Links per connection.",
    "limits.max_frame_size": "Largest frame, advertised in the Open (AMQP 1.0 §2.7.1: at least 512).",
    "limits.max_message_size": "Largest message, advertised on every link; bigger ones are refused "
                               "`amqp:link:message-size-exceeded`.",
    "limits.idle_timeout": "Seconds without a frame before a connection is closed; heartbeats are sent at "
                           "half the peer's timeout. 0 disables.",
    "limits.sasl_timeout": "Seconds from accepting a socket to its AMQP Open (SASL included).",
    "limits.max_handshakes": "Sockets that have not opened their connection yet, in all; beyond, new "
                             "sockets are closed at once.",
    "limits.max_handshakes_per_address": "The same, from one source address.",
    "limits.auth_free_failures": "Failed authentications from one address (SASL and the management API's "
                                 "basic auth together) before its next attempts wait.",
    "limits.auth_base_delay": "Seconds the first throttled attempt waits; the wait doubles per failure.",
    "limits.auth_max_delay": "Longest wait of a throttled attempt, in seconds.",
    "limits.link_credit": "Credit each producer link is granted.",
    "limits.max_unsettled_per_link": "Deliveries a consumer link may hold unsettled; beyond, nothing more "
                                     "is sent on it until it settles some, whatever credit it granted.",
    "limits.max_selector_length": "Characters of a JMS selector in an attach; longer ones are refused "
                                  "`amqp:invalid-field`.",
    "policy.auto_create_queues": "Create a queue when a client attaches to or sends to an address that "
                                 "does not exist.",
    "policy.max_delivery_attempts": "Failed deliveries of a message (its delivery-count: modified with "
                                    "delivery-failed, a consumer lost with it unsettled) after which it is "
                                    "dead-lettered, or dropped without a dead-letter address. 0: unlimited.",
    "policy.dead_letter_address": "Where rejected messages, messages past `max_delivery_attempts`, expired "
                                  "ones and the oldest of a full `drop-head` queue go, with their origin and "
                                  "reason. Unset: they are dropped, with a log line.",
    "policy.max_consumers_per_subscription": "Consumers one shared subscription may have. 0: unlimited.",
    "policy.max_queues_per_user": "Queues one user's addresses may create (anonymous counted as one "
                                  "user); beyond, the attach or message gets "
                                  "`amqp:resource-limit-exceeded`. 0: unlimited.",
    "store.enabled": "false: no store; nothing survives a restart (durable messages are kept in memory "
                     "only).",
    "store.initial_map_size": "Bytes LMDB maps at first; the map doubles as the store grows.",
    "store.max_map_size": "Bytes the map may grow to; a store that needs more refuses durable messages "
                          "with `amqp:resource-limit-exceeded`.",
    "store.queue_memory_budget": "Per durable queue: bytes of message bodies kept in memory; beyond, "
                                 "bodies are dropped once stored and read back on dispatch. 0: no limit.",
    "store.verify_at_start": "Read every page of the store (in a child process) before opening it, so a "
                             "damaged file stops the broker with one clear line instead of a crash later. "
                             "About a second per million stored messages.",
    "alarms.memory_high_watermark": "Fraction of the memory available (physical, or the cgroup's limit "
                                     "when lower) the broker's RSS may reach before the memory alarm "
                                     "(RabbitMQ's vm_memory_high_watermark).",
    "alarms.memory_high_watermark_absolute": "Bytes; replaces the fraction when set.",
    "alarms.disk_free_limit": "Free bytes the data directory's filesystem must keep before the disk alarm. "
                              "0: off.",
    "alarms.check_interval": "Seconds between readings of memory and disk.",
    "ha.role": "`primary` or `backup`: the role a broker starts in; `auto`: whichever ZooKeeper decides.",
    "ha.zookeeper": "The ZooKeeper ensemble, `host:port[,host:port...]`.",
    "ha.zookeeper_session_timeout": "Seconds of the ZooKeeper session: a failover takes about this long.",
    "ha.node_id": "This broker's id in the pair. Unset: made once and kept in the data directory.",
    "ha.replication_host": "Where this broker listens for its backup's replication connection.",
    "ha.replication_port": "Port of the replication listener.",
    "ha.advertised_replication": "`host:port` the backup is told to connect to. Unset: the replication "
                                 "listener's address as bound.",
    "ha.secret": "Shared by both brokers of the pair; each proves it knows it (HMAC) before any store data "
                 "crosses.",
    "ha.synchronous": "true: a durable message is accepted only once the backup has it too.",
    "ha.backup_timeout": "Seconds a live broker waits for a backup that stopped acknowledging before it "
                         "goes on alone.",
    "exchanges[].name": "The exchange's name.",
    "exchanges[].type": "`direct` (exact key), `topic` (`*` one word, `#` any) or `fanout` (every binding).",
    "exchanges[].durable": "Kept in the store across restarts.",
    "queues[].name": "The queue's name.",
    "queues[].durable": "Kept in the store across restarts, with its durable messages.",
    "queues[].max_delivery_attempts": "As `[policy] max_delivery_attempts`, for this queue. Unset: the "
                                      "policy's.",
    "queues[].max_depth": "Messages the queue may hold. Unset: a `[[queue_limits]]` pattern's; 0: none.",
    "queues[].max_bytes": "Bytes of message bodies the queue may hold. Unset: a pattern's; 0: none.",
    "queues[].overflow": "What a message meets when the queue is full: `block` (producers get no credit "
                         "until it has room), `reject` (`amqp:resource-limit-exceeded`), `drop-head` (the "
                         "oldest are dead-lettered or dropped).",
    "queue_limits[].pattern": "Queue names, words separated by `.`: `*` one word, `#` any number.",
    "queue_limits[].max_depth": "Messages a matching queue may hold. 0: no limit.",
    "queue_limits[].max_bytes": "Bytes of message bodies a matching queue may hold. 0: no limit.",
    "queue_limits[].overflow": "As in `[[queues]]`.",
    "bindings[].exchange": "The exchange (declared, or built in).",
    "bindings[].queue": "The queue it routes to.",
    "bindings[].key": "The binding key (a pattern on a topic exchange; ignored by fanout).",
    "duplicate_detection[].pattern": "Addresses, as an fnmatch glob (`orders.*`, `*`).",
    "duplicate_detection[].window": "Message-ids remembered per address, the last ones to arrive (kept in "
                                    "the store across restarts).",
    "management.enabled": "Start the management listener.",
    "management.host": "Address of the management listener. Without `[[acl]]` rules it answers loopback "
                       "clients only, whatever this is.",
    "management.port": "Port of the management listener; 0 picks a free one and logs it.",
    "management.cert_file": "Certificate (PEM) for HTTPS; goes with `key_file`.",
    "management.key_file": "Private key (PEM) for HTTPS; goes with `cert_file`.",
    "management.allowed_hosts": "Host names the listener answers to besides IP addresses, localhost and "
                                "`host` (a DNS name of the broker, a reverse proxy's); any other `Host` "
                                "header is refused 421 (DNS rebinding).",
    "management.metrics_queue_limit": "`/metrics` carries per-queue series for at most this many queues "
                                      "(the deepest) and as many subscriptions; `/metrics/per-object` "
                                      "carries all.",
    "expiry_policies[].pattern": "fnmatch glob over a subscription's topic address or its name.",
    "expiry_policies[].idle": "No consumer for this long: seconds, or text such as `\"7d\"`, `\"1d12h\"` "
                              "(s, m, h, d, w).",
    "expiry_policies[].max_backlog": "More pending messages than this.",
    "expiry_policies[].action": "`report` (a log line and a counter) or `delete` (never while a consumer "
                                "is attached).",
    "expiry_policies[].match": "`any`: one condition fires; `all`: every configured one must.",
    "acl[].user": "The user the rule applies to (exactly one of `user` and `group`).",
    "acl[].group": "The group the rule applies to (`[users.NAME] groups`).",
    "acl[].pattern": "Addresses, words separated by `.`: `*` one word, `#` any number (`#`: all).",
    "acl[].permissions": "What the rule grants: `send`, `consume` (implies `browse`), `browse`, `manage` "
                         "(the management API), `all`.",
    "anonymous.permissions": "What the anonymous identity may do (as in `[[acl]]`).",
    "anonymous.pattern": "On which addresses (as in `[[acl]]`).",
}


# ---------------------------------------------------------------------- one key

def description(key: Key) -> str | None:
    text = key.field.description or KEY_DOCS.get(key.path)
    return " ".join(text.split()) if text else None


def reload_of(key: Key, reloadable: frozenset[str]) -> str:
    top = key.path.split(".")[0].split("[")[0]
    if top == "queues":
        return "live" if key.name in QUEUE_LIMIT_KEYS else "restart"
    return "live" if top in reloadable else "restart"


def _plain_type(annotation: Any, plural: bool = False) -> str:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        parts = [_plain_type(a, plural) for a in get_args(annotation) if a is not type(None)]
        return " or ".join(parts)
    if origin is Literal:
        return " \\| ".join(f'`"{v}"`' for v in get_args(annotation))
    if origin in (list, tuple, set, frozenset):
        return f"list of {_plain_type(get_args(annotation)[0], True)}"
    if origin is dict:
        return f"table of {_plain_type(get_args(annotation)[1], True)}"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f'`"{m.value}"`' for m in annotation)
    names = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "path"}
    name = names.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return name + "s" if plural else name


def _validators_of(model: type[BaseModel], name: str) -> set[str]:
    found = set()
    for dec in model.__pydantic_decorators__.field_validators.values():
        if name in dec.info.fields:
            found.add(dec.cls_var_name)
    return found


def type_of(key: Key) -> str:
    text = _plain_type(key.field.annotation)
    validators = _validators_of(key.owner, key.name)
    if "_bytes" in validators:
        text += ' or a size (`"512MiB"`, `"2GB"`)'
    if "_duration" in validators:
        text += ' or a duration (`"7d"`)'
    bounds = []
    for m in key.field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{sign} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen):
            bounds.append(f"at least {m.min_length} characters")
        if getattr(m, "pattern", None):
            bounds.append(f"matching `{m.pattern}`")
    return text + (f", {', '.join(bounds)}" if bounds else "")


def _size(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f" ({value >> shift} {unit})"
    return ""


def default_of(key: Key) -> str:
    field = key.field
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (str, Path)):
        return f'`"{value}"`'
    if isinstance(value, int):
        sized = "_bytes" in _validators_of(key.owner, key.name) or key.name.endswith(("_size", "_budget"))
        return f"`{value}`" + (_size(value) if sized else "")
    if isinstance(value, (list, dict)) and not value:
        return "`[]`" if isinstance(value, list) else "`{}`"
    return f"`{value}`"


def env_of(key: Key) -> str:
    if "[]" in key.section:
        return "—"
    return f"`{env_name(key.path).replace('<NAME>', '<name>')}`"


# ---------------------------------------------------------------------- the page

INTRO = """\
# Configuration reference

<!-- Generated by `amqpbroker config reference --output docs/configuration.md` from the settings
models in amqpbroker/config.py; tests/test_config_reference.py fails when it is stale. -->

Settings come from, in order of precedence: command-line flags of `amqpbroker serve` (`--host`,
`--port`, `--data-dir`, `--log-level`), then `AMQPBROKER_*` environment variables, then the TOML
file given with `--config`, then the defaults below.

* **Unknown keys are errors.** A misspelt key, in any section, stops the broker with exit status 2
  and one line per problem naming the key and the nearest known one:
  `invalid setting 'acl.0.permisions': unknown key (did you mean 'permissions'?)`.
  A key in the wrong section is pointed to its place:
  `invalid setting 'dead_letter_adress': unknown key (did you mean 'dead_letter_address' in [policy]?)`.
* **Check a file without starting a broker:** `amqpbroker config check broker.toml` prints the
  effective configuration (file, environment and defaults together; passwords and secrets
  hidden) and exits 0, or prints the problems and exits 2.
* **Environment variables** are `AMQPBROKER_` and the key's path in upper case, sections joined
  with `__`: `[limits] max_connections` is `AMQPBROKER_LIMITS__MAX_CONNECTIONS`, a user's password
  `AMQPBROKER_USERS__ALICE__PASSWORD` (names are not case-sensitive: the user is `alice`).
  A list section (`[[queues]]`, `[[acl]]` …) is one variable holding a JSON list:
  `AMQPBROKER_ACL='[{"user": "admin", "permissions": ["manage"]}]'`. A variable under a known
  section with an unknown key is an error, like the same key in the file. Any other
  `AMQPBROKER_*` variable that is not a setting is warned about at start (`environment variable
  AMQPBROKER_MAX_CONECTIONS is not a setting and is ignored (did you mean
  AMQPBROKER_LIMITS__MAX_CONNECTIONS?)`) and by `config check`, not refused: the same prefix is
  used by the tools around the broker ({tools}), and one environment often serves several programs.
* **Live reload** (`kill -HUP <pid>`, `amqpbroker admin reload`, `POST /api/reload`) re-reads the
  file and applies the keys marked *live*; any other change is reported as needing a restart and
  left as it is (docs/operations.md "Live reload").
* A list value in a variable is JSON too: `AMQPBROKER_MANAGEMENT__ALLOWED_HOSTS='["mq.example.com"]'`.
* Sizes given as text (`"512MiB"`, `"2GB"`) are accepted where the type says so; so are durations
  (`"7d"`).
"""


def render(root: type[BaseModel] | None = None) -> str:
    if root is None:
        from .config import Settings
        root = Settings
    from .security.reload import RELOADABLE

    tools = ", ".join(f"`{name}`" for name in sorted(TOOL_ENVIRONMENT)) + ", `AMQPBROKER_FUZZ_*`"
    out = [INTRO.replace("{tools}", tools)]
    keys = list(walk(root))
    for section, model in sections(root):
        rows = [k for k in keys if k.section == section and shape_of(k.field.annotation).model is None]
        if not rows:
            continue
        title = "Top level" if not section else f"`{toml_section(section)}`"
        out.append(f"\n## {title}\n")
        intro = (SECTION_DOCS.get(section) or _docstring(model) or "") if section else ""
        top_field = root.model_fields.get(section.split(".")[0].split("[")[0])
        if top_field is not None and top_field.default is None:
            intro += " Absent by default."
        if intro:
            out.append(f"\n{intro.strip()}\n")
        if section.endswith("[]"):
            out.append(f"\nFrom the environment: `{ENV_PREFIX}{section[:-2].upper()}` holding a JSON list of "
                       f"tables.\n")
        out.append("\n| key | type | default | environment variable | reload | what it does |\n"
                   "|---|---|---|---|---|---|\n")
        for k in rows:
            text = (description(k) or "").replace("|", "\\|")
            out.append(f"| `{k.name}` | {type_of(k)} | {default_of(k)} | {env_of(k)} | "
                       f"{reload_of(k, RELOADABLE)} | {text} |\n")
    return "".join(out)


def _docstring(model: type[BaseModel]) -> str | None:
    doc = model.__doc__
    if not doc or doc is BaseModel.__doc__ or model.__mro__[1].__doc__ == doc:
        return None
    return " ".join(doc.split())


def undocumented(root: type[BaseModel] | None = None) -> list[str]:
    """Keys that are plain values and have no text (neither a Field description nor KEY_DOCS)."""
    if root is None:
        from .config import Settings
        root = Settings
    return [k.path for k in walk(root) if shape_of(k.field.annotation).model is None and not description(k)]


def shadowed_key_docs(root: type[BaseModel] | None = None) -> list[str]:
    """KEY_DOCS entries that never reach the reference: no such key, or the key's Field
    has its own description (which wins in `description`)."""
    if root is None:
        from .config import Settings
        root = Settings
    plain = {k.path for k in walk(root) if not k.field.description}
    return sorted(path for path in KEY_DOCS if path not in plain)


__all__ = ["KEY_DOCS", "SECTION_DOCS", "render", "shadowed_key_docs", "undocumented"]
