"""Every decision of the pure ACL (amqpbroker/security/acl.py)."""

from __future__ import annotations

import pytest

from amqpbroker.security.acl import (
    PERMISSIONS,
    AclPolicy,
    Rule,
    expand_permissions,
    pattern_matches,
)


def policy(*rules: dict, anonymous: dict | None = None) -> AclPolicy:
    return AclPolicy.from_config(list(rules), anonymous)


OPS = {"group": "ops", "pattern": "#", "permissions": ["all"]}
ORDERS_APP = {"group": "orders-app", "pattern": "orders.#", "permissions": ["send", "consume"]}
AUDIT = {"user": "auditor", "pattern": "orders.#", "permissions": ["browse"]}
MGR = {"user": "mgr", "pattern": "orders.#", "permissions": ["manage"]}


# ---------------------------------------------------------------------- nothing configured

@pytest.mark.parametrize("action", PERMISSIONS)
@pytest.mark.parametrize("user", [None, "anonymous", "alice"])
def test_no_acl_configured_allows_everything(user, action):
    p = policy()
    assert not p.enabled
    d = p.decide(user, (), action, "anything.at.all")
    assert d.allowed and "no access control" in d.reason


def test_no_acl_configured_can_manage():
    assert policy().can_manage_any("anyone", ())


# ---------------------------------------------------------------------- groups and users

@pytest.mark.parametrize("action", ["send", "consume", "browse"])
def test_group_rule_grants_its_permissions_on_matching_addresses(action):
    p = policy(ORDERS_APP)
    assert p.allows("alice", ["orders-app"], action, "orders.eu")


def test_group_rule_does_not_grant_other_permissions():
    assert not policy(ORDERS_APP).allows("alice", ["orders-app"], "manage", "orders.eu")


def test_group_rule_does_not_apply_to_non_members():
    assert not policy(ORDERS_APP).allows("bob", ["billing"], "send", "orders.eu")


def test_group_rule_does_not_apply_outside_its_pattern():
    d = policy(ORDERS_APP).decide("alice", ["orders-app"], "send", "invoices.eu")
    assert not d.allowed
    assert "no rule grants user 'alice' send on 'invoices.eu'" == d.reason


def test_user_rule_applies_to_that_user_only():
    p = policy(AUDIT)
    assert p.allows("auditor", [], "browse", "orders.x")
    assert not p.allows("other", [], "browse", "orders.x")


def test_user_rule_applies_whatever_the_groups():
    assert policy(AUDIT).allows("auditor", ["unrelated"], "browse", "orders.x")


def test_browse_only_does_not_allow_consume():
    assert not policy(AUDIT).allows("auditor", [], "consume", "orders.x")


def test_consume_implies_browse():
    assert policy(ORDERS_APP).allows("alice", ["orders-app"], "browse", "orders.x")


def test_all_grants_every_permission():
    p = policy(OPS)
    for action in PERMISSIONS:
        assert p.allows("root", ["ops"], action, "x.y")


def test_rules_add_up_across_user_and_groups():
    p = policy(ORDERS_APP, {"user": "alice", "pattern": "invoices", "permissions": ["send"]})
    assert p.allows("alice", ["orders-app"], "send", "invoices")
    assert p.allows("alice", ["orders-app"], "consume", "orders.eu")
    assert not p.allows("alice", ["orders-app"], "consume", "invoices")


def test_decision_names_the_granting_rule():
    d = policy(ORDERS_APP).decide("alice", ["orders-app"], "send", "orders.eu")
    assert d.allowed and d.rule is not None and d.rule.group == "orders-app"
    assert "group 'orders-app'" in d.reason


def test_unknown_user_without_rules_is_denied_once_acls_exist():
    assert not policy(OPS).allows("stranger", [], "consume", "q")


# ---------------------------------------------------------------------- anonymous

def test_anonymous_denied_everything_when_acls_exist_without_anonymous_section():
    p = policy(OPS)
    for user in (None, "anonymous"):
        for action in PERMISSIONS:
            assert not p.allows(user, [], action, "q")


def test_anonymous_section_alone_enables_acls():
    p = policy(anonymous={"permissions": ["consume"]})
    assert p.enabled
    assert p.allows(None, [], "consume", "q")
    assert p.allows("anonymous", [], "browse", "q")
    assert not p.allows("anonymous", [], "send", "q")
    assert not p.allows("alice", [], "consume", "q"), "named users get nothing from [anonymous]"


def test_anonymous_section_pattern_limits_addresses():
    p = policy(anonymous={"permissions": ["send"], "pattern": "public.*"})
    assert p.allows(None, [], "send", "public.news")
    assert not p.allows(None, [], "send", "private.news")


def test_group_rules_never_apply_to_anonymous():
    p = policy({"group": "anonymous", "pattern": "#", "permissions": ["all"]})
    assert not p.allows("anonymous", ["anonymous"], "send", "q")


def test_user_rule_for_anonymous_applies():
    p = policy({"user": "anonymous", "pattern": "q", "permissions": ["send"]})
    assert p.allows(None, [], "send", "q")
    assert p.allows("anonymous", [], "send", "q")


def test_anonymous_empty_permissions_deny():
    p = policy(anonymous={"permissions": []})
    assert p.enabled and not p.allows(None, [], "consume", "q")


# ---------------------------------------------------------------------- manage

def test_can_manage_any_needs_a_manage_grant():
    p = policy(ORDERS_APP, MGR)
    assert p.can_manage_any("mgr", [])
    assert not p.can_manage_any("alice", ["orders-app"])
    assert not p.can_manage_any(None, [])


def test_manage_is_scoped_by_pattern():
    p = policy(MGR)
    assert p.allows("mgr", [], "manage", "orders.eu")
    assert not p.allows("mgr", [], "manage", "invoices")
    assert not p.allows("mgr", [], "manage", "#"), "only a '#' rule manages everything"


def test_anonymous_manage():
    assert policy(anonymous={"permissions": ["manage"]}).can_manage_any(None, [])
    assert policy({"user": "anonymous", "permissions": ["manage"]}).can_manage_any("anonymous", [])


# ---------------------------------------------------------------------- patterns

@pytest.mark.parametrize("pattern,address,expected", [
    ("#", "anything", True),
    ("#", "", True),
    ("orders.#", "orders", True),
    ("orders.#", "orders.eu", True),
    ("orders.#", "orders.eu.paid", True),
    ("orders.#", "ordersx", False),
    ("orders.*", "orders.eu", True),
    ("orders.*", "orders", False),
    ("orders.*", "orders.eu.paid", False),
    ("orders", "orders", True),
    ("orders", "orders.eu", False),
    ("amq.topic/orders.#", "amq.topic/orders.eu", True),
    ("*.eu", "orders.eu", True),
])
def test_pattern_matching(pattern, address, expected):
    assert pattern_matches(pattern, address) is expected


# ---------------------------------------------------------------------- validation

def test_expand_permissions():
    assert expand_permissions(["all"]) == frozenset(PERMISSIONS)
    assert expand_permissions(["Send", " consume "]) == {"send", "consume"}
    with pytest.raises(ValueError, match="unknown permission 'write'"):
        expand_permissions(["write"])


def test_rule_needs_exactly_one_principal():
    with pytest.raises(ValueError):
        Rule("#", frozenset({"send"}))
    with pytest.raises(ValueError):
        Rule("#", frozenset({"send"}), user="a", group="b")


def test_unknown_action_is_an_error():
    with pytest.raises(ValueError):
        policy(OPS).decide("x", [], "delete", "q")


def test_decisions_are_cached_and_stable():
    p = policy(ORDERS_APP)
    first = p.decide("alice", ["orders-app"], "send", "orders.eu")
    assert p.decide("alice", ("orders-app",), "send", "orders.eu") is first
