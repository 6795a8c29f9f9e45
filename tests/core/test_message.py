import pytest
from proton import Message as PnMessage, symbol

from amqpbroker.core.message import MalformedMessage, Message, selector_lookup
from tests.core.helpers import make_message


def test_header_fields_and_routing_properties():
    m = make_message("b", durable=True, priority=7, ttl=2.5, subject="a.b", address="q", id="m1",
                     group_id="g", properties={"color": "red"})
    assert (m.durable, m.priority, m.ttl) == (True, 7, 2500)
    assert m.prop("subject") == "a.b" and m.prop("to") == "q" and m.group_id() == "g"
    assert m.application_properties == {"color": "red"}
    assert m.body() == "b"


def test_defaults_without_header():
    m = Message(PnMessage(body="x").encode())
    assert (m.durable, m.priority, m.ttl, m.delivery_count) == (False, 4, None, 0)


def test_encoded_rewrites_only_the_header():
    m = make_message("payload", durable=True, priority=2, properties={"k": 1})
    assert m.encoded(0) == m.raw
    out = PnMessage()
    out.decode(m.encoded(3))
    assert (out.delivery_count, out.durable, out.priority, out.body, out.properties) == (3, True, 2, "payload", {"k": 1})


def test_message_without_header_gets_one_on_redelivery():
    m = Message(PnMessage(body="x").encode())
    out = PnMessage()
    out.decode(m.encoded(1))
    assert out.delivery_count == 1 and out.body == "x"


def test_delivery_annotations():
    now = 1000.0
    m = make_message("x", arrival=now, annotations={symbol("x-opt-delivery-delay"): 1500})
    assert m.delivery_time() == pytest.approx(1001.5)
    m2 = make_message("x", annotations={symbol("x-opt-delivery-time"): 5_000_000})
    assert m2.delivery_time() == 5000.0


def test_malformed_payload():
    with pytest.raises(MalformedMessage):
        Message(b"garbage")
    with pytest.raises(MalformedMessage):
        Message(b"\x00\x53\x77\xa1\x10short")


def test_selector_lookup_maps_jms_headers():
    m = make_message("x", durable=True, priority=6, subject="car", id="ID:1", correlation_id="c",
                     group_id="g", creation_time=12.0, properties={"color": "blue"})
    look = selector_lookup(m, 2)
    assert look("JMSType") == "car" and look("JMSPriority") == 6
    assert look("JMSDeliveryMode") == "PERSISTENT" and look("JMSXDeliveryCount") == 3
    assert look("JMSMessageID") == "ID:1" and look("JMSCorrelationID") == "c"
    assert look("JMSXGroupID") == "g" and look("JMSTimestamp") == 12000
    assert look("color") == "blue" and look("missing") is None


@pytest.mark.parametrize("fields, expected", [
    # durable, priority, ttl, first-acquirer, delivery-count in the encodings seen on the wire
    (b"\xc0\x0c\x05\x41\x50\x07\x70\x00\x00\x27\x10\x42\x52\x03", (True, 7, 10000, False, 3)),
    (b"\xc0\x09\x05\x56\x01\x40\x52\x05\x56\x01\x43", (True, 4, 5, True, 0)),
    (b"\x45", (False, 4, None, False, 0)),
    (b"\xd0\x00\x00\x00\x07\x00\x00\x00\x02\x42\x50\x09", (False, 9, None, False, 0)),
    # ttl as a ulong is not the header's type but decodes through the general path
    (b"\xc0\x0c\x03\x41\x40\x80\x00\x00\x00\x00\x00\x00\x00\x64", (True, 4, 100, False, 0)),
])
def test_header_encodings(fields, expected):
    msg = Message(b"\x00\x53\x70" + fields + b"\x00\x53\x75\xa0\x01x")
    assert (msg.durable, msg.priority, msg.ttl, msg.first_acquirer, msg.delivery_count) == expected


def test_bad_header_is_malformed():
    with pytest.raises(MalformedMessage):
        Message(b"\x00\x53\x70\xa1\x01x")   # a string, not a list


def test_routing_fields_read_without_decoding_other_properties():
    long = PnMessage(id="ID:1", address="q", group_id="g-1", expiry_time=2_000_000_000.0, body="x")
    msg = Message(long.encode())
    assert msg._props is None
    assert msg.group_id() == "g-1"
    assert msg.expiry_time() == pytest.approx(2_000_000_000.0)
    assert msg._props is None, "group-id and absolute-expiry-time alone do not decode the list"
    short = Message(PnMessage(id="ID:2", address="q", body="x").encode())   # list ends before them
    assert short.group_id() is None and short.expiry_time() is None
    assert Message(PnMessage(id="ID:3", group_id="g-3", body="x").encode()).prop("group_id") == "g-3"


# --------------------------------------------------------------------------- hostile messages

from amqpbroker.core.message import selector_accepts  # noqa: E402
from amqpbroker.core.selectors import compile_selector  # noqa: E402
from tests.poison import CASES, OPAQUE, REJECT  # noqa: E402


def _edge(raw: bytes) -> Message:
    """What the connection handler does before routing."""
    msg = Message(raw)
    msg.routing_times()
    return msg


@pytest.mark.parametrize("raw", [raw for raw, what in CASES.values() if what == REJECT],
                         ids=[name for name, (_, what) in CASES.items() if what == REJECT])
def test_malformed_routing_fields_are_malformed_at_the_edge(raw):
    with pytest.raises(MalformedMessage):
        _edge(raw)


@pytest.mark.parametrize("raw", [raw for raw, what in CASES.values() if what == OPAQUE],
                         ids=[name for name, (_, what) in CASES.items() if what == OPAQUE])
def test_malformed_application_properties_pass_the_edge_and_match_no_selector(raw):
    msg = _edge(raw)
    for text in ("k IS NULL", "k IS NOT NULL", "deep = 'x'", "JMSPriority = 4"):
        assert selector_accepts(compile_selector(text), msg, 0) is False
    with pytest.raises(MalformedMessage):
        msg.application_properties
    with pytest.raises(MalformedMessage):   # the failure is remembered, not decoded again
        msg.application_properties
    assert msg.encoded(1).endswith(msg.raw[msg._header_end:])   # redelivery still works


def test_selectors_compare_odd_values_without_raising():
    msg = Message(encode_app(k=[1, 2], d={"a": 1}, b=b"\x00", n=None))
    for text in ("k > 1", "d = 'x'", "b LIKE 'a%'", "k + 1 = 2", "n IN ('a')", "k BETWEEN 1 AND 2"):
        assert selector_accepts(compile_selector(text), msg, 0) is False


def encode_app(**props):
    from amqpbroker.core.codec import encode
    return b"\x00\x53\x74" + encode(props) + b"\x00\x53\x77\xa1\x01x"


def _app_properties(items: bytes, count: int) -> bytes:
    import struct
    return (b"\x00\x53\x74\xd1" + struct.pack(">II", len(items) + 4, count) + items
            + b"\x00\x53\x77\xa1\x01x")


def _many_properties(n: int) -> bytes:
    items = bytearray()
    for i in range(n):
        key = b"k%d" % i
        items += b"\xa1" + bytes([len(key)]) + key + b"\x52\x05"
    return _app_properties(bytes(items), 2 * n)


def _one_long_list(n: int) -> bytes:
    import struct
    return _app_properties(b"\xa1\x01a\xd0" + struct.pack(">II", n + 4, n) + b"\x40" * n, 2)


@pytest.mark.parametrize("raw", [_many_properties(200_000), _one_long_list(1_000_000)],
                         ids=["200k properties", "a list of 1M values"])
def test_application_properties_of_huge_counts_are_not_decoded(raw):
    """Decoding application-properties costs about a microsecond a value, on the
    loop, at the first selector that asks (a consumer's, a subscription's), a browse
    or a dead-lettering: an 11 MB message of a million properties held it 2.9 s, a
    100 MiB one would hold it half a minute.  Past MAX_PROPERTY_VALUES values the
    section is malformed for the broker: selectors do not match it (it stays for
    consumers without one), the bytes go on untouched."""
    from amqpbroker.core.message import MAX_PROPERTY_VALUES
    assert MAX_PROPERTY_VALUES < 200_000
    msg = Message(raw)
    with pytest.raises(MalformedMessage, match="values"):
        msg.application_properties
    assert selector_accepts(compile_selector("k5 = 5 OR a IS NOT NULL"), Message(raw), 0) is False
    assert msg.raw == raw


def test_ordinary_application_properties_still_decode():
    raw = _many_properties(500)
    assert Message(raw).application_properties["k499"] == 5
    assert selector_accepts(compile_selector("k5 = 5"), Message(raw), 0) is True


def test_dead_letter_marking_does_not_walk_a_huge_properties_map():
    """core/sections.py steps over values but decodes every key: the same map, on the
    dead-lettering path, is refused before the walk; the copy is marked in its
    annotations only (as for properties that cannot be walked) and the properties
    keep their bytes."""
    from amqpbroker.core.deadletters import DLQ_QUEUE, mark_dead_lettered
    raw = _many_properties(200_000)
    marked = mark_dead_lettered(raw, "q", "q", "rejected", 0)
    assert marked.endswith(raw)                                   # properties and body as they were
    assert Message(marked).annotations[DLQ_QUEUE] == "q"


def test_message_annotations_of_huge_counts_are_not_decoded_at_the_edge():
    """Every message naming `x-opt-delivery-` in its annotations has them decoded when
    it arrives (its delivery time): with a million entries besides, 2.9 s of the loop
    per message for any producer.  Beyond MAX_PROPERTY_VALUES values it is malformed
    (the edge rejects it with amqp:decode-error)."""
    import struct
    items = bytearray(b"\xa3\x13x-opt-delivery-time\x81" + (1).to_bytes(8, "big"))
    for i in range(100_000):
        key = b"k%d" % i
        items += b"\xa3" + bytes([len(key)]) + key + b"\x40"
    raw = (b"\x00\x53\x72\xd1" + struct.pack(">II", len(items) + 4, 2 * 100_001) + bytes(items)
           + b"\x00\x53\x77\xa1\x01x")
    with pytest.raises(MalformedMessage, match="values"):
        Message(raw).routing_times()
    from amqpbroker.core.sections import MESSAGE_ANNOTATIONS, SectionError, read_map
    with pytest.raises(SectionError, match="values"):       # moves and dead-lettering read it so
        read_map(raw, MESSAGE_ANNOTATIONS)
