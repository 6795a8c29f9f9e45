"""The attach/detach decision table, row by row (seed 002 + the Qpid JMS wire notes).

Row names: `row_<null source?>_<shared?>_<global?>_<durable?>`.
"""

from __future__ import annotations

import pytest

from amqpbroker.core.queues import ExclusivityPolicy, LifetimePolicy
from amqpbroker.core.subscriptions import (
    GLOBAL_NAMESPACE,
    BindingSpec,
    Decision,
    DetachAction,
    SubscriptionKey,
    SubscriptionView,
    decide_attach,
    decide_detach,
    identity,
    is_global_name,
    keeps_registry_link,
)
from amqpbroker.core.terms import Durability, ExpiryPolicy, Filter, SourceTerms

CID = "client-1"
TOPIC = BindingSpec("amq.topic", "news")


def source(*caps: str, durable: bool = False, selector: str | None = None, address: str = "news") -> SourceTerms:
    filters = ()
    if selector:
        filters = (Filter("jms-selector", 0x0000468C00000004, selector),)
    return SourceTerms(
        address=address,
        durable=Durability.UNSETTLED_STATE if durable else Durability.NONE,
        expiry_policy=ExpiryPolicy.NEVER if durable else ExpiryPolicy.LINK_DETACH,
        capabilities=frozenset(("topic",) + caps),
        filters=filters,
    )


def view(exclusivity=ExclusivityPolicy.SHARED_SUBSCRIPTION, binding=TOPIC, consumers=0, src=None):
    return SubscriptionView(exclusivity, binding, consumers, src or source("shared", durable=True))


# ---------------------------------------------------------------- not-null source rows


def test_row_source_unshared_local_nondurable_creates_private_link_queue():
    d = decide_attach("qpid-jms:receiver:ID:1:1:1:news", CID, source(), TOPIC, {})
    assert d.decision is Decision.CREATE
    assert d.key is None                       # random, unnamed
    assert d.exclusivity is ExclusivityPolicy.LINK
    assert d.lifetime is LifetimePolicy.DELETE_ON_NO_LINKS
    assert d.reply_source.capabilities == {"topic"}


def test_row_source_unshared_local_durable_creates_named_durable_link_queue():
    d = decide_attach("mysub", CID, source(durable=True), TOPIC, {})
    assert d.decision is Decision.CREATE
    assert d.key == SubscriptionKey(CID, "mysub", True)
    assert d.exclusivity is ExclusivityPolicy.LINK
    assert d.lifetime is LifetimePolicy.PERMANENT
    assert d.reply_source.capabilities == {"topic"}
    assert d.reply_source.distribution_mode == "copy"


def test_row_source_unshared_global_nondurable_is_like_local_nondurable():
    d = decide_attach("x", CID, source("global"), TOPIC, {})
    assert d.decision is Decision.CREATE and d.key is None
    assert d.exclusivity is ExclusivityPolicy.LINK


def test_row_source_unshared_global_durable_uses_global_namespace():
    d = decide_attach("mysub", CID, source("global", durable=True), TOPIC, {})
    assert d.key == SubscriptionKey(GLOBAL_NAMESPACE, "mysub", True)
    assert d.reply_source.capabilities == {"topic", "global"}


def test_row_source_shared_local_nondurable_names_queue_up_to_bar():
    d = decide_attach("mysub|volatile1", CID, source("shared"), TOPIC, {})
    assert d.decision is Decision.CREATE
    assert d.key == SubscriptionKey(CID, "mysub", False)
    assert d.exclusivity is ExclusivityPolicy.SHARED_SUBSCRIPTION
    assert d.lifetime is LifetimePolicy.DELETE_ON_NO_LINKS
    assert d.reply_source.capabilities == {"topic", "shared"}


def test_row_source_shared_local_durable():
    d = decide_attach("mysub|2", CID, source("shared", durable=True), TOPIC, {})
    assert d.key == SubscriptionKey(CID, "mysub", True)
    assert d.exclusivity is ExclusivityPolicy.SHARED_SUBSCRIPTION
    assert d.lifetime is LifetimePolicy.PERMANENT


def test_row_source_shared_global_nondurable():
    d = decide_attach("mysub|global-volatile1", "ID:abc:1", source("shared", "global"), TOPIC, {})
    assert d.key == SubscriptionKey(GLOBAL_NAMESPACE, "mysub", False)
    assert d.reply_source.capabilities == {"topic", "shared", "global"}


def test_row_source_shared_global_durable():
    d = decide_attach("mysub|global", "ID:abc:1", source("shared", "global", durable=True), TOPIC, {})
    assert d.key == SubscriptionKey(GLOBAL_NAMESPACE, "mysub", True)
    assert d.queue_name == "qpidsub_/__global___/mysub_/durable"


# ---------------------------------------------------------------- null source rows


def test_row_null_unshared_local_finds_durable_subscription_of_container():
    stored = source(durable=True)
    existing = {SubscriptionKey(CID, "mysub", True): view(ExclusivityPolicy.LINK, src=stored)}
    d = decide_attach("mysub", CID, None, None, existing)
    assert d.decision is Decision.ATTACH_EXISTING
    assert d.reply_source == stored


def test_row_null_unshared_global_looks_in_global_namespace():
    stored = source("global", durable=True)
    existing = {SubscriptionKey(GLOBAL_NAMESPACE, "mysub", True): view(ExclusivityPolicy.LINK, src=stored)}
    # `|global` suffix is the only hint: proton cannot read link capabilities.
    d = decide_attach("mysub|global", "another-container", None, None, existing)
    assert d.decision is Decision.ATTACH_EXISTING


def test_row_null_shared_local_uses_name_up_to_bar():
    existing = {SubscriptionKey(CID, "mysub", True): view()}
    assert decide_attach("mysub", CID, None, None, existing).decision is Decision.ATTACH_EXISTING


def test_row_null_shared_global_from_any_container():
    existing = {SubscriptionKey(GLOBAL_NAMESPACE, "mysub", True): view()}
    d = decide_attach("mysub|global", "ID:other:7", None, None, existing)
    assert d.decision is Decision.ATTACH_EXISTING
    assert d.shared


def test_row_null_not_found():
    d = decide_attach("nosuch", CID, None, None, {})
    assert d.decision is Decision.REFUSE
    assert d.condition == "amqp:not-found"


def test_row_null_other_container_does_not_see_local_subscription():
    existing = {SubscriptionKey(CID, "mysub", True): view()}
    assert decide_attach("mysub", "client-2", None, None, existing).condition == "amqp:not-found"


def test_row_null_unshared_with_active_consumer_is_locked():
    existing = {SubscriptionKey(CID, "mysub", True): view(ExclusivityPolicy.LINK, consumers=1)}
    assert decide_attach("mysub", CID, None, None, existing).condition == "amqp:resource-locked"


def test_row_null_nondurable_subscription_is_not_found():
    existing = {SubscriptionKey(CID, "mysub", False): view()}
    assert decide_attach("mysub", CID, None, None, existing).condition == "amqp:not-found"


# ---------------------------------------------------------------- existing subscription rules


def test_rule_reuse_same_exclusivity_same_bindings():
    existing = {SubscriptionKey(CID, "mysub", True): view(consumers=3)}
    d = decide_attach("mysub|4", CID, source("shared", durable=True), TOPIC, existing)
    assert d.decision is Decision.REUSE


def test_rule_different_binding_without_consumers_recreates():
    existing = {SubscriptionKey(CID, "mysub", True): view(consumers=0)}
    other = BindingSpec("amq.topic", "sports")
    d = decide_attach("mysub", CID, source("shared", durable=True, address="sports"), other, existing)
    assert d.decision is Decision.RECREATE


def test_rule_different_selector_without_consumers_recreates():
    existing = {SubscriptionKey(CID, "mysub", True): view(ExclusivityPolicy.LINK)}
    b = BindingSpec("amq.topic", "news", selector="a = 1")
    d = decide_attach("mysub", CID, source(durable=True, selector="a = 1"), b, existing)
    assert d.decision is Decision.RECREATE


def test_rule_different_binding_with_consumers_is_locked():
    existing = {SubscriptionKey(CID, "mysub", True): view(consumers=1)}
    b = BindingSpec("amq.topic", "news", no_local=True)
    d = decide_attach("mysub|2", CID, source("shared", durable=True), b, existing)
    assert d.decision is Decision.REFUSE and d.condition == "amqp:resource-locked"


def test_rule_shared_attach_on_unshared_subscription_is_locked():
    existing = {SubscriptionKey(CID, "mysub", True): view(ExclusivityPolicy.LINK)}
    d = decide_attach("mysub", CID, source("shared", durable=True), TOPIC, existing)
    assert d.condition == "amqp:resource-locked"


def test_rule_unshared_attach_on_shared_subscription_is_locked():
    existing = {SubscriptionKey(CID, "mysub", True): view()}
    d = decide_attach("mysub", CID, source(durable=True), TOPIC, existing)
    assert d.condition == "amqp:resource-locked"


def test_rule_second_consumer_on_unshared_durable_is_locked():
    existing = {SubscriptionKey(CID, "mysub", True): view(ExclusivityPolicy.LINK, consumers=1)}
    d = decide_attach("mysub", CID, source(durable=True), TOPIC, existing)
    assert d.condition == "amqp:resource-locked"


def test_rule_unshared_durable_resubscribe_without_consumer_reuses():
    existing = {SubscriptionKey(CID, "mysub", True): view(ExclusivityPolicy.LINK)}
    assert decide_attach("mysub", CID, source(durable=True), TOPIC, existing).decision is Decision.REUSE


def test_rule_consumer_limit_on_shared_subscription():
    existing = {SubscriptionKey(CID, "mysub", True): view(consumers=2)}
    d = decide_attach("mysub|3", CID, source("shared", durable=True), TOPIC, existing, max_consumers=2)
    assert d.condition == "amqp:resource-limit-exceeded"


def test_rule_durable_and_nondurable_of_same_name_are_distinct():
    existing = {SubscriptionKey(CID, "mysub", True): view()}
    d = decide_attach("mysub|volatile1", CID, source("shared"), TOPIC, existing)
    assert d.decision is Decision.CREATE


def test_rule_reply_keeps_only_honoured_filters():
    src = source("shared", durable=True, selector="a > 1")
    src = src.with_(filters=src.filters + (Filter("x-unknown", "vendor:filter", 1),))
    d = decide_attach("mysub", CID, src, BindingSpec("amq.topic", "news", "a > 1"), {})
    assert [f.key for f in d.reply_source.filters] == ["jms-selector"]


# ---------------------------------------------------------------- identity and names


@pytest.mark.parametrize("name,expected", [
    ("sub|global", True), ("sub|global2", True), ("sub|global-volatile1", True),
    ("sub", False), ("sub|2", False), ("sub|volatile1", False), ("global", False),
])
def test_global_suffix(name, expected):
    assert is_global_name(name) is expected


def test_identity_of_null_source_infers_shared_from_bar():
    assert identity("sub|2", CID, None) == (CID, "sub", True, False)
    assert identity("sub", CID, None) == (CID, "sub", False, False)


def test_queue_names_cannot_collide_through_separators():
    a = SubscriptionKey("a_", "/b", True).queue_name
    b = SubscriptionKey("a", "_/b", True).queue_name
    assert a != b


# ---------------------------------------------------------------- detach rules


def test_detach_closed_false_keeps_durable():
    assert decide_detach(False, True, LifetimePolicy.PERMANENT, 0) is DetachAction.KEEP


def test_detach_closed_true_deletes_durable_without_other_consumers():
    assert decide_detach(True, True, LifetimePolicy.PERMANENT, 0) is DetachAction.DELETE


def test_detach_closed_true_with_other_consumers_is_locked():
    assert decide_detach(True, True, LifetimePolicy.PERMANENT, 2) is DetachAction.REFUSE_LOCKED


def test_detach_nondurable_link_detach_lifetime_deletes_when_last_consumer_leaves():
    assert decide_detach(False, False, LifetimePolicy.DELETE_ON_NO_LINKS, 0) is DetachAction.DELETE
    assert decide_detach(True, False, LifetimePolicy.DELETE_ON_NO_LINKS, 1) is DetachAction.KEEP


def test_detach_nondurable_connection_close_lifetime_outlives_link():
    assert decide_detach(True, False, LifetimePolicy.DELETE_ON_CONNECTION_CLOSE, 0) is DetachAction.KEEP


@pytest.mark.parametrize("name,keeps", [
    ("sub", True), ("sub|global", True),
    ("sub|2", False), ("sub|global2", False), ("sub|volatile1", False), ("sub|global-volatile3", False),
])
def test_registry_keeps_only_lookup_names(name, keeps):
    assert keeps_registry_link(name) is keeps
