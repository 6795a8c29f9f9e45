"""Where a link or a message goes in a cluster (core/placement.py), row by row of the
table in its docstring."""

from __future__ import annotations

import re

import pytest

from amqpbroker.core.placement import (
    LOCAL,
    NOT_FOUND,
    NOT_IMPLEMENTED,
    PER_MESSAGE,
    UNAVAILABLE,
    Forward,
    LinkShape,
    client_home,
    Partitioned,
    Refuse,
    Scatter,
    SlotMap,
    member_address,
    owning_key,
    partition_members,
    partitioned_keys,
    place_link,
    place_message,
    replaces,
    slot_of,
    spread,
    static_map,
    temp_address,
    temp_node,
)

EXCHANGES = {"amq.topic": "topic", "amq.direct": "direct", "amq.fanout": "fanout",
             "events": "topic", "audit": "fanout"}
NODES = ("n0", "n1", "n2")


def owner_of(key: str, slots: SlotMap) -> str:
    return slots.owners[slot_of(key, slots.slots)]


def key_owned_by(node: str, slots: SlotMap, prefix: str = "q") -> str:
    """A name whose slot `node` holds (names are hashed: search a few)."""
    for i in range(10_000):
        name = f"{prefix}{i}"
        if owner_of(name, slots) == node:
            return name
    raise AssertionError(f"no key for {node}")


@pytest.fixture
def slots() -> SlotMap:
    return static_map(NODES)


def consumer(address, **kw) -> LinkShape:
    return LinkShape(consumer=True, address=address, **kw)


def producer(address, **kw) -> LinkShape:
    return LinkShape(consumer=False, address=address, **kw)


# ---------------------------------------------------------------------- slots and the map


def test_slot_of_is_stable_crc32():
    # The same on every node, every run, every Python (hash() is salted per process).
    # A changed hash would move every address of a running cluster: pinned here.
    assert slot_of("orders") == 0xE52FFDEE % 256 == 238
    assert {slot_of(f"q{i}") for i in range(5000)} == set(range(256))


def test_spread_gives_contiguous_runs_in_proportion_to_weights():
    owners = spread(["a", "b"], {"a": 1, "b": 3}, slots=256)
    assert owners.count("a") == 64 and owners.count("b") == 192
    assert owners[:64] == ("a",) * 64


def test_a_node_of_weight_zero_owns_nothing():
    owners = spread(["edge", "a", "b"], {"edge": 0})
    assert "edge" not in owners and owners.count("a") == 128


def test_every_weight_zero_is_an_error():
    with pytest.raises(ValueError):
        spread(["a"], {"a": 0})


# ---------------------------------------------------------------------- owning keys


def test_key_topic_by_capability_and_by_path_is_the_same():
    by_cap = owning_key("orders", topic=True, exchanges=EXCHANGES)
    by_path = owning_key("amq.topic/orders", topic=False, exchanges=EXCHANGES)
    assert by_cap == by_path
    assert by_cap.key == "amq.topic/orders"


def test_key_queue_is_its_name():
    assert owning_key("orders", topic=False, exchanges=EXCHANGES).key == "orders"


def test_key_fanout_exchange_is_the_exchange_whatever_the_key():
    assert owning_key("audit/x", topic=False, exchanges=EXCHANGES).key == "audit"
    assert owning_key("audit", topic=False, exchanges=EXCHANGES).key == "audit"


def test_key_pinned_exchange_is_the_exchange():
    t = owning_key("events/a.b", topic=False, exchanges=EXCHANGES, pinned=frozenset({"events"}))
    assert t.key == "events" and not t.wildcard


def test_key_wildcards_are_seen_on_topic_exchanges_only():
    assert owning_key("events/a.*", topic=False, exchanges=EXCHANGES).wildcard
    assert owning_key("amq.topic/#", topic=False, exchanges=EXCHANGES).wildcard
    assert not owning_key("amq.direct/a.*", topic=False, exchanges=EXCHANGES).wildcard


@pytest.mark.parametrize("declared, keys", [
    ([("orders", False, 2)], {"orders": 2}),
    ([("prices", True, 3)], {"amq.topic/prices": 3}),
    ([("amq.topic/prices", False, 3)], {"amq.topic/prices": 3}),            # a topic named by path
    ([("orders", False, 2), ("orders", True, 2)], {"orders": 2, "amq.topic/orders": 2}),   # queue and topic
    ([("orders", False, 2), ("orders.p1.x", False, 2)], {"orders": 2, "orders.p1.x": 2}),
])
def test_partitioned_keys_row_by_row(declared, keys):
    assert partitioned_keys(declared, exchanges=EXCHANGES) == keys


@pytest.mark.parametrize("declared, pinned, said", [
    ([("prices.#", True, 2)], (), "a topic pattern"),
    ([("amq.topic/a.*.b", False, 2)], (), "a topic pattern"),
    ([("audit/k", False, 2)], (), "the whole exchange 'audit'"),                      # fanout
    ([("amq.fanout", False, 2)], (), "the whole exchange 'amq.fanout'"),
    ([("prices", True, 2)], ("amq.topic",), "the whole exchange 'amq.topic'"),        # pinned
    ([("orders", False, 2), ("orders", False, 3)], (), "'orders' is declared twice (2 and 3 members)"),
    ([("prices", True, 2), ("amq.topic/prices", False, 2)], (), "declared twice"),   # one topic, two spellings
    ([("orders.p1", False, 2), ("orders", False, 2)], (), "member of partitioned 'orders'"),
    ([("orders", False, 2), ("orders.p7", False, 2)], (), "member of partitioned 'orders'"),   # a former member
    ([("prices", True, 2), ("prices.p0", True, 2)], (), "member of partitioned 'amq.topic/prices'"),
])
def test_partitioned_keys_refuses_what_cannot_mean_one_destination(declared, pinned, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        partitioned_keys(declared, exchanges=EXCHANGES, pinned=frozenset(pinned))


def test_key_slash_under_an_unknown_exchange_is_a_queue_name():
    assert owning_key("nope/x", topic=False, exchanges=EXCHANGES).key == "nope/x"


# ---------------------------------------------------------------------- link rows


def test_row_queue_consumer_owned_here_is_local(slots):
    assert place_link(consumer(key_owned_by("n0", slots)), "n0", slots, EXCHANGES) is LOCAL


def test_row_queue_consumer_owned_elsewhere_is_forwarded_to_the_owner(slots):
    name = key_owned_by("n2", slots)
    assert place_link(consumer(name), "n0", slots, EXCHANGES) == Forward("n2", name)


def test_row_queue_producer_goes_where_its_consumers_go(slots):
    name = key_owned_by("n1", slots)
    assert place_link(producer(name), "n0", slots, EXCHANGES) == place_link(consumer(name), "n0", slots,
                                                                            EXCHANGES)


def test_row_topic_producer_and_subscriber_meet_on_the_topic_owner(slots):
    topic = key_owned_by("n1", slots, "amq.topic/t")[len("amq.topic/"):]
    sub = place_link(consumer(topic, topic=True), "n0", slots, EXCHANGES)
    pub = place_link(producer(f"amq.topic/{topic}"), "n0", slots, EXCHANGES)
    assert sub == pub == Forward("n1", f"amq.topic/{topic}")


def test_row_subscription_with_source_is_placed_by_its_topic_not_its_name(slots):
    # A shared durable subscription (`sub|global`) and a client-id one (`sub`): the
    # link name takes no part; the same topic gives the same node.
    topic = key_owned_by("n2", slots, "amq.topic/t")[len("amq.topic/"):]
    assert place_link(consumer(topic, topic=True), "n0", slots, EXCHANGES) == \
        Forward("n2", f"amq.topic/{topic}")


def test_row_fanout_exchange_consumer_and_producer_by_exchange(slots):
    owner = owner_of("audit", slots)
    expect = LOCAL if owner == "n0" else Forward(owner, "audit")
    assert place_link(consumer("audit"), "n0", slots, EXCHANGES) == expect
    assert place_link(producer("audit"), "n0", slots, EXCHANGES) == expect


def test_row_wildcard_subscription_on_unpinned_topic_exchange_is_refused(slots):
    placed = place_link(consumer("events/orders.*"), "n0", slots, EXCHANGES)
    assert isinstance(placed, Refuse) and placed.condition == NOT_IMPLEMENTED
    assert "orders.*" in placed.description


def test_row_consumer_of_a_topic_exchange_without_key_binds_everything_refused(slots):
    placed = place_link(consumer("events"), "n0", slots, EXCHANGES)
    assert isinstance(placed, Refuse) and "'#'" in placed.description


def test_row_wildcard_subscription_on_pinned_exchange_goes_to_its_owner():
    slots = SlotMap(static_map(NODES).owners, frozenset(NODES), pinned=frozenset({"events"}))
    owner = owner_of("events", slots)
    placed = place_link(consumer("events/orders.*"), "n9", slots, EXCHANGES)
    assert placed == Forward(owner, "events")


def test_row_null_source_receiver_is_asked_of_every_other_live_node(slots):
    placed = place_link(LinkShape(consumer=True, null_source=True), "n1", slots, EXCHANGES)
    assert placed == Scatter(("n0", "n2"))
    down = slots.with_live({"n1", "n2"})
    assert place_link(LinkShape(consumer=True, null_source=True), "n1", down, EXCHANGES) == Scatter(("n2",))


def test_row_producer_on_an_exchange_without_key_is_per_message(slots):
    assert place_link(producer("amq.topic"), "n0", slots, EXCHANGES) is PER_MESSAGE
    assert place_link(producer("events"), "n0", slots, EXCHANGES) is PER_MESSAGE


def test_row_anonymous_relay_is_per_message(slots):
    assert place_link(producer(None), "n0", slots, EXCHANGES) is PER_MESSAGE


def test_row_consumer_without_address_stays_to_be_refused_here(slots):
    assert place_link(consumer(None), "n0", slots, EXCHANGES) is LOCAL


@pytest.mark.parametrize("shape", [
    LinkShape(consumer=True, dynamic=True),
    LinkShape(consumer=False, dynamic=True),
    LinkShape(consumer=False, coordinator=True),
    LinkShape(consumer=False, address="$amqpbroker.queue-info"),
])
def test_row_dynamic_nodes_coordinator_and_controls_stay_here(slots, shape):
    assert place_link(shape, "n0", slots, EXCHANGES) is LOCAL


def test_row_temporary_address_goes_to_the_node_named_in_it(slots):
    addr = temp_address("queue", "n2", "abc123")
    assert temp_node(addr) == "n2"
    assert place_link(producer(addr), "n0", slots, EXCHANGES) == Forward("n2", addr)
    assert place_link(producer(addr), "n2", slots, EXCHANGES) is LOCAL


def test_row_single_broker_temporary_address_is_hashed_like_any_other(slots):
    assert temp_node("amqpbroker.temp-queue.abc123") is None


def test_row_owner_down_is_refused_unavailable_naming_node_and_key(slots):
    name = key_owned_by("n2", slots)
    placed = place_link(consumer(name), "n0", slots.with_live({"n0", "n1"}), EXCHANGES)
    assert isinstance(placed, Refuse) and placed.condition == UNAVAILABLE
    assert name in placed.description and "n2" in placed.description


def test_row_owner_down_but_it_is_this_node_is_local(slots):
    name = key_owned_by("n0", slots)
    assert place_link(consumer(name), "n0", slots.with_live(set()), EXCHANGES) is LOCAL


def test_row_partitioned_address_lists_members_on_distinct_nodes():
    base = static_map(NODES)
    slots = SlotMap(base.owners, base.live, partitioned={"orders": 3, "amq.topic/prices": 2})
    placed = place_link(consumer("orders"), "n0", slots, EXCHANGES)
    assert isinstance(placed, Partitioned)
    assert [m for m, _ in placed.members] == ["orders.p0", "orders.p1", "orders.p2"]
    assert sorted(n for _, n in placed.members) == sorted(NODES)
    topic = place_link(producer("prices", topic=True), "n0", slots, EXCHANGES)
    assert isinstance(topic, Partitioned) and topic.members[0][0] == "amq.topic/prices.p0"


def test_row_partition_member_named_directly_goes_to_its_members_node_and_beyond_them_takes_no_producer():
    base = static_map(NODES)
    slots = SlotMap(base.owners, base.live, partitioned={"orders": 3})
    members = dict(place_link(consumer("orders"), "n0", slots, EXCHANGES).members)
    for member, node in members.items():
        placed = place_link(consumer(member), "n0", slots, EXCHANGES)
        assert placed == (LOCAL if node == "n0" else Forward(node, member))
    # Beyond the member count a producer is refused: such a queue is a member dropped
    # from the configuration, whose messages the shovel moves into member 0
    # (cluster/shovel.py), so what it sent would never reach a consumer of that name.
    placed = place_link(LinkShape(consumer=False, address="orders.p3"), "n0", slots, EXCHANGES)
    assert isinstance(placed, Refuse) and placed.condition == NOT_FOUND, placed
    assert "'orders.p3' is not a member of partitioned 'orders' (3 members): use 'orders'" in placed.description
    assert place_message("orders.p3", False, "n0", slots, EXCHANGES) == placed
    # A consumer may read what is left there, at the hash of its name, as before.
    assert place_link(consumer(member_address("orders", 7)), "n0", slots, EXCHANGES) in (
        LOCAL, Forward("n1", "orders.p7"), Forward("n2", "orders.p7"))
    # Not a member's form (`²` is a digit to str.isdigit, not to int): an ordinary name, never an error.
    for name in ("orders.p\u00b2", "orders.p\u0663", "orders.p"):
        for link in (consumer(name), LinkShape(consumer=False, address=name)):
            assert place_link(link, "n0", slots, EXCHANGES) in (LOCAL, Forward("n1", name), Forward("n2", name))
    # Not a member name at all: an ordinary name.
    assert place_link(consumer("orders.px"), "n0", slots, EXCHANGES) in (
        LOCAL, Forward("n1", "orders.px"), Forward("n2", "orders.px"))


# ---------------------------------------------------------------------- message rows


def test_message_row_relay_to_queue_goes_to_its_owner(slots):
    name = key_owned_by("n1", slots)
    assert place_message(name, False, "n0", slots, EXCHANGES) == Forward("n1", name)


def test_message_row_relay_to_topic_by_jms_dest_annotation(slots):
    topic = key_owned_by("n2", slots, "amq.topic/t")[len("amq.topic/"):]
    assert place_message(topic, True, "n0", slots, EXCHANGES) == Forward("n2", f"amq.topic/{topic}")


def test_message_row_subject_on_a_keyless_exchange_producer(slots):
    key = key_owned_by("n1", slots, "amq.direct/k")[len("amq.direct/"):]
    assert place_message(None, False, "n0", slots, EXCHANGES, subject=key, exchange="amq.direct") == \
        Forward("n1", f"amq.direct/{key}")


def test_message_row_keyless_exchange_message_without_subject_has_the_empty_key(slots):
    """As alone (core/broker.py `route`): no subject is the key ""."""
    expected = owner_of("amq.direct/", slots)
    placed = place_message(None, False, "n0", slots, EXCHANGES, subject=None, exchange="amq.direct")
    assert placed == (LOCAL if expected == "n0" else Forward(expected, "amq.direct/"))
    assert place_message(None, False, expected, slots, EXCHANGES, subject="", exchange="amq.direct") is LOCAL


def test_message_row_keyless_exchange_subject_naming_a_partitioned_topic_goes_to_its_members():
    base = static_map(NODES)
    slots = SlotMap(base.owners, base.live, partitioned={"amq.topic/prices": 2})
    placed = place_message(None, False, "n0", slots, EXCHANGES, subject="prices", exchange="amq.topic")
    assert isinstance(placed, Partitioned) and placed.members[0][0] == "amq.topic/prices.p0"


def test_message_row_without_to_stays_here_to_be_rejected(slots):
    assert place_message(None, False, "n0", slots, EXCHANGES) is LOCAL


def test_message_row_to_a_temporary_queue_of_another_node(slots):
    addr = temp_address("queue", "n1", "f00")
    assert place_message(addr, False, "n0", slots, EXCHANGES) == Forward("n1", addr)


def test_row_client_id_has_one_home_node_on_every_node(slots):
    homes = {client_home(f"app-{i}", slots) for i in range(200)}
    assert homes == set(NODES)   # spread over the nodes
    assert client_home("app-7", slots) == client_home("app-7", static_map(NODES))   # the same everywhere
    edge = static_map(NODES, {"n0": 0})
    assert {client_home(f"app-{i}", edge) for i in range(200)} == {"n1", "n2"}


# ---------------------------------------------------------------------- readers of queues (the Spark source)


def test_queue_members_of_a_queue_is_its_owner(slots):
    from amqpbroker.core.placement import queue_members
    name = key_owned_by("n2", slots)
    assert queue_members(name, "n0", slots, EXCHANGES) == ((name, "n2"),)
    assert queue_members(name, "n2", slots, EXCHANGES) == ((name, "n2"),)


def test_queue_members_of_a_partitioned_queue_are_its_members():
    from amqpbroker.core.placement import queue_members
    base = static_map(NODES)
    slots = SlotMap(base.owners, base.live, partitioned={"orders": 3})
    members = queue_members("orders", "n0", slots, EXCHANGES)
    assert [a for a, _ in members] == ["orders.p0", "orders.p1", "orders.p2"]
    assert sorted(n for _, n in members) == sorted(NODES)


def test_queue_members_of_a_subscription_queue_are_anywhere(slots):
    from amqpbroker.core.placement import queue_members
    assert queue_members("qpidsub_/app_/sub_/durable", "n0", slots, EXCHANGES) is None


def test_queue_members_of_an_owner_that_is_away_still_names_it(slots):
    from amqpbroker.core.placement import queue_members
    name = key_owned_by("n1", slots)
    assert queue_members(name, "n0", slots.with_live({"n0", "n2"}), EXCHANGES) == ((name, "n1"),)


def test_row_a_subscription_queue_named_directly_is_served_where_the_client_is(slots):
    """It lives beside its topic, not at the hash of its name (a log reader connects to
    a node that holds it: the Spark source asks each)."""
    for address in ("qpidsub_/app_/sub_/durable", "qpidsub_/0f3e_/nondurable"):
        assert place_link(consumer(address), "n1", slots, EXCHANGES) is LOCAL
        assert place_link(producer(address), "n2", slots, EXCHANGES) is LOCAL


# ---------------------------------------------------------------------- after a change of the map


def test_misplaced_subscriptions_row_by_row():
    """A durable subscription is misplaced when its topic's owner is another node (live
    or not: ownership), or when its topic became partitioned; one on a topic owned here,
    on a member of this node, or whose topic can go nowhere (unpinned wildcard) is not."""
    from amqpbroker.core.placement import HeldSubscription, misplaced_subscriptions
    base = static_map(NODES)
    slots = SlotMap(base.owners, frozenset({"n0"}), partitioned={"amq.topic/prices": 3})
    here, away = key_owned_by("n0", slots, "amq.topic/t"), key_owned_by("n1", slots, "amq.topic/t")
    members = dict(place_link(consumer("amq.topic/prices"), "n0", slots, EXCHANGES).members)
    own_member = next(m for m, n in members.items() if n == "n0")
    other_member, other_node = next((m, n) for m, n in members.items() if n != "n0")
    held = [HeldSubscription("here", here), HeldSubscription("away", away),
            HeldSubscription("own-member", own_member), HeldSubscription("other-member", other_member),
            HeldSubscription("logical", "amq.topic/prices"), HeldSubscription("wild", "amq.topic/a.*")]
    found = {s.name: s.owner for s in misplaced_subscriptions(held, "n0", slots, EXCHANGES)}
    held.append(HeldSubscription("former", "amq.topic/prices.p3", queue="q-former"))
    misplaced = {s.name: s for s in misplaced_subscriptions(held, "n0", slots, EXCHANGES)}
    found = {name: s.owner for name, s in misplaced.items()}
    assert set(found) == {"away", "other-member", "logical", "former"}
    assert found["away"] == "n1" and found["other-member"] == other_node   # n1, n2 not live: still theirs
    assert found["logical"].startswith("members amq.topic/prices.p0 on ")
    # A member its topic no longer has (4 members once, 3 now): into member 0's copy.
    assert misplaced["former"].members == (("amq.topic/prices.p0", members["amq.topic/prices.p0"]),)
    assert misplaced["former"].queue == "q-former" and misplaced["former"].node == ""


def test_former_members_row_by_row():
    from amqpbroker.core.placement import former_member
    slots = SlotMap(static_map(NODES).owners, frozenset(NODES), partitioned={"orders": 2, "amq.topic/px": 2})
    first = dict(partition_members("orders", 2, slots))
    assert former_member("orders.p2", slots) == ("orders.p0", first["orders.p0"])
    assert former_member("orders.p7", slots) == ("orders.p0", first["orders.p0"])
    assert former_member("amq.topic/px.p2", slots)[0] == "amq.topic/px.p0"
    for still in ("orders.p0", "orders.p1", "orders", "orders.px", "other.p5", "orders.p"):
        assert former_member(still, slots) is None, still


def test_a_former_members_queue_is_shovelled_into_member_0():
    from amqpbroker.cluster.shovel import misplaced_target
    slots = SlotMap(static_map(NODES).owners, frozenset(NODES), partitioned={"orders": 2})
    node0 = dict(partition_members("orders", 2, slots))["orders.p0"]
    elsewhere = next(n for n in NODES if n != node0)
    assert misplaced_target("orders.p2", elsewhere, slots, EXCHANGES) == (node0, "orders.p0")
    assert misplaced_target("orders.p1", dict(partition_members("orders", 2, slots))["orders.p1"], slots,
                            EXCHANGES) is None   # a member on its node stays


def test_misplaced_subscriptions_message_names_them_and_the_way_out():
    from amqpbroker.core.placement import HeldSubscription, MisplacedSubscriptions
    found = [HeldSubscription(f"s{i}", f"amq.topic/t{i}", "n1") for i in range(7)]
    text = str(MisplacedSubscriptions("n0", found))
    assert "node n0 holds 7 durable subscription(s)" in text and "'s0' (topic amq.topic/t0, owned by n1)" in text
    assert "'s5'" not in text and "and 2 more" in text and "Start with the map they were made under" in text


def test_which_misplaced_subscriptions_can_move():
    from amqpbroker.core.placement import HeldSubscription, movable
    assert movable(HeldSubscription("s", "amq.topic/t", "n1", "q", node="n1"), "n0")
    assert movable(HeldSubscription("s", "amq.topic/t", "", "q", members=(("amq.topic/t.p0", "n0"),
                                                                           ("amq.topic/t.p1", "n1"))), "n0")
    # every member here: there is nowhere else to take its backlog
    assert not movable(HeldSubscription("s", "amq.topic/t", "", "q", members=(("amq.topic/t.p0", "n0"),)), "n0")
    assert not movable(HeldSubscription("s", "amq.topic/t", "", "q"), "n0")


# ---------------------------------------------------------------------- replaces (cluster/guard.py)

REPLACES = [
    # (held binding as an address, attach address + topic capability, replaced?)
    ("amq.topic/prices", ("prices", True), False),            # one topic, two spellings
    ("amq.topic/prices", ("amq.topic/prices", False), False),
    ("amq.topic/#", ("amq.topic", False), False),              # the exchange alone: its key '#'
    ("amq.fanout/", ("amq.fanout", False), False),             # a fanout binding's empty key
    ("events/a.b", ("events/a.b", False), False),              # a pinned exchange: key by key
    ("events/a.b", ("events/a.c", False), True),
    ("amq.topic/prices.p1", ("prices", True), False),         # a member copy of the partitioned topic
    ("amq.topic/prices.p7", ("prices", True), True),          # not one of its members
    ("amq.topic/prices", ("orders", True), True),             # JMS 2.0 §6.11: another topic replaces
    ("amq.topic/prices", ("prices", False), True),            # the queue 'prices' is not the topic
]


@pytest.mark.parametrize("held,attached,expected", REPLACES)
def test_row_a_subscription_elsewhere_is_replaced_only_under_another_topic(held, attached, expected):
    base = static_map(NODES)
    slots = SlotMap(base.owners, base.live, pinned=frozenset({"events"}), partitioned={"amq.topic/prices": 2})
    assert replaces((held, False), attached, slots, EXCHANGES) is expected
