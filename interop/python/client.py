#!/usr/bin/env python3
"""python-qpid-proton client for the amqpbroker interop scenarios (see interop/README.md).

    client.py --url amqp://127.0.0.1:5672 --scenario NAME --role ROLE [options]

Prints JSON lines on stdout: progress events ({"event": "ready"} once its links are
attached) and, last, one result line {"result": "pass"|"fail", "error": ..., ...}.
Exit status 0 on pass, 1 on fail, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
import uuid
from typing import Any

from proton import (Array, Data, Described, Endpoint, Message, Terminus, UNDESCRIBED, byte, char,
                    decimal32, decimal64, decimal128, float32, int32, short, symbol, timestamp, ubyte,
                    uint, ulong, ushort)
from proton.handlers import IncomingMessageHandler, MessagingHandler
from proton.reactor import Container, LinkOption

CLIENT = "python"
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TYPES = os.path.join(HERE, "..", "types.json")
SELECTOR_DESCRIPTOR = 0x0000468C00000004


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------- canonical types

ARRAY_CODES = {"int": Data.INT, "long": Data.LONG, "double": Data.DOUBLE, "string": Data.STRING,
               "symbol": Data.SYMBOL, "uuid": Data.UUID, "boolean": Data.BOOL, "ubyte": Data.UBYTE,
               "ushort": Data.USHORT, "uint": Data.UINT, "ulong": Data.ULONG, "byte": Data.BYTE,
               "short": Data.SHORT, "float": Data.FLOAT, "char": Data.CHAR, "timestamp": Data.TIMESTAMP,
               "binary": Data.BINARY}
CODE_NAMES = {v: k for k, v in ARRAY_CODES.items()}


def from_canonical(c: dict) -> Any:
    t, v = c["type"], c.get("value")
    simple = {"ubyte": ubyte, "ushort": ushort, "uint": uint, "byte": byte, "short": short, "int": int32,
              "float": float32, "double": float, "char": char, "timestamp": timestamp, "string": str,
              "symbol": symbol}
    if t == "null":
        return None
    if t == "boolean":
        return bool(v)
    if t in simple:
        return simple[t](v)
    if t == "ulong":
        return ulong(int(v))
    if t == "long":
        return int(v)
    if t == "decimal32":
        return decimal32(int(v, 16))
    if t == "decimal64":
        return decimal64(int(v, 16))
    if t == "decimal128":
        return decimal128(bytes.fromhex(v))
    if t == "uuid":
        return uuid.UUID(v)
    if t == "binary":
        return bytes.fromhex(v)
    if t == "list":
        return [from_canonical(x) for x in v]
    if t == "map":
        return {from_canonical(k): from_canonical(x) for k, x in v}
    if t == "array":
        return Array(UNDESCRIBED, ARRAY_CODES[c["element"]], *[from_canonical(x) for x in v])
    raise ValueError(f"unknown canonical type {t!r}")


def to_canonical(v: Any) -> dict:
    t = type(v)
    T = lambda name, value: {"type": name, "value": value}  # noqa: E731
    if v is None:
        return {"type": "null"}
    table = {bool: ("boolean", bool), ubyte: ("ubyte", int), ushort: ("ushort", int), uint: ("uint", int),
             byte: ("byte", int), short: ("short", int), int32: ("int", int), float32: ("float", float),
             float: ("double", float), char: ("char", str), timestamp: ("timestamp", int),
             str: ("string", str), symbol: ("symbol", str)}
    if t in table:
        name, conv = table[t]
        return T(name, conv(v))
    if t is ulong:
        return T("ulong", str(int(v)))
    if t is int:
        return T("long", str(v))
    if t is decimal32:
        return T("decimal32", "%08x" % int(v))
    if t is decimal64:
        return T("decimal64", "%016x" % int(v))
    if t is decimal128:
        return T("decimal128", bytes(v).hex())
    if t is uuid.UUID:
        return T("uuid", str(v))
    if t in (bytes, bytearray, memoryview):
        return T("binary", bytes(v).hex())
    if t is list:
        return T("list", [to_canonical(x) for x in v])
    if t is dict or isinstance(v, dict):
        return T("map", [[to_canonical(k), to_canonical(x)] for k, x in v.items()])
    if t is Array:
        return {"type": "array", "element": CODE_NAMES.get(v.type, f"code-{v.type}"),
                "value": [to_canonical(x) for x in v.elements]}
    if t is Described:
        return {"type": "described", "descriptor": to_canonical(v.descriptor), "value": to_canonical(v.value)}
    return {"type": f"unknown:{t.__name__}", "value": repr(v)}


def prune(c: dict, excluded: set[str]) -> dict | None:
    """Drop values of the excluded types (recursively); None when `c` itself goes."""
    t = c["type"]
    if t in excluded:
        return None
    if t == "list":
        return {"type": t, "value": [p for x in c["value"] if (p := prune(x, excluded)) is not None]}
    if t == "map":
        out = []
        for k, x in c["value"]:
            pk, px = prune(k, excluded), prune(x, excluded)
            if pk is not None and px is not None:
                out.append([pk, px])
        return {"type": t, "value": out}
    if t == "array" and c["element"] in excluded:
        return None
    return c


def canon_equal(a: Any, b: Any, path: str, diffs: list[str]) -> None:
    """Structural comparison of canonical values; maps compare in any order."""
    if isinstance(a, dict) and isinstance(b, dict) and a.get("type") == "map" == b.get("type"):
        ea, eb = list(a.get("value", [])), list(b.get("value", []))
        if len(ea) != len(eb):
            diffs.append(f"{path}: map of {len(ea)} entries expected, got {len(eb)}")
        unmatched = list(eb)
        for k, x in ea:
            hit = next((i for i, (k2, _) in enumerate(unmatched) if not _diff(k, k2)), None)
            if hit is None:
                diffs.append(f"{path}: key {json.dumps(k, ensure_ascii=False)} missing")
                continue
            canon_equal(x, unmatched.pop(hit)[1], f"{path}[{k.get('value')!r}]", diffs)
        for k, _ in unmatched:
            diffs.append(f"{path}: unexpected key {json.dumps(k, ensure_ascii=False)}")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            canon_equal(a.get(key), b.get(key), f"{path}.{key}" if key != "value" else path, diffs)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{path}: {len(a)} elements expected, got {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            canon_equal(x, y, f"{path}[{i}]", diffs)
        return
    if isinstance(a, bool) or isinstance(b, bool):
        same = a is b
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
        same = a == b
    else:
        same = a == b
    if not same:
        diffs.append(f"{path}: expected {json.dumps(a, ensure_ascii=False)}, got {json.dumps(b, ensure_ascii=False)}")


def _diff(a: Any, b: Any) -> list[str]:
    d: list[str] = []
    canon_equal(a, b, "", d)
    return d


def load_expected(path: str, excluded: set[str]) -> tuple[dict, dict]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    props = {k: p for k, v in doc["application_properties"].items() if (p := prune(v, excluded)) is not None}
    return props, prune(doc["body"], excluded)


# --------------------------------------------------------------------- link shapes

class SourceShape(LinkOption):
    """Source fields as Qpid JMS sets them (capabilities, durability, expiry, filters)."""

    def __init__(self, *, capabilities=(), durable=None, expiry=None, selector=None, dist_copy=False,
                 null_source=False):
        self.capabilities = list(capabilities)
        self.durable, self.expiry, self.selector = durable, expiry, selector
        self.dist_copy, self.null_source = dist_copy, null_source

    def apply(self, link: Any) -> None:
        src = link.source
        if self.null_source:
            src.type = Terminus.UNSPECIFIED
            src.address = None
            return
        if self.capabilities:
            data = src.capabilities
            data.clear()
            data.put_array(False, Data.SYMBOL)
            data.enter()
            for cap in self.capabilities:
                data.put_symbol(symbol(cap))
            data.exit()
        if self.durable is not None:
            src.durability = self.durable
        if self.expiry is not None:
            src.expiry_policy = self.expiry
        if self.dist_copy:
            src.distribution_mode = Terminus.DIST_MODE_COPY
        if self.selector is not None:
            src.filter.put_object({symbol("jms-selector"): Described(ulong(SELECTOR_DESCRIPTOR), self.selector)})

    def test(self, link: Any) -> bool:
        return link.is_receiver


def jms_shared_durable(global_: bool) -> SourceShape:
    caps = ["topic", "shared"] + (["global"] if global_ else [])
    return SourceShape(capabilities=caps, durable=Terminus.DELIVERIES, expiry=Terminus.EXPIRE_NEVER,
                       dist_copy=True)


def remote_source_is_null(link: Any) -> bool:
    """A refusal: the broker answers the attach with a null source (then detaches)."""
    src = link.remote_source
    if src.type == Terminus.UNSPECIFIED:
        return True
    caps = src.capabilities
    caps.rewind()
    return src.address is None and not src.dynamic and not caps.next()


def condition_text(cond: Any) -> str | None:
    if cond is None:
        return None
    return f"{cond.name}: {cond.description}" if cond.description else str(cond.name)


# --------------------------------------------------------------------- scenario base

class ScenarioFailed(Exception):
    pass


class Scenario(MessagingHandler):
    """One scenario role. Subclasses call self.done(**details) or self.fail(reason)."""

    prefetch = 0

    def __init__(self, args: argparse.Namespace):
        super().__init__(prefetch=self.prefetch, auto_accept=True, auto_settle=True, peer_close_is_error=True)
        self.args = args
        self.result: dict | None = None
        self.conn = None
        self.container = None
        self.t0 = time.monotonic()

    # lifecycle ---------------------------------------------------------------
    def on_start(self, event: Any) -> None:
        self.container = event.container
        self._timeout_task = event.container.schedule(self.args.timeout, _Timer(self._on_timeout))
        self._fallback = None
        self.conn = event.container.connect(self.args.url)
        try:
            self.begin(event)
        except ScenarioFailed as exc:
            self.fail(str(exc))

    def begin(self, event: Any) -> None:
        raise NotImplementedError

    def _on_timeout(self) -> None:
        if self.result is None:
            self.fail(f"timed out after {self.args.timeout}s: {self.progress()}")

    def progress(self) -> str:
        return "no progress report"

    def done(self, **details: Any) -> None:
        if self.result is None:
            self.result = {"result": "pass", **details}
        self.shutdown()

    def fail(self, reason: str, **details: Any) -> None:
        if self.result is None:
            self.result = {"result": "fail", "error": reason, **details}
        self.shutdown()

    def shutdown(self) -> None:
        """Close the connection politely (the broker sees a close frame, not an abort);
        stop the container once the broker has answered, or after 3 s regardless."""
        if self.container is None:
            return
        self._timeout_task.cancel()
        conn = self.conn
        if conn is not None and conn.state & Endpoint.LOCAL_ACTIVE and not conn.state & Endpoint.REMOTE_CLOSED:
            conn.close()
            if self._fallback is None:
                self._fallback = self.container.schedule(3.0, _Timer(self.container.stop))
        else:
            self.container.stop()

    def on_connection_closed(self, event: Any) -> None:
        if self._fallback is not None:
            self._fallback.cancel()
        if self.container is not None:
            self.container.stop()

    # errors --------------------------------------------------------------------
    def on_transport_error(self, event: Any) -> None:
        self.fail(f"transport error: {condition_text(event.transport.condition)}")

    def on_connection_error(self, event: Any) -> None:
        self.fail(f"connection closed by the broker: {condition_text(event.connection.remote_condition)}")

    def on_session_error(self, event: Any) -> None:
        self.fail(f"session ended by the broker: {condition_text(event.session.remote_condition)}")

    def on_link_error(self, event: Any) -> None:
        self.fail(f"link '{event.link.name}' detached by the broker: "
                  f"{condition_text(event.link.remote_condition)}")

    def on_rejected(self, event: Any) -> None:
        self.fail(f"message rejected: {condition_text(event.delivery.remote.condition)}")

    def on_released(self, event: Any) -> None:
        self.fail("message released by the broker")


class _Timer:
    def __init__(self, fn):
        self.fn = fn

    def on_timer_task(self, event: Any) -> None:
        self.fn()


# --------------------------------------------------------------------- plain sender / receivers

def seq_message(i: int, **extra_props: Any) -> Message:
    return Message(body=f"msg-{i}", properties={"seq": i, **extra_props}, durable=True)


class Sender(Scenario):
    """Send --count messages (body 'msg-i', property seq=i) to --address; wait for every Accepted."""

    def begin(self, event: Any) -> None:
        self.sent = self.accepted = 0
        self.sender = event.container.create_sender(self.conn, self.args.address)

    def on_sendable(self, event: Any) -> None:
        while event.sender.credit and self.sent < self.args.count:
            event.sender.send(seq_message(self.sent))
            self.sent += 1

    def on_accepted(self, event: Any) -> None:
        self.accepted += 1
        if self.accepted == self.args.count:
            self.done(sent=self.sent, accepted=self.accepted)

    def progress(self) -> str:
        return f"sent {self.sent}, accepted {self.accepted} of {self.args.count}"


class Receiver(Scenario):
    """Receive --count messages from --address; they must arrive with seq 0..count-1 in order."""

    prefetch = 100

    def begin(self, event: Any) -> None:
        self.got: list[int] = []
        self.receiver = event.container.create_receiver(self.conn, self.args.address, name=self.args.link_name)

    def on_link_opened(self, event: Any) -> None:
        if event.link.is_receiver:
            if remote_source_is_null(event.link):
                self.fail("attach refused (null source)")
                return
            emit({"event": "ready"})

    def on_message(self, event: Any) -> None:
        self.got.append(int(event.message.properties["seq"]))
        if len(self.got) == self.args.count:
            expected = list(range(self.args.count))
            if self.got == expected:
                self.done(received=len(self.got), in_order=True)
            else:
                first = next(i for i, (a, b) in enumerate(zip(self.got, expected)) if a != b)
                self.fail(f"order broken at position {first}: got seq {self.got[first]}",
                          received=len(self.got), in_order=False)

    def progress(self) -> str:
        return f"received {len(self.got)} of {self.args.count}"


class GlobalSharedReceiver(Scenario):
    """One Qpid JMS shared durable consumer without client-id: link `<sub>|global`,
    source caps topic,shared,global, durable=unsettled-state, expiry never.  Receives until
    --idle seconds pass without a message (after the first), then detaches closed=false."""

    prefetch = 100

    def begin(self, event: Any) -> None:
        self.got: list[int] = []
        self.last = None
        self.receiver = event.container.create_receiver(
            self.conn, self.args.address, name=f"{self.args.sub}|global", options=jms_shared_durable(True))

    def on_link_opened(self, event: Any) -> None:
        if remote_source_is_null(event.link):
            self.fail("shared subscription attach refused (null source)")
            return
        emit({"event": "ready"})
        self._tick()

    def _tick(self) -> None:
        if self.result is not None:
            return
        if self.last is not None and time.monotonic() - self.last >= self.args.idle:
            self.receiver.detach()
            return
        self.container.schedule(0.1, _Timer(self._tick))

    def on_link_remote_detach(self, event: Any) -> None:
        if event.link.remote_condition is not None:
            self.on_link_error(event)
        else:
            self.done(received=self.got)

    def on_message(self, event: Any) -> None:
        self.got.append(int(event.message.properties["seq"]))
        self.last = time.monotonic()

    def progress(self) -> str:
        return f"received {len(self.got)}"


class ClientIdSharedReceiver(Scenario):
    """Shared durable subscription with a client-id: one connection (container-id set),
    links `<sub>` and `<sub>|2`; the messages must split between them and together be
    exactly seq 0..count-1."""

    prefetch = 100

    def on_start(self, event: Any) -> None:
        event.container.container_id = self.args.container_id
        super().on_start(event)

    def begin(self, event: Any) -> None:
        self.per_link: dict[str, list[int]] = {}
        self.opened = self.detached = 0
        self.links = []
        for name in (self.args.sub, f"{self.args.sub}|2"):
            self.per_link[name] = []
            self.links.append(event.container.create_receiver(self.conn, self.args.address, name=name,
                                                              options=jms_shared_durable(False)))

    def on_link_opened(self, event: Any) -> None:
        if remote_source_is_null(event.link):
            self.fail(f"attach of '{event.link.name}' refused (null source)")
            return
        self.opened += 1
        if self.opened == 2:
            emit({"event": "ready"})

    def on_message(self, event: Any) -> None:
        self.per_link[event.link.name].append(int(event.message.properties["seq"]))
        total = sum(len(v) for v in self.per_link.values())
        if total >= self.args.count:
            merged = sorted(s for v in self.per_link.values() for s in v)
            counts = {k: len(v) for k, v in self.per_link.items()}
            if merged != list(range(self.args.count)):
                self.fail("the two links together did not get each message exactly once", per_link=counts)
            elif min(counts.values()) == 0:
                self.fail("messages did not split: one link got none", per_link=counts)
            else:
                self.counts = counts
                for link in self.links:
                    link.detach()   # a durable consumer's close: the subscription stays

    def on_link_remote_detach(self, event: Any) -> None:
        if event.link.remote_condition is not None:
            return self.on_link_error(event)
        self.detached += 1
        if self.detached == len(self.links):
            self.done(per_link=self.counts)

    def progress(self) -> str:
        return f"received {[len(v) for v in self.per_link.values()]}"


# --------------------------------------------------------------------- unsubscribe

class Unsubscribe(Scenario):
    """For a client-id subscription (`<sub>`, container-id set) and a global one
    (`<sub>|global`): create it, detach closed=false, null-source attach (answered with
    the stored source), detach closed=true (deletes it), null-source attach again
    (refused: null source + amqp:not-found)."""

    def on_start(self, event: Any) -> None:
        event.container.container_id = self.args.container_id
        super().on_start(event)

    def begin(self, event: Any) -> None:
        self.steps = []
        self.variants = [(self.args.sub, False), (f"{self.args.sub}g|global", True)]
        self.step = None
        self.next_variant()

    def next_variant(self) -> None:
        if not self.variants:
            self.done(steps=self.steps)
            return
        self.name, self.global_ = self.variants.pop(0)
        self.set_step("create")
        self.link = self.container.create_receiver(self.conn, self.args.address, name=self.name,
                                                   options=jms_shared_durable(self.global_))

    def set_step(self, step: str) -> None:
        self.step = step
        self.steps.append(f"{self.name}:{step}")

    def on_link_opened(self, event: Any) -> None:
        null = remote_source_is_null(event.link)
        if self.step == "create":
            if null:
                return self.fail(f"{self.name}: subscribe refused")
            self.set_step("detach-keep")
            event.link.detach()
        elif self.step == "lookup":
            if null:
                return self.fail(f"{self.name}: null-source lookup of an existing subscription answered "
                                 "with a null source")
            self.set_step("unsubscribe")
            event.link.close()
        elif self.step == "lookup-gone":
            if not null:
                self.fail(f"{self.name}: null-source lookup after unsubscribe answered with a source "
                          f"({event.link.remote_source.address}); expected a refusal")

    # proton reports the broker's detach through several callbacks (remote detach for
    # closed=false; error / closing / closed for closed=true): handle each link once.
    def on_link_error(self, event: Any) -> None:
        self.link_ended(event)

    def on_link_closing(self, event: Any) -> None:
        self.link_ended(event)

    def on_link_closed(self, event: Any) -> None:
        self.link_ended(event)

    def on_link_remote_detach(self, event: Any) -> None:
        self.link_ended(event)

    def link_ended(self, event: Any) -> None:
        if getattr(event.link, "_interop_ended", False):
            return
        event.link._interop_ended = True
        cond = event.link.remote_condition
        if self.step == "detach-keep":
            if cond is not None:
                return self.fail(f"{self.name}: detach closed=false answered with {condition_text(cond)}")
            self.set_step("lookup")
            self.container.create_receiver(self.conn, None, name=self.name, options=SourceShape(null_source=True))
        elif self.step == "unsubscribe":
            if cond is not None:
                return self.fail(f"{self.name}: unsubscribe (detach closed=true) answered with "
                                 f"{condition_text(cond)}")
            self.set_step("lookup-gone")
            self.container.create_receiver(self.conn, None, name=self.name, options=SourceShape(null_source=True))
        elif self.step == "lookup-gone":
            if cond is None or str(cond.name) != "amqp:not-found":
                return self.fail(f"{self.name}: lookup after unsubscribe: expected amqp:not-found, got "
                                 f"{condition_text(cond)}")
            event.link.close()
            self.next_variant()
        else:
            self.fail(f"{self.name}: unexpected detach at step {self.step}: {condition_text(cond)}")

    def progress(self) -> str:
        return f"at step {self.step}"


# --------------------------------------------------------------------- selector

class Selector(Scenario):
    """A topic consumer with a jms-selector filter (described 0x0000468C00000004):
    "color = 'red'".  Sends 10 messages alternating red/blue, then a red 'end'; the
    consumer must get exactly the red ones, in order."""

    prefetch = 100

    def begin(self, event: Any) -> None:
        self.got: list[str] = []
        self.receiver = event.container.create_receiver(
            self.conn, self.args.address, name=f"selector-{uuid.uuid4()}",
            options=SourceShape(capabilities=["topic"], expiry=Terminus.EXPIRE_WITH_LINK,
                                selector="color = 'red'"))
        self.sender = None

    def on_link_opened(self, event: Any) -> None:
        if event.link.is_receiver:
            if remote_source_is_null(event.link):
                return self.fail("selector consumer refused (null source)")
            filters = event.link.remote_source.filter
            filters.rewind()
            echoed = filters.get_object() if filters.next() else None
            if not echoed or symbol("jms-selector") not in echoed:
                return self.fail(f"the broker did not echo the jms-selector filter: {echoed!r}")
            self.sender = self.container.create_sender(self.conn, "amq.topic/" + self.args.address
                                                       if "/" not in self.args.address else self.args.address)
            self.to_send = [(f"m{i}", "red" if i % 2 == 0 else "blue") for i in range(10)] + [("end", "red")]

    def on_sendable(self, event: Any) -> None:
        while event.sender.credit and self.to_send:
            body, color = self.to_send.pop(0)
            event.sender.send(Message(body=body, properties={"color": color}))

    def on_accepted(self, event: Any) -> None:
        pass

    def on_message(self, event: Any) -> None:
        self.got.append(event.message.body)
        if event.message.body == "end":
            expected = ["m0", "m2", "m4", "m6", "m8", "end"]
            if self.got == expected:
                self.done(received=self.got)
            else:
                self.fail(f"expected {expected}, got {self.got}")

    def progress(self) -> str:
        return f"received {self.got}"


# --------------------------------------------------------------------- large message

class Large(Scenario):
    """One 1 MiB binary message to a queue and back, compared byte for byte."""

    prefetch = 10

    def begin(self, event: Any) -> None:
        self.payload = bytes((i * 31 + 7) & 0xFF for i in range(self.args.size))
        self.digest = hashlib.sha256(self.payload).hexdigest()
        self.sender = event.container.create_sender(self.conn, self.args.address)
        self.sent = False
        self.t_send = None

    def on_sendable(self, event: Any) -> None:
        if not self.sent:
            self.sent = True
            self.t_send = time.monotonic()
            event.sender.send(Message(body=self.payload, properties={"sha256": self.digest}))

    def on_accepted(self, event: Any) -> None:
        self.container.create_receiver(self.conn, self.args.address)

    def on_message(self, event: Any) -> None:
        body = event.message.body
        if not isinstance(body, (bytes, memoryview)):
            return self.fail(f"body came back as {type(body).__name__}")
        body = bytes(body)
        if body != self.payload:
            return self.fail(f"body differs: {len(body)} bytes, sha256 {hashlib.sha256(body).hexdigest()}")
        self.done(size=len(body), sha256=self.digest, round_trip_ms=round((time.monotonic() - self.t_send) * 1000))


# --------------------------------------------------------------------- drain

class Drain(Scenario):
    """Drain on an empty queue: the broker must answer with credit 0 promptly.  Then 3
    messages are put on the queue and a second drain gets all 3, then credit 0."""

    PROMPT = 1.0  # seconds

    def begin(self, event: Any) -> None:
        self.phase = "attach"
        self.got: list[str] = []
        self.receiver = event.container.create_receiver(self.conn, self.args.address)
        self.timings = {}

    def on_link_opened(self, event: Any) -> None:
        if event.link.is_receiver and self.phase == "attach":
            self.phase = "drain-empty"
            self.t = time.monotonic()
            event.link.drain(10)

    def on_link_flow(self, event: Any) -> None:
        link = event.link
        if not link.is_receiver:
            return
        if link.credit == 0 and self.phase == "drain-empty":
            took = time.monotonic() - self.t
            self.timings["empty_drain_ms"] = round(took * 1000)
            if took > self.PROMPT:
                return self.fail(f"empty drain answered after {took:.2f}s (limit {self.PROMPT}s)")
            self.phase = "send"
            self.sent = 0
            self.container.create_sender(self.conn, self.args.address)
        elif link.credit == 0 and self.phase == "drain-3":
            took = time.monotonic() - self.t
            self.timings["drain_3_ms"] = round(took * 1000)
            if self.got != ["d0", "d1", "d2"]:
                return self.fail(f"drain with 3 available: credit 0 after {self.got}, expected d0..d2")
            if took > self.PROMPT:
                return self.fail(f"second drain answered after {took:.2f}s")
            self.done(**self.timings)

    def on_sendable(self, event: Any) -> None:
        while self.phase == "send" and event.sender.credit and self.sent < 3:
            event.sender.send(Message(body=f"d{self.sent}"))
            self.sent += 1

    def on_accepted(self, event: Any) -> None:
        if event.link.is_sender and self.phase == "send":
            self.accepted = getattr(self, "accepted", 0) + 1
            if self.accepted == 3:
                self.phase = "drain-3"
                self.t = time.monotonic()
                self.receiver.drain(10)

    def on_message(self, event: Any) -> None:
        self.got.append(event.message.body)

    def progress(self) -> str:
        return f"phase {self.phase}, received {self.got}"


# --------------------------------------------------------------------- consumer close

class ConsumerClose(Scenario):
    """Receive one and close, five times (JmsTemplate.receive()): each round opens a
    receiver with a prefetch of 10 on a queue of 5 messages, accepts the first message
    and closes the receiver with the rest unsettled.  A normal close is not a failed
    delivery attempt: every round must get the next message with delivery-count 0."""

    ROUNDS = 5

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        for handler in self.handlers:   # settle by hand: the prefetched rest stays unsettled
            if isinstance(handler, IncomingMessageHandler):
                handler.auto_accept = False

    def begin(self, event: Any) -> None:
        self.phase = "send"
        self.sent = self.accepted = 0
        self.got: list[list] = []
        self.receiver = None
        event.container.create_sender(self.conn, self.args.address)

    def on_sendable(self, event: Any) -> None:
        while self.phase == "send" and event.sender.credit and self.sent < self.ROUNDS:
            event.sender.send(Message(body=f"c{self.sent}"))
            self.sent += 1

    def on_accepted(self, event: Any) -> None:
        if event.link.is_sender and self.phase == "send":
            self.accepted += 1
            if self.accepted == self.ROUNDS:
                self.phase = "rounds"
                self._open_round()

    def _open_round(self) -> None:
        self.taken = False
        self.receiver = self.container.create_receiver(self.conn, self.args.address,
                                                       name=f"cc-{uuid.uuid4().hex[:8]}")
        self.receiver.flow(10)

    def on_message(self, event: Any) -> None:
        if event.link.name != self.receiver.name or self.taken:
            return   # the prefetched rest: left unsettled, the close gives them back
        self.taken = True
        self.got.append([event.message.body, event.message.delivery_count])
        self.accept(event.delivery)
        event.link.close()

    def on_link_closed(self, event: Any) -> None:
        if event.link.name != self.receiver.name or self.phase != "rounds":
            return
        if len(self.got) < self.ROUNDS:
            return self._open_round()
        expected = [[f"c{i}", 0] for i in range(self.ROUNDS)]
        if self.got != expected:
            return self.fail(f"rounds got {self.got}, expected {expected}")
        self.done(rounds=self.got)

    def progress(self) -> str:
        return f"phase {self.phase}, rounds {self.got}"


# --------------------------------------------------------------------- types

class TypesSender(Scenario):
    def begin(self, event: Any) -> None:
        props, body = load_expected(self.args.types_file, self.args.excluded)
        self.msg = Message(properties={k: from_canonical(v) for k, v in props.items()},
                           body=from_canonical(body))
        self.sent = False
        event.container.create_sender(self.conn, self.args.address)

    def on_sendable(self, event: Any) -> None:
        if not self.sent:
            self.sent = True
            event.sender.send(self.msg)

    def on_accepted(self, event: Any) -> None:
        self.done()


class TypesReceiver(Scenario):
    prefetch = 1

    def begin(self, event: Any) -> None:
        self.expected = load_expected(self.args.types_file, self.args.excluded)
        event.container.create_receiver(self.conn, self.args.address)

    def on_message(self, event: Any) -> None:
        msg = event.message
        exp_props, exp_body = self.expected
        got_props = {k: to_canonical(v) for k, v in (msg.properties or {}).items()}
        got_body = to_canonical(msg.body)
        diffs: list[str] = []
        canon_equal(exp_props, got_props, "application_properties", diffs)
        canon_equal(exp_body, got_body, "body", diffs)
        if diffs:
            self.fail(f"{len(diffs)} difference(s): " + "; ".join(diffs[:8]), differences=diffs)
        else:
            self.done(properties=len(got_props), body_entries=len(got_body.get("value", [])))


# --------------------------------------------------------------------- transactions

class Transaction(Scenario):
    """Local transactions (AMQP 1.0 Part 4): declare, send 2 transactional messages,
    commit; declare, send 1, roll back; a receiver must then get exactly the 2 committed."""

    prefetch = 0

    def begin(self, event: Any) -> None:
        self.phase = "declare-commit"
        self.sender = event.container.create_sender(self.conn, self.args.address)
        self.got: list[str] = []
        self.txn = event.container.declare_transaction(self.conn, handler=self)

    # transaction events
    def on_transaction_declared(self, event: Any) -> None:
        txn = event.transaction
        if self.phase == "declare-commit":
            for body in ("t1", "t2"):
                txn.send(self.sender, Message(body=body))
            self.phase = "commit"
            txn.commit()
        elif self.phase == "declare-abort":
            txn.send(self.sender, Message(body="rolled-back"))
            self.phase = "abort"
            txn.abort()

    def on_transaction_declare_failed(self, event: Any) -> None:
        self.fail("transaction declare failed")

    def on_transaction_committed(self, event: Any) -> None:
        self.phase = "declare-abort"
        self.txn = self.container.declare_transaction(self.conn, handler=self)

    def on_transaction_aborted(self, event: Any) -> None:
        self.phase = "receive"
        self.receiver = self.container.create_receiver(self.conn, self.args.address)

    def on_transaction_commit_failed(self, event: Any) -> None:
        self.fail("commit failed")

    def on_link_opened(self, event: Any) -> None:
        if event.link.is_receiver and self.phase == "receive":
            event.link.drain(10)

    def on_message(self, event: Any) -> None:
        self.got.append(event.message.body)

    def on_link_flow(self, event: Any) -> None:
        if event.link.is_receiver and self.phase == "receive" and event.link.credit == 0:
            if self.got == ["t1", "t2"]:
                self.done(received=self.got)
            else:
                self.fail(f"after commit(t1,t2) and rollback(rolled-back) the queue held {self.got}")

    def on_link_error(self, event: Any) -> None:
        link = event.link
        cond = condition_text(link.remote_condition)
        if link.target.type == Terminus.COORDINATOR or link.name == "txn-ctrl":
            self.fail(f"transaction coordinator attach refused: {cond}")
        else:
            super().on_link_error(event)

    def progress(self) -> str:
        return f"phase {self.phase}"


# --------------------------------------------------------------------- main

ROLES = {
    ("queue", "sender"): Sender, ("queue", "receiver"): Receiver,
    ("topic", "sender"): Sender, ("topic", "receiver"): Receiver,
    ("shared-global", "sender"): Sender, ("shared-global", "receiver"): GlobalSharedReceiver,
    ("shared-clientid", "sender"): Sender, ("shared-clientid", "receiver"): ClientIdSharedReceiver,
    ("unsubscribe", "run"): Unsubscribe,
    ("selector", "run"): Selector,
    ("large", "run"): Large,
    ("drain", "run"): Drain,
    ("consumer-close", "run"): ConsumerClose,
    ("types", "sender"): TypesSender, ("types", "receiver"): TypesReceiver,
    ("transaction", "run"): Transaction,
}


def info() -> dict:
    import proton
    return {"result": "pass", "client": CLIENT, "library": "python-qpid-proton",
            "version": ".".join(map(str, proton.VERSION)), "unsupported_types": [],
            "transactions": True,
            "roles": sorted(f"{s}/{r}" for s, r in ROLES)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="amqp://127.0.0.1:5672")
    p.add_argument("--scenario", required=True)
    p.add_argument("--role", default="run")
    p.add_argument("--address", default="interop.queue")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--size", type=int, default=1024 * 1024)
    p.add_argument("--sub", default="interop-sub")
    p.add_argument("--container-id", default=f"interop-python-{uuid.uuid4()}")
    p.add_argument("--link-name", default=None)
    p.add_argument("--idle", type=float, default=1.5)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--types-file", default=DEFAULT_TYPES)
    p.add_argument("--exclude-types", default="")
    args = p.parse_args(argv)
    args.excluded = {t for t in args.exclude_types.split(",") if t}
    base = {"client": CLIENT, "scenario": args.scenario, "role": args.role}
    if args.scenario == "info":
        emit({**base, **info()})
        return 0
    cls = ROLES.get((args.scenario, args.role))
    if cls is None:
        emit({**base, "result": "fail", "error": f"unknown scenario/role {args.scenario}/{args.role}"})
        return 2
    handler = cls(args)
    try:
        Container(handler).run()
    except Exception as exc:  # noqa: BLE001 - report every failure as a result line
        if handler.result is None:
            handler.result = {"result": "fail", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc(limit=5)}
    result = handler.result or {"result": "fail", "error": "container stopped without a result"}
    result["elapsed_ms"] = round((time.monotonic() - handler.t0) * 1000)
    emit({**base, **result})
    return 0 if result["result"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
