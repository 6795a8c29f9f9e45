"""The subscription registry applying decisions to the broker model (no sockets)."""

from __future__ import annotations

from amqpbroker.core.broker import Broker
from amqpbroker.core.registry import SubscriptionRegistry
from amqpbroker.core.subscriptions import GLOBAL_NAMESPACE, BindingSpec, Decision, DetachAction
from amqpbroker.core.terms import Durability, ExpiryPolicy, SourceTerms
from tests.core.helpers import RecordingConsumer, make_message

TOPIC = BindingSpec("amq.topic", "news")


def shared_durable_source(global_=True):
    caps = {"topic", "shared"} | ({"global"} if global_ else set())
    return SourceTerms(address="amq.topic/news", durable=Durability.UNSETTLED_STATE,
                       expiry_policy=ExpiryPolicy.NEVER, capabilities=frozenset(caps))


def attach(reg, name, container, source=None, binding=TOPIC):
    d = reg.decide(name, container, source, binding if source else None)
    assert d.decision is not Decision.REFUSE, d
    sub, queue = reg.apply(d, link_name=name, container_id=container, owner=None, now=0.0)
    consumer = RecordingConsumer(credit=100)
    queue.add_consumer(consumer)
    return sub, queue, consumer


def new_registry():
    broker = Broker()
    return broker, SubscriptionRegistry(broker, lambda sel, owner: None)


def test_global_links_n2_leave_no_registry_entry_after_plain_detach():
    broker, reg = new_registry()
    src = shared_durable_source()
    sub, queue, c1 = attach(reg, "s|global", "ID:a", src)
    _, _, c2 = attach(reg, "s|global2", "ID:a", src)
    assert (GLOBAL_NAMESPACE, "s|global2") in reg.links
    queue.remove_consumer(c2, [], failed=False)
    assert reg.detach(sub, "s|global2", closed=False) is DetachAction.KEEP
    assert (GLOBAL_NAMESPACE, "s|global2") not in reg.links
    assert (GLOBAL_NAMESPACE, "s|global") in reg.links


def test_unsubscribe_deletes_queue_and_every_registry_link():
    broker, reg = new_registry()
    src = shared_durable_source(global_=False)
    sub, queue, c1 = attach(reg, "s", "cid", src)
    _, _, c2 = attach(reg, "s|2", "cid", src)
    queue.remove_consumer(c2, [], failed=False)
    reg.detach(sub, "s|2", closed=False)
    queue.remove_consumer(c1, [], failed=False)
    reg.detach(sub, "s", closed=False)
    lookup_sub, lookup_queue, c3 = attach(reg, "s", "cid")       # null source lookup
    assert lookup_sub is sub
    lookup_queue.remove_consumer(c3, [], failed=False)
    assert reg.detach(sub, "s", closed=True) is DetachAction.DELETE
    assert sub.queue_name not in broker.queues
    assert reg.links == {} and reg.subscriptions == {}
    assert broker.exchanges["amq.topic"].bindings == []


def test_close_with_other_consumers_keeps_subscription_and_links():
    broker, reg = new_registry()
    src = shared_durable_source()
    sub, queue, c1 = attach(reg, "s|global", "ID:a", src)
    _, _, c2 = attach(reg, "s|global", "ID:b", src)
    queue.remove_consumer(c2, [], failed=False)
    assert reg.detach(sub, "s|global", closed=True) is DetachAction.REFUSE_LOCKED
    assert sub.queue_name in broker.queues and (GLOBAL_NAMESPACE, "s|global") in reg.links


def test_recreate_drops_backlog_and_rebinds():
    broker, reg = new_registry()
    src = shared_durable_source(global_=False)
    sub, queue, c1 = attach(reg, "s", "cid", src)
    queue.remove_consumer(c1, [], failed=False)
    c1._credit = 0
    queue.enqueue(make_message("old"))
    d = reg.decide("s", "cid", src, BindingSpec("amq.topic", "sports"))
    assert d.decision is Decision.RECREATE
    new_sub, new_queue = reg.apply(d, link_name="s", container_id="cid", owner=None, now=1.0)
    assert new_sub is not sub and new_queue.depth == 0
    assert [b.key for b in broker.bindings_of(new_queue)] == ["sports"]


# --- a subscription moved here from another node (cluster/moves.py)

def durable_source():
    return SourceTerms(address="amq.topic/news", durable=Durability.UNSETTLED_STATE,
                       expiry_policy=ExpiryPolicy.NEVER, capabilities=frozenset({"topic", "shared"}))


def test_decide_adoption_row_by_row():
    from amqpbroker.core.queues import ExclusivityPolicy
    from amqpbroker.core.subscriptions import Adoption, SubscriptionView, decide_adoption
    other = BindingSpec("amq.topic", "other")
    selected = BindingSpec("amq.topic", "news", "x = 1")
    view = SubscriptionView(ExclusivityPolicy.SHARED_SUBSCRIPTION, TOPIC, 0, durable_source())
    assert decide_adoption(None, TOPIC) is Adoption.ADOPT
    assert decide_adoption(view, TOPIC) is Adoption.KEEP            # an interrupted move resumed
    assert decide_adoption(view, other) is Adoption.REFUSE          # another topic: never merged
    assert decide_adoption(view, selected) is Adoption.REFUSE       # another selector, too


def test_adopt_makes_the_subscription_as_it_was_and_a_lookup_finds_it():
    from amqpbroker.core.subscriptions import Adoption
    _, old = new_registry()
    sub, queue, consumer = attach(old, "s", "cid", durable_source())
    queue.remove_consumer(consumer, [], failed=False)
    old.detach(sub, "s", closed=False)

    broker, reg = new_registry()
    saved = []
    reg.on_saved = saved.append
    verdict, made = reg.adopt(sub)
    assert verdict is Adoption.ADOPT and made is not sub
    assert (made.key, made.queue_name, made.binding, made.links) == (sub.key, sub.queue_name, sub.binding, {"s"})
    assert made.queue_name in broker.queues and broker.queues[made.queue_name].durable
    assert saved and saved[-1] is made
    # Bound to its topic here: a message published there reaches it.
    broker.publish(make_message(b"x"), broker.resolve("amq.topic/news", topic=True))
    assert broker.queues[made.queue_name].depth == 1
    # The client's null-source lookup (Qpid JMS, before unsubscribe) finds it.
    assert reg.decide("s", "cid", None, None).decision is Decision.ATTACH_EXISTING

    again, kept = reg.adopt(sub)
    assert again is Adoption.KEEP and kept is made and broker.queues[made.queue_name].depth == 1


def test_a_member_copy_is_the_subscription_bound_to_its_members_name():
    from amqpbroker.core.subscriptions import member_copy
    _, reg = new_registry()
    sub, queue, consumer = attach(reg, "s", "cid", durable_source(), BindingSpec("amq.topic", "news", "x = 1", True))
    copy = member_copy(sub, "amq.topic/news.p1")
    assert copy.binding == BindingSpec("amq.topic", "news.p1", "x = 1", True)
    assert copy.source.address == "amq.topic/news.p1" and copy.source.capabilities == sub.source.capabilities
    assert (copy.key, copy.queue_name, copy.links) == (sub.key, sub.queue_name, sub.links)
    copy.links.add("other")
    assert "other" not in sub.links and sub.binding.key == "news"   # the original untouched
