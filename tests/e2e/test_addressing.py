"""End-to-end: addresses, exchanges, bindings and routing (the Qpid Broker-J model).

A real broker process; python-qpid-proton clients.  Most tests share the module's
default broker and keep apart by unique queue names / topic words; the tests of
declared entities and of `auto_create_queues = false` share one configured broker.
"""

from __future__ import annotations

import pytest
from proton import Delivery, Message, symbol

from tests.broker_process import BrokerProcess
from tests.client import SourceOptions, is_null_terminus
from tests.e2e.helpers_delivery import (
    TargetOptions,
    connection,
    drain_bodies,
    expect_refused,
    fetch_body,
    receiver,
    sender,
    nothing_arrives,
    send,
    send_bodies,
    uid,
    wait_settled,
    word,
)

pytestmark = pytest.mark.e2e

CONFIGURED = """
[policy]
auto_create_queues = false

[[exchanges]]
name = "orders"
type = "direct"

[[exchanges]]
name = "events"
type = "topic"

[[exchanges]]
name = "bcast"
type = "fanout"

[[queues]]
name = "orders-new"

[[queues]]
name = "orders-paid"

[[queues]]
name = "audit"

[[queues]]
name = "bcast-a"

[[queues]]
name = "bcast-b"

[[queues]]
name = "plain"

[[bindings]]
exchange = "orders"
queue = "orders-new"
key = "new"

[[bindings]]
exchange = "orders"
queue = "orders-paid"
key = "paid"

[[bindings]]
exchange = "events"
queue = "audit"
key = "order.*"

[[bindings]]
exchange = "bcast"
queue = "bcast-a"

[[bindings]]
exchange = "bcast"
queue = "bcast-b"
key = "ignored"
"""


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    """Declared exchanges/queues/bindings, and no auto-created queues."""
    proc = BrokerProcess(tmp_path_factory.mktemp("configured") / "data", config=CONFIGURED).start()
    yield proc
    proc.stop()


# --------------------------------------------------------------------------- queues


def test_queue_auto_created_by_sender_attach_keeps_messages(broker):
    q = uid("auto")
    with connection(broker) as conn:
        send_bodies(conn, q, ["one", "two"])
    # A later connection finds the queue the sender's attach created, with its messages.
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=10)
        assert drain_bodies(conn, rcv) == ["one", "two"]


def test_queue_auto_created_by_receiver_attach(broker):
    q = uid("auto-rcv")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=10)
        assert rcv.link.remote_source.address == q
        send_bodies(conn, q, ["hello"])
        assert fetch_body(conn, rcv) == "hello"


def test_auto_create_off_refuses_sender_with_null_target_and_not_found(configured):
    with connection(configured) as conn:
        exc = expect_refused(conn.create_sender, "no-such-queue")
        assert exc.condition == "amqp:not-found"
        assert is_null_terminus(exc.link.remote_target)
        # The connection survives the refusal: a declared queue still works.
        send_bodies(conn, "plain", ["still-ok"])
        rcv = receiver(conn, "plain", credit=1)
        assert fetch_body(conn, rcv) == "still-ok"


def test_auto_create_off_refuses_receiver_with_null_source_and_not_found(configured):
    with connection(configured) as conn:
        exc = expect_refused(conn.create_receiver, "no-such-queue", credit=1)
        assert exc.condition == "amqp:not-found"
        assert is_null_terminus(exc.link.remote_source)
        # `exchange/key` with an unknown exchange is not found either.
        exc = expect_refused(conn.create_receiver, "no-such-exchange/key", credit=1)
        assert exc.condition == "amqp:not-found"
        assert is_null_terminus(exc.link.remote_source)


def test_auto_create_off_still_allows_exchange_subscriptions(configured):
    """Private subscription queues are not "auto-created queues"."""
    with connection(configured) as conn:
        rcv = receiver(conn, "events/misc.created", credit=5)
        send(conn, "events/misc.created", Message(body="sub"))
        assert fetch_body(conn, rcv) == "sub"


# --------------------------------------------------------------------------- declared entities


def test_declared_direct_exchange_routes_by_address_key_and_subject(configured):
    with connection(configured) as conn:
        send(conn, "orders/new", Message(body="by-key"))          # <exchange>/<key>
        send(conn, "orders", Message(body="by-subject", subject="paid"))  # <exchange>, subject
        send(conn, "orders/nobody", Message(body="unbound"))      # routed nowhere, accepted
        new = receiver(conn, "orders-new", credit=10)       # <queue>
        paid = receiver(conn, "orders-paid", credit=10)
        assert drain_bodies(conn, new) == ["by-key"]
        assert drain_bodies(conn, paid) == ["by-subject"]


def test_declared_topic_exchange_binding_pattern(configured):
    with connection(configured) as conn:
        send(conn, "events/order.created", Message(body="a"))
        send(conn, "events/order.created.late", Message(body="too-deep"))
        send(conn, "events/invoice.created", Message(body="other"))
        send(conn, "events", Message(body="b", subject="order.paid"))
        audit = receiver(conn, "audit", credit=10)
        assert drain_bodies(conn, audit) == ["a", "b"]


def test_declared_fanout_exchange_reaches_every_bound_queue(configured):
    with connection(configured) as conn:
        send(conn, "bcast/whatever", Message(body="to-all"))
        a = receiver(conn, "bcast-a", credit=10)
        b = receiver(conn, "bcast-b", credit=10)
        assert drain_bodies(conn, a) == ["to-all"]
        assert drain_bodies(conn, b) == ["to-all"]


# --------------------------------------------------------------------------- built-in exchanges


def test_builtin_direct_exchange_exact_match_only(broker):
    k = word()
    with connection(broker) as conn:
        exact = receiver(conn, f"amq.direct/{k}", credit=10)
        deeper = receiver(conn, f"amq.direct/{k}.x", credit=10)
        wildcard = receiver(conn, f"amq.direct/{k}.*", credit=10)  # no wildcards on direct
        send(conn, f"amq.direct/{k}", Message(body="k"))
        send(conn, f"amq.direct/{k}.x", Message(body="k.x"))
        send(conn, f"amq.direct/{k}.y", Message(body="k.y"))
        assert drain_bodies(conn, exact) == ["k"]
        assert drain_bodies(conn, deeper) == ["k.x"]
        assert drain_bodies(conn, wildcard) == []


def test_builtin_fanout_exchange_delivers_to_all_ignoring_keys(broker):
    with connection(broker) as conn:
        r1 = receiver(conn, "amq.fanout", credit=10)
        r2 = receiver(conn, "amq.fanout", credit=10)
        r3 = receiver(conn, f"amq.fanout/{word()}", credit=10)
        body = uid("fan")
        send(conn, f"amq.fanout/{word()}", Message(body=body))
        for r in (r1, r2, r3):
            assert drain_bodies(conn, r) == [body]


def test_builtin_topic_exchange_key_in_address(broker):
    w = word()
    with connection(broker) as conn:
        rcv = receiver(conn, f"amq.topic/{w}.prices", credit=10)
        send(conn, f"amq.topic/{w}.prices", Message(body="p"))
        send(conn, f"amq.topic/{w}.volumes", Message(body="v"))
        assert drain_bodies(conn, rcv) == ["p"]


def test_topic_patterns_star_and_hash(broker):
    w = word()
    x = word()
    patterns = {
        f"{w}.*": {f"{w}.a", f"{w}.c", f"{w}.ab"},
        f"{w}.#": {w, f"{w}.a", f"{w}.c", f"{w}.ab", f"{w}.a.b", f"{w}.a.c", f"{w}.b.c", f"{w}.a.b.c"},
        f"{w}.*.c": {f"{w}.a.c", f"{w}.b.c"},
        f"{w}.#.c": {f"{w}.c", f"{w}.a.c", f"{w}.b.c", f"{w}.a.b.c"},
        f"{w}.a": {f"{w}.a"},
        f"{w}.a.#": {f"{w}.a", f"{w}.a.b", f"{w}.a.c", f"{w}.a.b.c"},
        f"*.{x}": {f"a.{x}"},
        f"#.{x}": {x, f"a.{x}", f"a.b.{x}"},
        f"{w}.*.*": {f"{w}.a.b", f"{w}.a.c", f"{w}.b.c"},
    }
    keys = [w, f"{w}.a", f"{w}.c", f"{w}.ab", f"{w}.a.b", f"{w}.a.c", f"{w}.b.c", f"{w}.a.b.c",
            x, f"a.{x}", f"a.b.{x}", f"{x}.a"]
    with connection(broker) as conn:
        receivers = {p: receiver(conn, f"amq.topic/{p}", credit=50) for p in patterns}
        snd = sender(conn, "amq.topic")
        for k in keys:
            snd.send(Message(body=k, subject=k))   # routed by subject (no key in the address)
        snd.close()
        got = {p: drain_bodies(conn, r) for p, r in receivers.items()}
    for p, expected in patterns.items():
        assert sorted(got[p]) == sorted(expected), f"pattern {p!r}"


def test_receiver_on_topic_exchange_without_key_gets_everything(broker):
    with connection(broker) as conn:
        rcv = receiver(conn, "amq.topic", credit=10)   # bound with '#'
        send(conn, f"amq.topic/{word()}.x.y", Message(body="keyed"))
        send(conn, "amq.topic", Message(body="subject", subject=f"{word()}"))
        send(conn, "amq.topic", Message(body="no-key-at-all"))
        assert drain_bodies(conn, rcv) == ["keyed", "subject", "no-key-at-all"]


def test_sender_to_exchange_address_key_wins_over_subject(broker):
    k = word()
    with connection(broker) as conn:
        rcv = receiver(conn, f"amq.direct/{k}", credit=10)
        send(conn, "amq.direct", Message(body="by-subject", subject=k))
        send(conn, "amq.direct", Message(body="other-subject", subject=word()))
        send(conn, f"amq.direct/{k}", Message(body="key-over-subject", subject=word()))
        send(conn, f"amq.direct/{word()}", Message(body="other-key", subject=k))
        assert drain_bodies(conn, rcv) == ["by-subject", "key-over-subject"]


# --------------------------------------------------------------------------- private subscriptions


def test_exchange_subscription_queue_disappears_on_detach(broker):
    w = word()
    address = f"amq.topic/{w}.news"
    with connection(broker) as conn:
        rcv = receiver(conn, address, credit=10)
        send(conn, address, Message(body="while-attached"))
        assert fetch_body(conn, rcv) == "while-attached"
        # One more that is delivered but left unsettled when the link goes.
        send(conn, address, Message(body="unsettled-at-detach"))
        conn.wait(lambda: rcv.fetcher.has_message, timeout=10)
        rcv.close()
        send(conn, address, Message(body="while-detached"))
        again = receiver(conn, address, credit=10)
        # Nothing old: not the unsettled one, not the one sent while detached.
        assert nothing_arrives(conn, again)
        send(conn, address, Message(body="after"))
        assert drain_bodies(conn, again) == ["after"]


def test_two_receivers_on_same_exchange_address_each_get_a_copy(broker):
    """Private subscriptions: one queue per link, not competing consumers."""
    address = f"amq.topic/{word()}"
    with connection(broker) as conn:
        a = receiver(conn, address, credit=10)
        b = receiver(conn, address, credit=10)
        send_bodies(conn, address, ["1", "2", "3"])
        assert drain_bodies(conn, a) == ["1", "2", "3"]
        assert drain_bodies(conn, b) == ["1", "2", "3"]


def test_receivers_on_queue_compete(broker):
    """Contrast with exchanges: two receivers on a queue share its messages."""
    q = uid("compete")
    with connection(broker) as conn:
        a = receiver(conn, q, credit=10)
        b = receiver(conn, q, credit=10)
        send_bodies(conn, q, [str(i) for i in range(6)])
        got_a, got_b = drain_bodies(conn, a), drain_bodies(conn, b)
        assert sorted(got_a + got_b, key=int) == [str(i) for i in range(6)]
        assert got_a and got_b


def test_to_is_ignored_on_a_sender_with_a_target_address(broker):
    a, b = uid("target"), uid("not-to")
    with connection(broker) as conn:
        send(conn, a, Message(body="m", address=b))
        assert drain_bodies(conn, receiver(conn, a, credit=10)) == ["m"]
        assert drain_bodies(conn, receiver(conn, b, credit=10)) == []


# --------------------------------------------------------------------------- anonymous relay


def test_anonymous_relay_routes_by_to(broker):
    q = uid("relay")
    k = word()
    with connection(broker) as conn:
        topic_rcv = receiver(conn, f"amq.topic/{k}.#", credit=10)
        snd = sender(conn, None)
        assert snd.link.remote_target.address is None
        snd.send(Message(body="to-queue", address=q))              # auto-creates the queue
        snd.send(Message(body="to-topic", address=f"amq.topic/{k}.a"))
        snd.send(Message(body="to-exchange-subject", address="amq.topic", subject=f"{k}.b"))
        snd.close()
        qrcv = receiver(conn, q, credit=10)
        assert drain_bodies(conn, qrcv) == ["to-queue"]
        assert drain_bodies(conn, topic_rcv) == ["to-topic", "to-exchange-subject"]


def test_anonymous_relay_jms_topic_annotation(broker):
    """Qpid JMS marks topic destinations with x-opt-jms-dest = 1."""
    name = f"{word()}.jms"
    with connection(broker) as conn:
        rcv = receiver(conn, f"amq.topic/{name}", credit=10)
        snd = sender(conn, None)
        snd.send(Message(body="topic", address=name, annotations={symbol("x-opt-jms-dest"): 1}))
        snd.close()
        assert drain_bodies(conn, rcv) == ["topic"]


def test_anonymous_relay_unroutable_to_is_rejected(configured):
    with connection(configured) as conn:
        snd = sender(conn, None)
        dlv = snd.link.send(Message(body="lost", address="no-such-queue"))
        wait_settled(conn, dlv)
        assert dlv.remote_state == Delivery.REJECTED
        assert dlv.remote.condition is not None
        assert dlv.remote.condition.name == "amqp:not-found"
        # The link stays usable: a routable message on the same link is accepted.
        ok = snd.link.send(Message(body="found", address="plain"))
        wait_settled(conn, ok)
        assert ok.remote_state == Delivery.ACCEPTED
        # ... and one without any `to` is rejected too.
        none = snd.link.send(Message(body="no-to"))
        wait_settled(conn, none)
        assert none.remote_state == Delivery.REJECTED
        rcv = receiver(conn, "plain", credit=10)
        assert drain_bodies(conn, rcv) == ["found"]


# --------------------------------------------------------------------------- JMS topics


def test_topic_capability_on_plain_name_subscribes_to_amq_topic(broker):
    name = f"{word()}.sports"
    with connection(broker) as conn:
        rcv = receiver(conn, name, credit=10, options=SourceOptions(capabilities=["topic"]))
        send(conn, f"amq.topic/{name}", Message(body="via-exchange"))
        send(conn, name, Message(body="jms-producer"), options=TargetOptions(["topic"]))
        # Without the capability the same plain name is a (new) queue, not the topic.
        send(conn, name, Message(body="to-a-queue"))
        assert drain_bodies(conn, rcv) == ["via-exchange", "jms-producer"]
        qrcv = receiver(conn, name, credit=10)
        assert drain_bodies(conn, qrcv) == ["to-a-queue"]


def test_topic_capability_with_wildcard_name(broker):
    w = word()
    with connection(broker) as conn:
        rcv = receiver(conn, f"{w}.*", credit=10, options=SourceOptions(capabilities=["topic"]))
        send(conn, f"amq.topic/{w}.a", Message(body="a"))
        send(conn, f"amq.topic/{w}.a.b", Message(body="a.b"))
        assert drain_bodies(conn, rcv) == ["a"]


def test_a_binding_key_of_many_hashes_does_not_hold_the_broker(broker):
    """A consumer's topic key `#.#.#.#.#.#.#.#.#.#.#.#.z` and a message whose subject has
    24 words: matching tried every way to share the words among the '#'s, and the
    broker's loop was held for half an hour (10 '#' against 20 words: 35 s)."""
    from tests.client import connect
    conn = connect(broker.url)
    try:
        key = ".".join(["#"] * 12 + ["z"])
        rcv = conn.create_receiver(f"amq.topic/{key}", credit=2)
        snd = conn.create_sender("amq.topic")
        snd.send(Message(subject=".".join(["a"] * 24), body="no"))            # answered at once
        snd.send(Message(subject=".".join(["a"] * 24 + ["z"]), body="yes"))
        assert rcv.receive(timeout=10).body == "yes"
    finally:
        conn.close()
