"""Access control over every side effect of an attach or a request, not only its own
address: another user cannot take over a link by reusing a container-id, cannot
recreate (and so empty) a durable subscription it may not consume, and cannot make
the broker write control-address replies where it may not send.
docs/operations.md: "Who may steal, replace and unsubscribe"."""

from __future__ import annotations

import re
import uuid

import pytest
from proton import Delivery, Endpoint, Message
from proton.utils import SendException

from tests.broker_process import BrokerProcess
from tests.client import connect
from tests.e2e.helpers_conn import RawClient
from tests.e2e.jms_links import detach, durable_consumer, null_source_attach, shared_consumer

pytestmark = pytest.mark.e2e

CONFIG = """
[users.admin]
password = "admin-pw"
groups = ["ops"]
[users.bob]
password = "bob-pw"
groups = ["public-apps"]

[[acl]]
group = "ops"
permissions = ["all"]

[[acl]]
group = "public-apps"
pattern = "public.#"
permissions = ["send", "consume"]

[[acl]]
group = "public-apps"
pattern = "spark.#"
permissions = ["browse"]

[[acl]]
group = "public-apps"
pattern = "$amqpbroker.queue-info"
permissions = ["send"]

[anonymous]
pattern = "public.#"
permissions = ["send", "consume"]
"""

PASSWORDS = {"admin": "admin-pw", "bob": "bob-pw"}


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory):
    proc = BrokerProcess(tmp_path_factory.mktemp("acl-side") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def login(broker, user: str, container_id: str | None = None):
    return connect(broker.url, container_id=container_id or uniq(user), user=user, password=PASSWORDS[user],
                   allowed_mechs="PLAIN", allow_insecure_mechs=True)


def raw(broker, user: str | None, container_id: str) -> RawClient:
    if user is None:
        return RawClient(broker.host, broker.port, container_id=container_id).wait_open()
    return RawClient(broker.host, broker.port, container_id=container_id, sasl_mechs="PLAIN", user=user,
                     password=PASSWORDS[user]).wait_open()


def publish(broker, address: str, bodies: list[str]) -> None:
    conn = login(broker, "admin")
    snd = conn.create_sender(address)
    for body in bodies:
        snd.send(Message(body=body, durable=True))
    conn.close()


def drain(receiver, n: int) -> list:
    out = []
    for _ in range(n):
        out.append(receiver.receive(timeout=10).body)
        receiver.accept()
    return out


# ---------------------------------------------------------------------- link stealing


@pytest.mark.parametrize("thief", [None, "bob"], ids=["anonymous", "another-user"])
def test_another_user_cannot_steal_a_link_by_reusing_its_container_id(acl_broker, thief):
    container, name = uniq("app"), uniq("held")
    owner = raw(acl_broker, "admin", container)
    held = owner.receiver(owner.session(), "public.held", name)
    held.flow(10)
    intruder = raw(acl_broker, thief, container)
    attempt = intruder.receiver(intruder.session(), "public.held", name)
    assert attempt.state & Endpoint.REMOTE_CLOSED
    assert attempt.remote_condition.name == "amqp:unauthorized-access"
    assert "another user" in attempt.remote_condition.description
    # The owner's link was not touched: still attached, still served.
    owner.pump_for(0.3)
    assert not held.state & Endpoint.REMOTE_CLOSED, held.remote_condition
    publish(acl_broker, "public.held", ["for the owner"])
    owner.wait(lambda: held.current is not None and not held.current.partial, what="delivery")
    intruder.close()
    owner.close()
    acl_broker.wait_for_log(rf"attach of link '{name}' refused: amqp:unauthorized-access")


def test_the_same_user_still_takes_its_own_link_over(acl_broker):
    container, name = uniq("app"), uniq("mine")
    first = raw(acl_broker, "bob", container)
    old = first.receiver(first.session(), "public.mine", name)
    second = raw(acl_broker, "bob", container)
    new = second.receiver(second.session(), "public.mine", name)
    assert new.state & Endpoint.REMOTE_ACTIVE and not new.state & Endpoint.REMOTE_CLOSED
    first.wait(lambda: old.state & Endpoint.REMOTE_CLOSED or "PN_LINK_REMOTE_DETACH" in first.events,
               what="stolen")
    first.close()
    second.close()


# ---------------------------------------------------------------------- subscriptions


def test_another_user_cannot_recreate_a_global_shared_subscription(acl_broker):
    sub = uniq("mysub")
    admin = login(acl_broker, "admin")
    detach(admin, shared_consumer(admin, "amq.topic/secret.#", sub, global_=True))   # it stays
    admin.close()
    publish(acl_broker, "amq.topic/secret.x", ["s1", "s2", "s3"])
    bob = login(acl_broker, "bob")
    with pytest.raises(Exception) as refused:
        shared_consumer(bob, "public.x", sub, global_=True)
    assert "amqp:unauthorized-access" in str(refused.value)
    bob.close()
    admin = login(acl_broker, "admin")
    back = shared_consumer(admin, "amq.topic/secret.#", sub, global_=True)
    assert drain(back, 3) == ["s1", "s2", "s3"]            # backlog intact
    admin.close()


def test_another_user_in_the_same_namespace_cannot_recreate_or_unsubscribe(acl_broker):
    client_id, sub = uniq("app-1"), uniq("dsub")
    admin = login(acl_broker, "admin", client_id)
    detach(admin, durable_consumer(admin, "amq.topic/secret.#", sub))
    admin.close()
    publish(acl_broker, "amq.topic/secret.y", ["d1", "d2"])
    bob = login(acl_broker, "bob", client_id)                # claims admin's client-id
    with pytest.raises(Exception) as refused:
        durable_consumer(bob, "public.y", sub)
    assert "amqp:unauthorized-access" in str(refused.value)
    bob.close()
    bob = login(acl_broker, "bob", client_id)
    with pytest.raises(Exception) as lookup:
        null_source_attach(bob, sub)                         # the unsubscribe lookup
    assert "amqp:unauthorized-access" in str(lookup.value)
    bob.close()
    admin = login(acl_broker, "admin", client_id)
    back = durable_consumer(admin, "amq.topic/secret.#", sub)
    assert drain(back, 2) == ["d1", "d2"]
    admin.close()


def test_recreating_a_subscription_one_may_consume_still_works(acl_broker):
    sub = uniq("own")
    bob = login(acl_broker, "bob")
    detach(bob, durable_consumer(bob, "public.a", sub))
    again = durable_consumer(bob, "public.b", sub)           # another topic: recreated
    publish(acl_broker, "amq.topic/public.b", ["b1"])
    assert drain(again, 1) == ["b1"]
    bob.close()


# ---------------------------------------------------------------------- control-address replies


def _queue_info_request(reply_to: str) -> Message:
    return Message(properties={"queue": "spark.events"}, reply_to=reply_to, id=uniq("req"))


@pytest.mark.parametrize("reply_to", ["secret", "amq.topic/secret.z"])
def test_control_replies_never_go_where_the_requester_may_not_send(acl_broker, reply_to):
    admin = login(acl_broker, "admin")
    watch = admin.create_receiver(reply_to, credit=10)      # would see an injected reply
    bob = login(acl_broker, "bob")
    snd = bob.create_sender("$amqpbroker.queue-info")
    with pytest.raises(SendException) as rejected:
        snd.send(_queue_info_request(reply_to))
    assert rejected.value.state == Delivery.REJECTED
    bob.close()
    with pytest.raises(Exception):
        watch.receive(timeout=0.5)                         # nothing was written there
    admin.close()
    acl_broker.wait_for_log(rf"access denied: user 'bob' is not allowed to send on '{re.escape(reply_to)}'")


def test_control_replies_go_to_the_requesters_own_reply_queue(acl_broker):
    bob = login(acl_broker, "bob")
    replies = bob.create_receiver(None, dynamic=True)
    reply_to = replies.remote_source.address
    bob.create_sender("$amqpbroker.queue-info").send(_queue_info_request(reply_to))
    info = replies.receive(timeout=10)
    replies.accept()
    assert info.properties["queue"] == "spark.events"
    bob.close()
