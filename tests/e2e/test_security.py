"""Authentication (SASL PLAIN / SCRAM-SHA-256 / ANONYMOUS against configured users)
and TLS, end to end against the real broker with python-qpid-proton clients."""

from __future__ import annotations

import socket

import pytest
from proton import SSL, Message, SSLDomain, symbol

from tests.broker_process import BrokerProcess
from tests.client import ConnectionException, connect
from tests.e2e.helpers_conn import (
    SASL_HEADER,
    amqp_frame,
    make_self_signed,
    read_frames,
    run_cli,
)

pytestmark = pytest.mark.e2e

ALICE_PW = "alice-Secr3t!"          # stored in plaintext in the config
BOB_PW = "bob-S3cret-h4shed"         # stored as a `amqpbroker hash-password` hash


@pytest.fixture(scope="module")
def bob_hash():
    out = run_cli(["hash-password", BOB_PW])
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _users(bob_hash: str) -> str:
    return (f'[users.alice]\npassword = "{ALICE_PW}"\n'
            f'[users.bob]\npassword = "{bob_hash}"\n')


@pytest.fixture(scope="module")
def auth_broker(tmp_path_factory, bob_hash):
    proc = BrokerProcess(tmp_path_factory.mktemp("auth") / "data", config=_users(bob_hash)).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def strict_broker(tmp_path_factory, bob_hash, tls_files):
    """`allow_anonymous = false` (top level only: the TLS listener inherits it);
    TLS on an ephemeral port."""
    cert, key = tls_files
    config = ("allow_anonymous = false\n" + _users(bob_hash)
              + f'[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\nport = 0\n')
    proc = BrokerProcess(tmp_path_factory.mktemp("strict") / "data", config=config).start()
    yield proc
    proc.stop()


def _round_trip(conn, address: str, body: str) -> None:
    rcv = conn.create_receiver(address)
    conn.create_sender(address).send(Message(body=body))
    msg = rcv.receive(timeout=10)
    rcv.accept()
    assert msg.body == body


def _login(broker, user, password, mech, container_id, **kw):
    return connect(kw.pop("url", broker.url), container_id=container_id, user=user,
                   password=password, allowed_mechs=mech, allow_insecure_mechs=True, **kw)


# ---------------------------------------------------------------------- SASL

@pytest.mark.parametrize("mech", ["PLAIN", "SCRAM-SHA-256"])
@pytest.mark.parametrize("user,password", [("alice", ALICE_PW), ("bob", BOB_PW)],
                         ids=["plaintext-config", "hashed-config"])
def test_configured_user_authenticates(auth_broker, mech, user, password):
    cid = f"login-{user}-{mech}"
    conn = _login(auth_broker, user, password, mech, cid)
    try:
        _round_trip(conn, f"sec-{user}-{mech}", "authenticated")
    finally:
        conn.close()
    line = auth_broker.wait_for_log(rf"connection open: .*container={cid} ")
    assert f"user={user}" in line


@pytest.mark.parametrize("user,password,mech,reason", [
    ("alice", "wrong-password", "PLAIN", "invalid password"),
    ("alice", "wrong-password", "SCRAM-SHA-256", "invalid proof"),
    ("bob", ALICE_PW, "SCRAM-SHA-256", "invalid proof"),
    ("mallory", "whatever", "PLAIN", ""),
    ("mallory", "whatever", "SCRAM-SHA-256", ""),
])
def test_bad_credentials_are_refused_logged_and_broker_keeps_serving(auth_broker, user, password,
                                                                     mech, reason):
    with pytest.raises(ConnectionException) as info:
        _login(auth_broker, user, password, mech, f"bad-{user}-{mech}", timeout=5)
    assert "unauthorized-access" in str(info.value) or "Authentication failed" in str(info.value)
    line = auth_broker.wait_for_log(
        rf"refused during SASL: authentication failed for user '{user}' \({mech}\)")
    assert reason in line
    assert password not in auth_broker.log_text(), "a password ended up in the log"
    assert f"container=bad-{user}-{mech}" not in auth_broker.log_text()
    # the broker keeps serving
    conn = _login(auth_broker, "alice", ALICE_PW, mech, f"after-bad-{user}-{mech}")
    try:
        _round_trip(conn, "sec-after-bad", "still serving")
    finally:
        conn.close()


def test_anonymous_allowed_on_loopback_by_default(auth_broker):
    listen = auth_broker.wait_for_log(r"amqp listening on")
    assert "ANONYMOUS" in listen and "SCRAM-SHA-256" in listen and "PLAIN" in listen
    conn = connect(auth_broker.url, container_id="anon-default", allowed_mechs="ANONYMOUS")
    try:
        _round_trip(conn, "sec-anon", "anonymous")
    finally:
        conn.close()
    assert "user=anonymous" in auth_broker.wait_for_log(r"connection open: .*container=anon-default ")
    # a client without any SASL layer is let in on loopback too
    conn = connect(auth_broker.url, container_id="no-sasl-default", sasl_enabled=False)
    try:
        _round_trip(conn, "sec-anon", "no sasl")
    finally:
        conn.close()


def test_anonymous_refused_when_disabled(strict_broker):
    listen = strict_broker.wait_for_log(r"amqp listening on")
    assert "ANONYMOUS" not in listen
    with pytest.raises(ConnectionException):
        connect(strict_broker.url, container_id="anon-strict", allowed_mechs="ANONYMOUS", timeout=5)
    with pytest.raises(ConnectionException):
        connect(strict_broker.url, container_id="nosasl-strict", sasl_enabled=False, timeout=5)
    strict_broker.wait_for_log(r"refused during SASL: client skipped SASL")
    assert "container=anon-strict" not in strict_broker.log_text()
    assert "container=nosasl-strict" not in strict_broker.log_text()
    # a real user still gets in
    conn = _login(strict_broker, "alice", ALICE_PW, "SCRAM-SHA-256", "alice-strict")
    try:
        _round_trip(conn, "sec-strict", "alice")
    finally:
        conn.close()


def test_anonymous_init_is_refused_even_if_client_insists(strict_broker):
    """A hand-written sasl-init choosing ANONYMOUS (not offered) gets outcome auth(1)."""
    with socket.create_connection((strict_broker.host, strict_broker.port), timeout=5) as s:
        s.sendall(SASL_HEADER)
        s.sendall(amqp_frame(0, 0x41, [symbol("ANONYMOUS"), b"x"], frame_type=1))
        frames = read_frames(s, until=0x44)
    mechanisms = [f for f in frames if f.descriptor == 0x40]
    outcomes = [f for f in frames if f.descriptor == 0x44]
    assert mechanisms and "ANONYMOUS" not in {str(m) for m in _mechs(mechanisms[0])}
    assert outcomes, frames
    assert int(outcomes[0].value[0]) == 1           # sasl-code auth
    strict_broker.wait_for_log(r"client chose SASL mechanism 'ANONYMOUS', which is not offered")


def _mechs(frame) -> list:
    value = frame.value[0]
    if hasattr(value, "elements"):
        return list(value.elements)
    return [value] if not isinstance(value, list) else value


# ---------------------------------------------------------------------- TLS

def _client_domain(cert=None, verify=SSLDomain.VERIFY_PEER_NAME) -> SSLDomain:
    dom = SSLDomain(SSLDomain.MODE_CLIENT)
    if cert is not None:
        dom.set_trusted_ca_db(str(cert))
    dom.set_peer_authentication(verify)
    return dom


def test_proton_has_tls():
    assert SSL.present(), "python-qpid-proton was built without TLS support"


def test_send_and_receive_over_tls(strict_broker, tls_files):
    cert, _ = tls_files
    assert "amqps" in strict_broker.ports and strict_broker.ports["amqps"] != strict_broker.port
    url = f"amqps://127.0.0.1:{strict_broker.ports['amqps']}"
    # PLAIN is fine without allow_insecure_mechs: the channel is encrypted
    conn = connect(url, container_id="tls-alice", ssl_domain=_client_domain(cert),
                   virtual_host="localhost", user="alice", password=ALICE_PW,
                   allowed_mechs="PLAIN", allow_insecure_mechs=False)
    try:
        ssl = SSL(conn.conn.transport, None)
        assert ssl.cipher_name() and ssl.protocol_name().startswith("TLS")
        _round_trip(conn, "sec-tls", "over tls")
    finally:
        conn.close()
    assert "user=alice" in strict_broker.wait_for_log(r"connection open: .*container=tls-alice ")


def test_tls_with_anonymous_peer_and_scram(strict_broker, tls_files):
    url = f"amqps://127.0.0.1:{strict_broker.ports['amqps']}"
    conn = connect(url, container_id="tls-bob", ssl_domain=_client_domain(verify=SSLDomain.ANONYMOUS_PEER),
                   user="bob", password=BOB_PW, allowed_mechs="SCRAM-SHA-256")
    try:
        _round_trip(conn, "sec-tls-bob", "scram over tls")
    finally:
        conn.close()


def test_tls_listener_inherits_allow_anonymous_false(strict_broker, tls_files):
    cert, _ = tls_files
    listen = strict_broker.wait_for_log(r"amqps listening on")
    assert "ANONYMOUS" not in listen and "PLAIN" in listen
    url = f"amqps://127.0.0.1:{strict_broker.ports['amqps']}"
    with pytest.raises(ConnectionException):
        connect(url, container_id="tls-anon", ssl_domain=_client_domain(cert), virtual_host="localhost",
                allowed_mechs="ANONYMOUS", timeout=5)
    assert "container=tls-anon" not in strict_broker.log_text()


def test_untrusted_server_certificate_is_rejected_by_client(strict_broker):
    url = f"amqps://127.0.0.1:{strict_broker.ports['amqps']}"
    with pytest.raises(ConnectionException) as info:
        connect(url, container_id="tls-untrusted", ssl_domain=_client_domain(), virtual_host="localhost",
                user="alice", password=ALICE_PW, timeout=5)
    assert "certificate verify failed" in str(info.value)


def test_plaintext_client_on_tls_port_fails_and_broker_keeps_serving(strict_broker, tls_files):
    cert, _ = tls_files
    with pytest.raises(ConnectionException):
        connect(f"amqp://127.0.0.1:{strict_broker.ports['amqps']}", container_id="plain-on-tls",
                user="alice", password=ALICE_PW, allowed_mechs="PLAIN", timeout=5)
    assert "container=plain-on-tls" not in strict_broker.log_text()
    assert strict_broker.proc.poll() is None
    conn = connect(f"amqps://127.0.0.1:{strict_broker.ports['amqps']}", container_id="tls-after-plain",
                   ssl_domain=_client_domain(cert), virtual_host="localhost", user="alice",
                   password=ALICE_PW, allowed_mechs="PLAIN")
    try:
        _round_trip(conn, "sec-tls-after", "still serving tls")
    finally:
        conn.close()
    assert "Traceback" not in strict_broker.log_text()


def test_sasl_handshake_timeout_closes_silent_sockets(broker_factory):
    """A socket that connects and never finishes SASL is closed after limits.sasl_timeout."""
    import socket as _socket

    b = broker_factory("[limits]\nsasl_timeout = 0.5\n")
    sock = _socket.create_connection(("127.0.0.1", b.port), timeout=10)
    sock.sendall(b"AMQP\x03\x01\x00\x00")   # SASL header, then silence
    chunks = []
    while True:
        data = sock.recv(4096)
        if not data:
            break
        chunks.append(data)
    sock.close()
    assert b"".join(chunks).startswith(b"AMQP\x03\x01\x00\x00")
    b.wait_for_log(r"closed: handshake timed out")


# ---------------------------------------------------------------------- PLAIN on the network


def test_plaintext_password_in_the_config_is_warned_about(auth_broker):
    line = auth_broker.wait_for_log(r"user 'alice' has a plaintext password in the configuration")
    assert "hash-password" in line
    assert "user 'bob' has a plaintext password" not in auth_broker.log_text()


@pytest.mark.parametrize("allow, offered", [(None, False), (True, True)], ids=["default", "allowed"])
def test_plain_is_not_offered_on_a_network_listener_without_tls(broker_factory, bob_hash, allow, offered):
    """0.0.0.0 is not loopback: the password would cross the network in clear."""
    config = 'host = "0.0.0.0"\n' + ("" if allow is None else f"allow_insecure_plain = {str(allow).lower()}\n")
    proc = broker_factory(config + _users(bob_hash))
    listen = proc.wait_for_log(r"amqp listening on")
    assert ("PLAIN" in listen.replace("SCRAM", "")) is offered, listen
    assert "SCRAM-SHA-256" in listen
    url = f"amqp://127.0.0.1:{proc.port}"
    if offered:
        _login(proc, "alice", ALICE_PW, "PLAIN", "plain-net", url=url).close()
    else:
        with pytest.raises(ConnectionException):
            _login(proc, "alice", ALICE_PW, "PLAIN", "plain-net", url=url, timeout=5)
    _login(proc, "alice", ALICE_PW, "SCRAM-SHA-256", "scram-net", url=url).close()
