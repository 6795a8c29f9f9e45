"""Live reload end to end: a real broker re-reads its file on SIGHUP, on
`POST /api/reload` and on `amqpbroker admin reload`; users, ACLs and queue limits
change without dropping connections; links that lost their permission are
detached with amqp:unauthorized-access, a removed user's connections closed; a
bad file changes nothing and says why."""

from __future__ import annotations

import uuid

import httpx
import pytest
from proton import Endpoint, Message

from tests.e2e.helpers_conn import RawClient, run_cli

pytestmark = pytest.mark.e2e

USERS = """
[users.alice]
password = "alice-pw"
groups = ["orders-app"]
[users.bob]
password = "bob-pw"
[users.root]
password = "root-pw"
groups = ["ops"]
"""
OPS = """
[[acl]]
group = "ops"
permissions = ["all"]
"""
CONFIG = USERS + OPS + """
[[acl]]
group = "orders-app"
pattern = "orders.#"
permissions = ["send", "consume"]
[[acl]]
user = "bob"
pattern = "#"
permissions = ["send"]
"""
PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "root": "root-pw"}


def raw(broker, user: str) -> RawClient:
    return RawClient(broker.host, broker.port, container_id=f"{user}-{uuid.uuid4().hex[:6]}", sasl_mechs="PLAIN",
                     user=user, password=PASSWORDS[user]).wait_open()


def api(broker, user: str = "root") -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{broker.ports['management']}",
                        auth=(user, PASSWORDS[user]), timeout=20)


def detached_unauthorized(link) -> bool:
    return bool(link.state & Endpoint.REMOTE_CLOSED) and link.remote_condition is not None \
        and link.remote_condition.name == "amqp:unauthorized-access"


def test_sighup_detaches_links_that_lost_permission_and_closes_removed_users(broker_factory):
    b = broker_factory(CONFIG)
    alice, bob = raw(b, "alice"), raw(b, "bob")
    try:
        ssn = alice.session()
        consumer = alice.receiver(ssn, "orders.eu", "c1")
        producer = alice.sender(ssn, "orders.eu", "p1")
        keeps = alice.sender(ssn, "orders.us", "p2")
        assert all(ln.state & Endpoint.REMOTE_ACTIVE for ln in (consumer, producer, keeps))
        bob_snd = bob.sender(bob.session(), "anything", "b1")
        assert bob_snd.state & Endpoint.REMOTE_ACTIVE

        # alice may now only send on orders.us; bob is gone.
        b.reload(USERS.replace('[users.bob]\npassword = "bob-pw"\n', "") + OPS + """
[[acl]]
group = "orders-app"
pattern = "orders.us"
permissions = ["send"]
""")
        b.wait_for_log(r"configuration reloaded from .* by SIGHUP: users removed: bob; \[\[acl\]\] changed; "
                       r"1 connection\(s\) closed, 2 link\(s\) detached")
        alice.wait(lambda: detached_unauthorized(consumer) and detached_unauthorized(producer), what="detaches")
        assert "no longer allowed to consume on 'orders.eu'" in consumer.remote_condition.description
        assert "no longer allowed to send on 'orders.eu'" in producer.remote_condition.description
        bob.wait_closed()
        assert bob.conn.remote_condition.name == "amqp:unauthorized-access"
        assert "user 'bob' was removed" in bob.conn.remote_condition.description

        # The connection stays, and the link still allowed still works.
        assert alice.conn.state & Endpoint.REMOTE_ACTIVE and keeps.state & Endpoint.REMOTE_ACTIVE
        alice.wait(lambda: keeps.credit > 0, what="credit")
        dlv = keeps.delivery(b"t1")
        keeps.send(Message(body="still here").encode())
        keeps.advance()
        alice.wait(lambda: dlv.remote_state, what="outcome")
        assert dlv.remote_state == dlv.ACCEPTED
        # A new attach is decided by the new rules.
        again = alice.receiver(ssn, "orders.eu", "c2")
        assert detached_unauthorized(again)
    finally:
        alice.close()
        bob.close()
    with pytest.raises(AssertionError):   # bob cannot log in any more
        RawClient(b.host, b.port, container_id="bob-again", sasl_mechs="PLAIN", user="bob",
                  password="bob-pw").wait_open(timeout=3)
    b.wait_for_log(r"authentication failed for user 'bob' \(PLAIN\): unknown user")


def test_bad_file_changes_nothing_and_says_why(broker_factory):
    b = broker_factory(CONFIG)
    alice = raw(b, "alice")
    try:
        consumer = alice.receiver(alice.session(), "orders.eu", "c1")
        b.config_path.write_text(CONFIG + '[[acl]]\nuser = "alice"\npermissions = ["fly"]\n')
        with api(b) as http:
            r = http.post("/api/reload", headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert "configuration not reloaded, nothing changed: invalid setting 'acl.3.permissions.0'" \
            in r.json()["error"]
        b.wait_for_log(r"configuration reload by root refused, nothing changed: invalid setting 'acl\.3\.permissions")
        # TOML that does not parse: SIGHUP logs it, and the broker runs on.
        b.reload(CONFIG.replace("[users.bob]", "[users.bob"))
        b.wait_for_log(r"configuration reload by SIGHUP refused, nothing changed: cannot read config")
        alice.pump_for(0.3)
        assert consumer.state & Endpoint.REMOTE_ACTIVE
        assert b.proc.poll() is None
    finally:
        alice.close()


def test_reload_needs_manage_on_everything(broker_factory):
    b = broker_factory(CONFIG)
    with api(b, "alice") as http:
        r = http.post("/api/reload", headers={"Content-Type": "application/json"})
    assert r.status_code == 403


def test_cli_reload_changes_queue_limits_and_user_passwords(broker_factory):
    b = broker_factory(CONFIG + """
[[queue_limits]]
pattern = "orders.#"
max_depth = 1
overflow = "reject"
""")
    alice = raw(b, "alice")
    try:
        snd = alice.sender(alice.session(), "orders.lim", "p1")
        alice.wait(lambda: snd.credit > 0, what="credit")
        outcomes = []
        for i in range(2):
            dlv = snd.delivery(f"t{i}".encode())
            snd.send(Message(body=i).encode())
            snd.advance()
            alice.wait(lambda d=dlv: d.remote_state, what="outcome")
            outcomes.append(dlv.remote_state)
        assert outcomes == [dlv.ACCEPTED, dlv.REJECTED]
        b.config_path.write_text(CONFIG.replace('password = "alice-pw"', 'password = "new-pw"') + """
[[queue_limits]]
pattern = "orders.#"
max_depth = 5
overflow = "reject"
""")
        env = {"AMQPBROKER_ADMIN_URL": f"http://127.0.0.1:{b.ports['management']}",
               "AMQPBROKER_ADMIN_USER": "root", "AMQPBROKER_ADMIN_PASSWORD": "root-pw"}
        done = run_cli(["admin", "reload"], env=env)
        assert done.returncode == 0, done.stderr
        assert "users changed: alice" in done.stdout
        assert "limits changed on 1 queue(s): orders.lim" in done.stdout
        assert "0 connection(s) closed, 0 link(s) detached" in done.stdout
        dlv = snd.delivery(b"t9")
        snd.send(Message(body=9).encode())
        snd.advance()
        alice.wait(lambda: dlv.remote_state, what="outcome")
        assert dlv.remote_state == dlv.ACCEPTED      # room under the new limit, same link
        with api(b) as http:
            assert http.get("/api/queues/orders.lim").json()["limits"]["max_depth"] == 5
        # The old password no longer logs in; the new one does.
        with pytest.raises(AssertionError):
            RawClient(b.host, b.port, container_id="a1", sasl_mechs="PLAIN", user="alice",
                      password="alice-pw").wait_open(timeout=3)
        RawClient(b.host, b.port, container_id="a2", sasl_mechs="PLAIN", user="alice",
                  password="new-pw").wait_open().close()
        # A bad file through the CLI: exit 1 and the reason.
        b.config_path.write_text(CONFIG + "[users.eve]\npassword = 'scram-sha-256$1$bad'\n")
        bad = run_cli(["admin", "reload"], env=env)
        assert bad.returncode == 1
        assert "nothing changed: invalid setting 'users': user 'eve'" in bad.stderr
    finally:
        alice.close()


# ---------------------------------------------------------------------- all or nothing

def _anonymous_may_consume(broker, address: str) -> bool:
    c = RawClient(broker.host, broker.port, container_id=f"anon-{uuid.uuid4().hex[:6]}").wait_open()
    try:
        link = c.receiver(c.session(), address, "peek")
        c.pump_for(0.2)
        return bool(link.state & Endpoint.REMOTE_ACTIVE) and not detached_unauthorized(link)
    finally:
        c.close()


@pytest.mark.parametrize("cut", ["users-only", "empty"])
def test_a_half_written_file_never_turns_access_control_off(broker_factory, cut):
    """An editor or `cp` leaves a valid TOML prefix (or an empty file) while it
    writes: a reload then must not take a configuration without [[acl]]."""
    b = broker_factory(CONFIG)
    assert not _anonymous_may_consume(b, "orders.eu")
    b.reload(USERS if cut == "users-only" else "")
    line = b.wait_for_log(r"configuration reload by SIGHUP refused, nothing changed")
    assert "access control off" in line
    assert not _anonymous_may_consume(b, "orders.eu")
    # The management API still asks for credentials.
    assert httpx.get(f"http://127.0.0.1:{b.ports['management']}/api/queues", timeout=10).status_code == 401
    with api(b, "alice") as http:     # and alice's rules are the old ones
        assert http.get("/api/overview").status_code == 403


def test_turning_access_control_off_needs_allow_open(broker_factory):
    b = broker_factory(CONFIG)
    b.config_path.write_text(USERS)
    with api(b) as http:
        refused = http.post("/api/reload", headers={"Content-Type": "application/json"})
        assert refused.status_code == 400
        assert "--allow-open" in refused.json()["error"]
        assert not _anonymous_may_consume(b, "orders.eu")
    env = {"AMQPBROKER_ADMIN_URL": f"http://127.0.0.1:{b.ports['management']}",
           "AMQPBROKER_ADMIN_USER": "root", "AMQPBROKER_ADMIN_PASSWORD": "root-pw"}
    refused = run_cli(["admin", "reload"], env=env)
    assert refused.returncode == 1 and "--allow-open" in refused.stderr
    taken = run_cli(["admin", "reload", "--allow-open"], env=env)
    assert taken.returncode == 0, taken.stderr
    assert "[[acl]] changed" in taken.stdout
    assert "opened (--allow-open): it turns access control off" in taken.stdout
    assert _anonymous_may_consume(b, "orders.eu")
    b.wait_for_log(r"configuration reloaded .* by root: .*access control turned off \(allowed\)")


def test_a_socket_accepted_before_a_reload_authenticates_against_the_new_users(broker_factory):
    """The handshake asks for the user store when the client authenticates, not the
    one of the moment its socket was accepted."""
    b = broker_factory(CONFIG)
    early = RawClient(b.host, b.port, container_id="bob-early", sasl_mechs="PLAIN", user="bob",
                      password="bob-pw")
    early.pump(0.2)             # the protocol header is out: the broker has accepted the socket
    b.reload(CONFIG.replace('[users.bob]\npassword = "bob-pw"\n', ""))
    b.wait_for_log(r"configuration reloaded .*users removed: bob")
    try:
        with pytest.raises(AssertionError):
            early.wait_open(timeout=3)
    finally:
        early.abandon()
    b.wait_for_log(r"authentication failed for user 'bob' \(PLAIN\): unknown user")


def _user_may_consume(broker, user: str, address: str) -> bool:
    c = raw(broker, user)
    try:
        link = c.receiver(c.session(), address, "peek")
        c.pump_for(0.2)
        return bool(link.state & Endpoint.REMOTE_ACTIVE) and not detached_unauthorized(link)
    finally:
        c.close()


def test_a_file_cut_before_a_rules_pattern_does_not_widen_it(broker_factory):
    """A rule written `permissions` first: a file cut just before its `pattern` line is
    a valid prefix whose rule grants on '#' (the default), and a reload took it:
    alice, allowed 'orders.#', consumed every queue."""
    alice_last = USERS + OPS + '[[acl]]\ngroup = "orders-app"\npermissions = ["consume"]\npattern = "orders.#"\n'
    b = broker_factory(alice_last)
    assert _user_may_consume(b, "alice", "orders.eu") and not _user_may_consume(b, "alice", "payroll")
    b.reload(alice_last[:alice_last.index('pattern = "orders.#"')])
    line = b.wait_for_log(r"configuration reload by SIGHUP refused, nothing changed")
    assert "group 'orders-app' consume on every address" in line
    assert not _user_may_consume(b, "alice", "payroll")
