"""The seed corpus: the exact bytes a real client sends in typical conversations.

Nothing binary is stored in the repository.  At test time a python-qpid-proton
client engine (Transport + Connection, as `RawClient` drives it) talks to a small
proton *server* engine in memory; every byte the client's transport hands out
(`peek`/`pop`) is recorded and split into protocol headers and frames.  Both ends
are deterministic (no clock, no randomness, fixed names), so the corpus is the same
on every run.

The fake server only does what makes the client say more: it opens what the client
opens, grants credit, sends a few messages to the client's receivers, accepts what
it receives, and answers the transaction coordinator with `declared`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from proton import (
    Array,
    Collector,
    Condition,
    Connection,
    Data,
    Delivery,
    Described,
    Event,
    Message,
    Terminus,
    Transport,
    symbol,
    ubyte,
    ulong,
)

from amqpbroker.core import codec

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"

# Every conversation opens with this container-id; the runner swaps the digits for a
# case number (same length, so no frame size changes), so that no two cases share a
# container (no link stealing between them, no client-id clashes).
CONTAINER_ID = "fuzz-client-000000"
# Where the conversations send and receive.  The runner swaps the digits too (one
# queue per case, modulo QUEUES): a queue shared by thousands of cases would grow
# with what they leave in it, and the scans of its selecting consumers with it.
QUEUE = "fuzz.q.000000"
TOPIC = "fuzz.topic"
SELECTOR = "colour = 'red' AND weight > 2"
SELECTOR_FILTER = ulong(0x0000468C00000004)
NO_LOCAL_FILTER = ulong(0x0000468C00000003)

OPEN, BEGIN, ATTACH, FLOW, TRANSFER, DISPOSITION, DETACH, END, CLOSE = range(0x10, 0x19)
PERFORMATIVES = {OPEN: "open", BEGIN: "begin", ATTACH: "attach", FLOW: "flow", TRANSFER: "transfer",
                 DISPOSITION: "disposition", DETACH: "detach", END: "end", CLOSE: "close",
                 0x40: "sasl-mechanisms", 0x41: "sasl-init", 0x42: "sasl-challenge",
                 0x43: "sasl-response", 0x44: "sasl-outcome"}


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True)
class Frame:
    """One protocol header (kind "header") or one whole frame ("sasl" / "amqp")."""

    raw: bytes
    kind: str
    channel: int = 0
    code: int | None = None      # the performative's descriptor; None: header or empty frame
    turn: int = 0                # the client's turn of the conversation that sent it (see Pair)

    @property
    def doff(self) -> int:
        return self.raw[4] * 4

    @property
    def body(self) -> bytes:
        """Performative and payload (everything after the frame header)."""
        return self.raw[self.doff:] if self.kind != "header" else b""

    def performative(self) -> tuple[list, bytes]:
        """(fields, payload): the performative's field list and the bytes after it
        (a transfer's message bytes)."""
        body = self.body
        value, end = codec.decode(body)
        return list(value.value or []), body[end:]

    @property
    def name(self) -> str:
        if self.kind == "header":
            return "sasl-header" if self.raw == SASL_HEADER else "amqp-header"
        return PERFORMATIVES.get(self.code, f"0x{self.code:02x}" if self.code is not None else "empty")


def make_frame(channel: int, code: int, fields: list, payload: bytes = b"", kind: str = "amqp",
               turn: int = 0) -> Frame:
    """A frame carrying a performative encoded by our own codec (so that a field can
    be any value, including ones proton would refuse to encode)."""
    body = codec.encode(Described(ulong(code), fields)) + payload
    return Frame(frame_bytes(body, channel, 1 if kind == "sasl" else 0), kind, channel, code, turn)


def frame_bytes(body: bytes, channel: int, frame_type: int = 0) -> bytes:
    return struct.pack(">IBBH", 8 + len(body), 2, frame_type, channel & 0xFFFF) + body


# proton's ANONYMOUS initial response is "anonymous@<this host's name>": the corpus
# carries this one instead, so that it is the same on every machine.
SASL_INIT = b"\x00\x53\x41" + codec.encode([symbol("ANONYMOUS"), b"anonymous@fuzz"])


def split_frames(stream: bytes, turns: list[int] | None = None) -> list[Frame]:
    """Headers and frames of a well-formed client byte stream; `turns` are the
    offsets where each turn of the client began."""
    frames, off = [], 0
    turns = turns or [0]

    def turn_at(offset: int) -> int:
        return sum(1 for t in turns if t <= offset) - 1

    while off < len(stream):
        if stream.startswith(b"AMQP", off):
            frames.append(Frame(stream[off:off + 8], "header", turn=turn_at(off)))
            off += 8
            continue
        size, doff, ftype, channel = struct.unpack_from(">IBBH", stream, off)
        raw = stream[off:off + size]
        body = raw[doff * 4:]
        code = None
        if body:
            descriptor = codec.decode(body)[0].descriptor
            code = int(descriptor)
        if ftype == 1 and code == 0x41:
            raw = frame_bytes(SASL_INIT, channel, 1)
        frames.append(Frame(raw, "sasl" if ftype == 1 else "amqp", channel, code, turn_at(off)))
        off += size
    return frames


@dataclass(frozen=True)
class Conversation:
    name: str
    frames: tuple[Frame, ...]
    messages: tuple[bytes, ...] = ()      # the encoded messages its transfers carry

    def stream(self) -> bytes:
        return b"".join(f.raw for f in self.frames)

    def without_close(self) -> Conversation:
        """The conversation up to (not including) its close: what a case sends
        before its probe, so that an unharmed connection is still usable."""
        frames = tuple(f for f in self.frames if f.code != CLOSE or f.kind != "amqp")
        return Conversation(self.name, frames, self.messages)


# --------------------------------------------------------------------------- the in-memory pair


@dataclass
class FakeServer:
    """What the in-memory server does with the client's frames."""

    to_send: dict[str, list[bytes]] = field(default_factory=dict)   # link name → messages to send
    txn_ids: list[bytes] = field(default_factory=list)
    sent = 0

    def handle(self, ev: Event) -> None:
        t = ev.type
        if t == Event.CONNECTION_REMOTE_OPEN:
            ev.connection.open()
        elif t == Event.CONNECTION_REMOTE_CLOSE:
            ev.connection.close()
        elif t == Event.SESSION_REMOTE_OPEN:
            ev.session.open()
        elif t == Event.SESSION_REMOTE_CLOSE:
            ev.session.close()
        elif t == Event.LINK_REMOTE_OPEN:
            link = ev.link
            link.source.copy(link.remote_source)
            link.target.copy(link.remote_target)
            link.open()
            if link.is_receiver:
                link.flow(20)
        elif t == Event.LINK_REMOTE_CLOSE:
            ev.link.close()
        elif t == Event.LINK_REMOTE_DETACH:
            ev.link.detach()
        elif t == Event.LINK_FLOW and ev.link.is_sender:
            self._send(ev.link)
        elif t == Event.DELIVERY and ev.link.is_receiver:
            self._receive(ev.delivery)

    def _send(self, link) -> None:
        queue = self.to_send.get(link.name, [])
        while queue and link.credit > 0:
            self.sent += 1
            link.delivery(f"srv-{self.sent}".encode())
            link.send(queue.pop(0))
            link.advance()

    def _receive(self, dlv) -> None:
        if dlv.partial or not dlv.readable:
            return
        link = dlv.link
        raw = link.recv(dlv.pending)
        link.advance()
        if link.remote_target.type == Terminus.COORDINATOR:
            msg = Message()
            msg.decode(raw)
            if msg.body.descriptor in (symbol("amqp:declare:list"), ulong(0x31)):
                txn_id = f"fake-txn-{len(self.txn_ids) + 1}".encode()
                self.txn_ids.append(txn_id)
                dlv.local.data = [txn_id]
                dlv.update(0x33)                      # declared
            else:
                dlv.update(dlv.ACCEPTED)
        elif dlv.remote_state == 0x34:                # transactional-state
            dlv.local.data = [dlv.remote.data[0], Described(ulong(0x24), [])]
            dlv.update(0x34)
        else:
            dlv.update(dlv.ACCEPTED)
        dlv.settle()
        link.flow(1)


class Pair:
    """A proton client engine wired to a proton server engine in memory; every
    byte the client sends is recorded in order."""

    def __init__(self, server: FakeServer, *, server_max_frame_size: int | None = None,
                 desired_capabilities: list[str] | None = None, properties: dict | None = None):
        self.server = server
        self.sent = bytearray()
        # A turn is what the client sends between two things the server said: a
        # replay waits for the broker's answer before the next turn, as the client
        # waited for the server's (transfers need the begin's window and credit).
        self.turns: list[int] = []
        self._server_spoke = True
        self.client = Transport(Transport.CLIENT)
        self.client.sasl().allowed_mechs("ANONYMOUS")
        self.conn = Connection()
        self.conn.container = CONTAINER_ID
        self.conn.hostname = "localhost"
        if desired_capabilities:
            self.conn.desired_capabilities = Array(Data.NULL, Data.SYMBOL,
                                                   *[symbol(c) for c in desired_capabilities])
        if properties:
            self.conn.properties = properties
        self.client_events = Collector()
        self.conn.collect(self.client_events)
        self.client.bind(self.conn)

        self.srv = Transport(Transport.SERVER)
        if server_max_frame_size:      # the client splits bigger transfers into several frames
            self.srv.max_frame_size = server_max_frame_size
        self.srv.sasl().allowed_mechs("ANONYMOUS")
        self.srv_conn = Connection()
        self.srv_events = Collector()
        self.srv_conn.collect(self.srv_events)
        self.srv.bind(self.srv_conn)

    def run(self) -> None:
        """Move bytes both ways and run the server's handler until nothing changes."""
        for _ in range(1000):
            moved = self._move(self.client, self.srv, record=True)
            if self._move(self.srv, self.client, record=False):
                moved = self._server_spoke = True
            handled = self._drain(self.srv_events, self.server.handle)
            handled |= self._drain(self.client_events, None)
            if not (moved or handled):
                return
        raise RuntimeError("the in-memory conversation does not settle")

    def _move(self, src: Transport, dst: Transport, record: bool) -> bool:
        pending = src.pending()
        if pending <= 0:
            return False
        data = src.peek(pending)
        src.pop(len(data))
        if record:
            if self._server_spoke:
                self.turns.append(len(self.sent))
                self._server_spoke = False
            self.sent += data
        dst.push(data)
        return True

    @staticmethod
    def _drain(collector: Collector, handle: Callable | None) -> bool:
        any_event = False
        while (ev := collector.peek()) is not None:
            any_event = True
            if handle is not None:
                handle(ev)
            collector.pop()
        return any_event


# --------------------------------------------------------------------------- messages


def section(code: int, value: object) -> bytes:
    return codec.encode(Described(ulong(code), value))


def sample_messages() -> list[bytes]:
    """Messages with the sections clients put in them (AMQP 1.0 §3.2)."""
    plain = Message(body="hello")
    full = Message(
        id="msg-1", user_id=b"anonymous", address=QUEUE, subject="fuzz", reply_to="fuzz.reply",
        correlation_id=ulong(77), content_type="text/plain", content_encoding="utf-8",
        expiry_time=4102444800.0, creation_time=1700000000.0, group_id="g1", group_sequence=3,
        reply_to_group_id="g0", durable=True, priority=7, ttl=60.0, first_acquirer=True,
        delivery_count=1, properties={"colour": "red", "weight": 5, "price": 1.5, "ok": True},
        annotations={symbol("x-opt-jms-msg-type"): 5, symbol("x-opt-jms-dest"): 0},
        instructions={symbol("x-opt-trace"): "t"}, body=b"\x00\x01binary")
    delayed = Message(body=["a", 1, None], annotations={symbol("x-opt-delivery-delay"): 10},
                      properties={"colour": "blue"})
    seq = Message(body={"k": [1, 2, {"n": None}]})
    seq.inferred = False
    raw_sections = (section(0x70, [False, ubyte(4)])
                    + section(0x74, {"colour": "red", "weight": 3})
                    + section(0x75, b"part one") + section(0x75, b"part two")
                    + section(0x78, {symbol("x-opt-footer"): "f"}))
    sequence = section(0x76, [1, "two", [3]]) + section(0x76, [4])
    return [bytes(m.encode()) for m in (plain, full, delayed, seq)] + [raw_sections, sequence]


# --------------------------------------------------------------------------- conversations


def _open_session(pair: Pair):
    pair.conn.open()
    ssn = pair.conn.session()
    ssn.open()
    pair.run()
    return ssn


def _sender(pair: Pair, ssn, name: str, address: str | None, *, settled: bool = False):
    snd = ssn.sender(name)
    snd.target.address = address
    snd.source.address = name
    if settled:
        snd.snd_settle_mode = snd.SND_SETTLED
    snd.open()
    pair.run()
    return snd


def _receiver(pair: Pair, ssn, name: str, address: str, credit: int = 10, *, selector: str | None = None,
              capabilities: list[str] | None = None, durable: bool = False):
    rcv = ssn.receiver(name)
    rcv.source.address = address
    rcv.target.address = name
    if selector is not None or capabilities:
        filters = rcv.source.filter
        filters.put_map()
        filters.enter()
        if selector is not None:
            filters.put_symbol(symbol("jms-selector"))
            filters.put_object(Described(SELECTOR_FILTER, selector))
            filters.put_symbol(symbol("no-local"))
            filters.put_object(Described(NO_LOCAL_FILTER, "NoLocalFilter{}"))
        filters.exit()
    if capabilities:
        caps = rcv.source.capabilities
        caps.put_array(False, Data.SYMBOL)
        caps.enter()
        for c in capabilities:
            caps.put_symbol(symbol(c))
        caps.exit()
    if durable:
        rcv.source.durability = Terminus.DELIVERIES
        rcv.source.expiry_policy = Terminus.EXPIRE_NEVER
        rcv.source.distribution_mode = Terminus.DIST_MODE_COPY
    rcv.open()
    if credit:
        rcv.flow(credit)
    pair.run()
    return rcv


def _send(pair: Pair, snd, raw: bytes, tag: bytes, *, txn: bytes | None = None) -> None:
    dlv = snd.delivery(tag)
    snd.send(raw)
    if txn is not None:
        dlv.local.data = [txn]
        dlv.update(0x34)
    snd.advance()
    if snd.snd_settle_mode == snd.SND_SETTLED:
        dlv.settle()
    pair.run()


def _settle_incoming(pair: Pair, rcv, outcomes: list[int], txn: bytes | None = None) -> None:
    """Read what the fake server sent and settle each with the next outcome."""
    dlv = rcv.current
    i = 0
    while dlv is not None and not dlv.partial:
        rcv.recv(dlv.pending)
        rcv.advance()
        outcome = outcomes[i % len(outcomes)]
        if txn is not None:
            dlv.local.data = [txn, Described(ulong(0x24), [])]
            dlv.update(0x34)
        else:
            if outcome == dlv.MODIFIED:
                dlv.local.failed = True
                dlv.local.undeliverable = False
            if outcome == dlv.REJECTED:
                dlv.local.condition = Condition("fuzz:rejected", "rejected by the corpus client")
            dlv.update(outcome)
        dlv.settle()
        i += 1
        dlv = rcv.current
    pair.run()


def basic() -> Conversation:
    """Open, begin, a sender and a receiver, transfers of every section shape,
    dispositions of every outcome, detach, end, close."""
    messages = sample_messages()
    server = FakeServer(to_send={"fuzz-rcv": messages[:4]})
    pair = Pair(server)
    ssn = _open_session(pair)
    snd = _sender(pair, ssn, "fuzz-snd", QUEUE)
    for i, raw in enumerate(messages):
        _send(pair, snd, raw, f"tag-{i}".encode())
    rcv = _receiver(pair, ssn, "fuzz-rcv", QUEUE)
    _settle_incoming(pair, rcv, [Delivery.ACCEPTED, Delivery.RELEASED, Delivery.MODIFIED, Delivery.REJECTED])
    snd.close()
    rcv.close()
    pair.run()
    ssn.close()
    pair.conn.close()
    pair.run()
    return Conversation("basic", tuple(split_frames(bytes(pair.sent), pair.turns)), tuple(messages))


def presettled_and_multiframe() -> Conversation:
    """Pre-settled sends, a message larger than the frame size (a transfer in
    several frames), a drained receiver, links detached without closing."""
    big = Message(body="x" * 1500, properties={"colour": "red"}).encode()
    messages = [big, sample_messages()[0]]
    server = FakeServer(to_send={"fuzz-drain": [sample_messages()[2]]})
    pair = Pair(server, server_max_frame_size=512)
    ssn = _open_session(pair)
    snd = _sender(pair, ssn, "fuzz-presettled", QUEUE, settled=True)
    for i, raw in enumerate(messages):
        _send(pair, snd, raw, f"p-{i}".encode())
    rcv = _receiver(pair, ssn, "fuzz-drain", QUEUE, credit=0)
    rcv.drain(5)
    pair.run()
    _settle_incoming(pair, rcv, [Delivery.ACCEPTED])
    snd.detach()
    rcv.detach()
    pair.run()
    ssn.close()
    pair.conn.close()
    pair.run()
    return Conversation("presettled", tuple(split_frames(bytes(pair.sent), pair.turns)), tuple(messages))


def jms_consumer() -> Conversation:
    """Shaped like Qpid JMS: capabilities in the open, a consumer whose source has
    a jms-selector and no-local filter and the `queue` capability, a durable topic
    subscription, an anonymous-relay producer (address in the message `to`)."""
    relay = Message(address=QUEUE, properties={"colour": "red", "weight": 9}, body="relayed").encode()
    server = FakeServer(to_send={"jms-consumer": [sample_messages()[1]]})
    pair = Pair(server, desired_capabilities=["sole-connection-for-container", "DELAYED_DELIVERY",
                                              "ANONYMOUS-RELAY", "SHARED-SUBS"],
                properties={symbol("product"): "QpidJMS", symbol("version"): "2.5.0"})
    ssn = _open_session(pair)
    ssn2 = pair.conn.session()       # Qpid JMS: one session per JMS session
    ssn2.open()
    pair.run()
    rcv = _receiver(pair, ssn2, "jms-consumer", QUEUE, selector=SELECTOR, capabilities=["queue"])
    _settle_incoming(pair, rcv, [Delivery.ACCEPTED])
    sub = _receiver(pair, ssn, "fuzz-sub", TOPIC, credit=5, capabilities=["topic", "shared"], durable=True)
    snd = _sender(pair, ssn, "jms-relay", None)
    _send(pair, snd, relay, b"relay-1")
    rcv.close()
    sub.detach()
    snd.close()
    pair.run()
    ssn2.close()
    ssn.close()
    pair.conn.close()
    pair.run()
    return Conversation("jms", tuple(split_frames(bytes(pair.sent), pair.turns)), (relay,))


def transactions() -> Conversation:
    """A coordinator link (target Coordinator{amqp:local-transactions}); declare
    with the ulong descriptor (Qpid JMS) and the symbolic one (proton); a
    transactional transfer; a transactional acceptance; discharge commit and
    rollback."""
    server = FakeServer(to_send={"txn-rcv": [sample_messages()[0]]})
    pair = Pair(server)
    ssn = _open_session(pair)
    ctl = ssn.sender("txn-ctrl")
    ctl.source.address = "txn-ctrl"
    ctl.target.type = Terminus.COORDINATOR
    ctl.target.capabilities.put_object(symbol("amqp:local-transactions"))
    ctl.open()
    pair.run()
    declare = Message(body=Described(ulong(0x31), [None])).encode()
    _send(pair, ctl, declare, b"declare-1")
    txn = server.txn_ids[-1]
    snd = _sender(pair, ssn, "txn-snd", QUEUE)
    txn_msg = sample_messages()[0]
    _send(pair, snd, txn_msg, b"txn-msg-1", txn=txn)
    rcv = _receiver(pair, ssn, "txn-rcv", QUEUE)
    _settle_incoming(pair, rcv, [Delivery.ACCEPTED], txn=txn)
    commit = Message(body=Described(ulong(0x32), [txn, False])).encode()
    _send(pair, ctl, commit, b"discharge-1")
    declare2 = Message(body=Described(symbol("amqp:declare:list"), [None])).encode()
    _send(pair, ctl, declare2, b"declare-2")
    rollback = Message(body=Described(symbol("amqp:discharge:list"), [server.txn_ids[-1], True])).encode()
    _send(pair, ctl, rollback, b"discharge-2")
    for link in (ctl, snd, rcv):
        link.close()
    pair.run()
    ssn.close()
    pair.conn.close()
    pair.run()
    return Conversation("txn", tuple(split_frames(bytes(pair.sent), pair.turns)),
                        (declare, txn_msg, commit, declare2, rollback))


def build() -> list[Conversation]:
    return [basic(), presettled_and_multiframe(), jms_consumer(), transactions()]


__all__ = [
    "AMQP_HEADER",
    "CONTAINER_ID",
    "PERFORMATIVES",
    "QUEUE",
    "SASL_HEADER",
    "Conversation",
    "Frame",
    "build",
    "frame_bytes",
    "make_frame",
    "sample_messages",
    "split_frames",
]
