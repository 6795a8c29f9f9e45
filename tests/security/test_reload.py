"""security/reload.py: what a new configuration changes, decided without a broker."""

from __future__ import annotations

from amqpbroker.config import Settings
from amqpbroker.core.limits import Overflow, QueueLimits
from amqpbroker.security.guard import policy_from
from amqpbroker.security.reload import (
    LiveConnection,
    LiveLink,
    diff_users,
    plan,
    queue_limit_changes,
    restart_needed,
)

BASE = {
    "users": {"alice": {"password": "a", "groups": ["orders-app"]}, "bob": {"password": "b"}},
    "acl": [{"group": "orders-app", "pattern": "orders.#", "permissions": ["send", "consume"]},
            {"user": "bob", "pattern": "#", "permissions": ["browse"]}],
}


def settings(**changes) -> Settings:
    return Settings(**{**BASE, **changes})


def link(user, action, address, conn="c1", name="l1") -> LiveLink:
    return LiveLink(ref=(conn, name), connection=conn, user=user, name=name, action=action, address=address)


def test_users_added_removed_changed():
    new = settings(users={"alice": {"password": "a2", "groups": ["orders-app"]}, "carol": {"password": "c"}})
    assert diff_users(settings(), new) == (["carol"], ["bob"], ["alice"])


def test_groups_change_counts_as_a_changed_user():
    new = settings(users={**BASE["users"], "alice": {"password": "a", "groups": []}})
    assert diff_users(settings(), new) == ([], [], ["alice"])


def test_same_file_changes_nothing():
    p = plan(settings(), settings(), policy_from(settings()), [LiveConnection("c1", "alice")],
             [link("alice", "consume", "orders.eu")], {})
    assert not p.changed
    assert p.close == [] and p.detach == [] and p.restart_needed == []


def test_link_that_lost_its_permission_is_detached_producers_and_consumers():
    new = settings(acl=[{"group": "orders-app", "pattern": "orders.eu", "permissions": ["consume"]},
                        {"user": "bob", "pattern": "#", "permissions": ["browse"]}])
    links = [link("alice", "consume", "orders.eu", name="keeps"),
             link("alice", "send", "orders.eu", name="producer"),
             link("alice", "consume", "orders.us", name="consumer"),
             link("bob", "browse", "x", conn="c2", name="browser")]
    p = plan(settings(), new, policy_from(new), [], links, {})
    assert p.acl_changed
    assert sorted(ln.name for ln, _ in p.detach) == ["consumer", "producer"]
    why = dict((ln.name, w) for ln, w in p.detach)
    assert why["producer"] == ("user 'alice' is no longer allowed to send on 'orders.eu' "
                               "(configuration reloaded)")


def test_a_producer_served_as_a_partition_member_is_checked_on_the_member_too():
    """At attach a producer at a member's node needs `send` on the name it gave and on
    the member its messages go to (server/refusal.py check_access); a reload that takes
    either away detaches it, as the member's node does a forwarded one."""
    def member_link(name):
        return LiveLink(ref=("c1", name), connection="c1", user="alice", name=name, action="send",
                        address="orders.eu", also=("orders.eu.p1",))
    member_cut = settings(acl=[{"group": "orders-app", "pattern": "orders.eu", "permissions": ["send"]}])
    p = plan(settings(), member_cut, policy_from(member_cut), [], [member_link("p")], {})
    assert [(ln.name, why) for ln, why in p.detach] == [
        ("p", "user 'alice' is no longer allowed to send on 'orders.eu.p1' (configuration reloaded)")]
    both = settings(acl=[{"group": "orders-app", "pattern": "orders.eu.#", "permissions": ["send"]},
                         {"group": "orders-app", "pattern": "orders.eu", "permissions": ["send"]}])
    assert plan(settings(), both, policy_from(both), [], [member_link("p")], {}).detach == []


def test_group_membership_removed_detaches():
    new = settings(users={**BASE["users"], "alice": {"password": "a", "groups": []}})
    p = plan(settings(), new, policy_from(new), [], [link("alice", "consume", "orders.eu")], {})
    assert [ln.name for ln, _ in p.detach] == ["l1"]


def test_removed_user_connection_closed_and_its_links_not_detached_twice():
    new = settings(users={"alice": BASE["users"]["alice"]})
    conns = [LiveConnection("c1", "alice"), LiveConnection("c2", "bob")]
    links = [link("bob", "browse", "orders.eu", conn="c2")]
    p = plan(settings(), new, policy_from(new), conns, links, {})
    assert [(c.ref, why) for c, why in p.close] == [("c2", "user 'bob' was removed from the configuration")]
    assert p.detach == []      # the connection's close ends them


def test_acl_switched_on_checks_anonymous_links():
    old = Settings()
    new = Settings(anonymous={"pattern": "public.#", "permissions": ["consume"]})
    links = [link("anonymous", "consume", "public.news", name="ok"), link("anonymous", "send", "public.news",
                                                                           name="denied")]
    p = plan(old, new, policy_from(new), [], links, {})
    assert p.anonymous_changed
    assert [ln.name for ln, _ in p.detach] == ["denied"]


def test_acl_switched_off_detaches_nothing():
    p = plan(settings(), Settings(users=BASE["users"]), policy_from(Settings()), [],
             [link("alice", "send", "secret")], {})
    assert p.acl_changed and p.detach == []


def test_queue_limit_patterns_and_declared_limits():
    old = settings(queue_limits=[{"pattern": "t.#", "max_depth": 10}],
                   queues=[{"name": "inv", "max_depth": 5}, {"name": "kept"}])
    new = settings(queue_limits=[{"pattern": "t.#", "max_depth": 20, "overflow": "reject"}],
                   queues=[{"name": "inv"}, {"name": "kept"}])
    ten, five = QueueLimits(10), QueueLimits(5)
    api = QueueLimits(7, 0, Overflow.DROP_HEAD)
    queues = {"t.a": (ten, None), "inv": (five, five), "other": (None, None), "t.api": (api, api)}
    out = queue_limit_changes(old, new, queues)
    assert out == {"t.a": (None, QueueLimits(20, 0, Overflow.REJECT)),
                   # the file no longer declares inv's limits: no pattern matches it
                   "inv": (None, None)}


def test_queue_declared_in_file_wins_over_pattern():
    new = settings(queue_limits=[{"pattern": "#", "max_depth": 1}], queues=[{"name": "q", "max_bytes": "1KiB"}])
    out = queue_limit_changes(settings(), new, {"q": (None, None), "r": (None, None)})
    assert out == {"q": (QueueLimits(0, 1024), QueueLimits(0, 1024)), "r": (None, QueueLimits(1))}


def test_restart_needed_for_other_settings_only():
    new = settings(port=5999, expiry_policies=[{"pattern": "#", "idle": "1d"}],
                   queues=[{"name": "new-queue"}])
    assert restart_needed(settings(), new) == ["port", "queues (other than limits)"]
    p = plan(settings(), new, policy_from(new), [], [], {})
    assert p.expiry_changed and p.restart_needed == ["port", "queues (other than limits)"]
    summary = p.summary()
    assert summary["restart_needed"] == ["port", "queues (other than limits)"]
    assert "needs a restart to apply: port" in p.describe()


# ---------------------------------------------------------------------- what a reload would open

def opens(old: Settings, new: Settings) -> list[str]:
    from amqpbroker.security.reload import opens_access
    return opens_access(old, new, policy_from(old), policy_from(new))


def test_a_file_without_acl_rules_turns_access_control_off():
    cut = Settings(users=BASE["users"])            # a prefix of the file: the users, no [[acl]]
    assert [w.split(" (")[0] for w in opens(settings(), cut)] == ["it turns access control off"]
    assert opens(settings(), Settings()) == [      # an empty file
        "it turns access control off (no [[acl]] rule and no [anonymous] section left: everyone may do everything)",
        "it removes every user (2 configured now)"]


def test_ordinary_edits_open_nothing():
    fewer_rules = settings(acl=BASE["acl"][:1])
    fewer_users = settings(users={"alice": BASE["users"]["alice"]})
    more_rules = settings(acl=BASE["acl"] + [{"user": "bob", "pattern": "x.#", "permissions": ["send"]}])
    for new in (settings(), fewer_rules, fewer_users, more_rules):
        assert opens(settings(), new) == []
    # Without access control running, nothing can be opened further.
    assert opens(Settings(), Settings()) == [] and opens(Settings(), settings()) == []


def test_more_for_anonymous_is_an_opening():
    narrow = settings(anonymous={"permissions": ["consume"], "pattern": "public.#"})
    cut_before_pattern = settings(anonymous={"permissions": ["consume"]})     # pattern defaults to '#'
    more = settings(anonymous={"permissions": ["consume", "send"], "pattern": "public.#"})
    fewer = settings(anonymous={"permissions": [], "pattern": "public.#"})
    assert "anonymous identity more" in opens(narrow, cut_before_pattern)[0]
    assert "send" in opens(narrow, more)[0]
    assert opens(narrow, fewer) == [] and opens(narrow, settings()) == []
    assert "nothing now" in opens(settings(), narrow)[0]


def test_a_rule_cut_before_its_pattern_is_an_opening():
    """A half-written file cut just before a rule's `pattern` line is a valid prefix
    whose rule grants on '#' (the default pattern): bob, allowed to consume
    'public.#', could consume every queue after such a reload.  A rule that gives a
    user or group permissions on every address it did not have is an opening."""
    narrow = settings(acl=BASE["acl"] + [{"user": "carol", "permissions": ["consume"], "pattern": "public.#"}])
    cut = settings(acl=BASE["acl"] + [{"user": "carol", "permissions": ["consume"]}])
    why = opens(narrow, cut)
    assert len(why) == 1 and "user 'carol'" in why[0] and "consume on every address" in why[0], why
    group_cut = settings(acl=[{"group": "orders-app", "permissions": ["send", "consume"]}, BASE["acl"][1]])
    assert "group 'orders-app'" in opens(settings(), group_cut)[0]
    # What it had on '#' already (bob: browse) is no opening; more on '#' is.
    assert opens(settings(), settings(acl=BASE["acl"] + [{"user": "bob", "permissions": ["browse"]}])) == []
    assert "user 'bob'" in opens(settings(), settings(acl=[BASE["acl"][0],
                                                           {"user": "bob", "permissions": ["send"]}]))[0]
    # Narrower rules, new users with narrow rules, fewer rules: nothing opened.
    assert opens(cut, narrow) == []
