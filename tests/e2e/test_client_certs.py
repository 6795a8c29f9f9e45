"""SASL EXTERNAL with TLS client certificates, end to end: a CA, the broker's and
clients' certificates made with the openssl CLI; python-qpid-proton clients
present theirs; the certificate's subject is the user the ACLs see; a certificate
from another CA fails the TLS handshake (a log line, the broker runs on)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from proton import Message, SSLDomain

from tests.client import ConnectionException, LinkDetached, connect

pytestmark = pytest.mark.e2e


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(key),
             "-out", str(cert), "-subj", f"/CN={name}")
    return cert, key


def _signed(d: Path, name: str, subject: str, ca: tuple[Path, Path], server: bool = False) -> tuple[Path, Path]:
    cert, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", subject)
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n" if server else "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "2", "-out", str(cert), "-extfile", str(ext))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = _ca(d, "test-ca")
    rogue = _ca(d, "rogue-ca")
    return {
        "ca": ca[0],
        "server": _signed(d, "server", "/CN=localhost", ca, server=True),
        "app1": _signed(d, "app1", "/O=Example/CN=app1", ca),
        "app2": _signed(d, "app2", "/O=Example/CN=app2", ca),
        "nobody": _signed(d, "nobody", "/O=Example/CN=nobody", ca),
        "rogue": _signed(d, "rogue", "/O=Example/CN=app1", rogue),
        # A CN that reads like the DN a mapping names: never the same thing.
        "lookalike": _signed(d, "lookalike", "/CN=CN=app2,O=Example", ca),
    }


def tls_config(pki) -> str:
    """No anonymous; a TLS listener that requires client certificates from the test CA."""
    cert, key = pki["server"]
    return f"""
allow_anonymous = false
[tls]
port = 0
cert_file = "{cert}"
key_file = "{key}"
client_ca_file = "{pki['ca']}"
"""


@pytest.fixture(scope="module")
def cert_broker(pki, tmp_path_factory):
    from tests.broker_process import BrokerProcess
    config = tls_config(pki) + """[tls.cert_users]
"CN=app2,O=Example" = "billing"

[users.app1]
[users.billing]

[[acl]]
user = "app1"
pattern = "orders.#"
permissions = ["send", "consume"]
[[acl]]
user = "billing"
pattern = "invoices.#"
permissions = ["send", "consume"]
"""
    proc = BrokerProcess(tmp_path_factory.mktemp("certs") / "data", config=config).start()
    yield proc
    proc.stop()


def _domain(pki, who: str) -> SSLDomain:
    domain = SSLDomain(SSLDomain.MODE_CLIENT)
    domain.set_trusted_ca_db(str(pki["ca"]))
    domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
    cert, key = pki[who]
    domain.set_credentials(str(cert), str(key), None)
    return domain


def _external(broker, pki, who: str, container: str):
    return connect(f"amqps://localhost:{broker.ports['amqps']}", container_id=container,
                   ssl_domain=_domain(pki, who), allowed_mechs="EXTERNAL", timeout=10)


def _round_trip(conn, address: str) -> None:
    rcv = conn.create_receiver(address)
    conn.create_sender(address).send(Message(body=address))
    assert rcv.receive(timeout=10).body == address
    rcv.accept()


def test_certificate_cn_is_the_user_for_acls(cert_broker, pki):
    conn = _external(cert_broker, pki, "app1", "cert-app1")
    try:
        _round_trip(conn, "orders.eu")
        with pytest.raises(LinkDetached) as refused:
            conn.create_receiver("invoices.2024")
        assert "user 'app1' is not allowed to consume on 'invoices.2024'" in str(refused.value)
    finally:
        conn.close()
    line = cert_broker.wait_for_log(r"connection open: .*container=cert-app1 ")
    assert "user=app1" in line


def test_subject_mapping_names_another_user(cert_broker, pki):
    conn = _external(cert_broker, pki, "app2", "cert-app2")
    try:
        _round_trip(conn, "invoices.2024")
        with pytest.raises(LinkDetached):
            conn.create_sender("orders.eu")
    finally:
        conn.close()
    assert "user=billing" in cert_broker.wait_for_log(r"connection open: .*container=cert-app2 ")


def test_certificate_of_unknown_ca_fails_the_handshake(cert_broker, pki):
    with pytest.raises(ConnectionException):
        _external(cert_broker, pki, "rogue", "cert-rogue")
    line = cert_broker.wait_for_log(r"amqps: TLS handshake with 127\.0\.0\.1:\d+ failed")
    assert "certificate" in line.lower()
    assert "container=cert-rogue" not in cert_broker.log_text()
    # ... and the broker serves the next client.
    conn = _external(cert_broker, pki, "app1", "cert-after-rogue")
    conn.close()


def test_no_client_certificate_fails_the_handshake(cert_broker, pki):
    domain = SSLDomain(SSLDomain.MODE_CLIENT)
    domain.set_trusted_ca_db(str(pki["ca"]))
    domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
    with pytest.raises(ConnectionException):
        connect(f"amqps://localhost:{cert_broker.ports['amqps']}", container_id="cert-none",
                ssl_domain=domain, allowed_mechs="EXTERNAL", timeout=10)
    cert_broker.wait_for_log(r"amqps: TLS handshake with .* failed: .*certificate")


def test_external_is_offered_only_on_the_verifying_listener(cert_broker):
    assert "amqps listening" in cert_broker.log_text()
    tls_line = cert_broker.wait_for_log(r"amqps listening on")
    plain_line = cert_broker.wait_for_log(r"amqp listening on")
    assert "(SASL EXTERNAL, SCRAM-SHA-256, PLAIN)" in tls_line
    assert "EXTERNAL" not in plain_line


def test_a_certificate_user_must_be_a_configured_user(cert_broker, pki):
    """EXTERNAL consults [users]: a certificate from the right CA whose user is not
    configured does not log in."""
    with pytest.raises(ConnectionException):
        _external(cert_broker, pki, "nobody", "cert-nobody")
    cert_broker.wait_for_log(r"refused during SASL: .*'nobody'.*not a configured user")
    assert "container=cert-nobody" not in cert_broker.log_text()


def test_a_cn_that_spells_a_mapped_dn_is_not_that_dn(cert_broker, pki):
    """The subject `CN=CN\\=app2\\,O\\=Example` has one RDN; the mapping's key
    `CN=app2,O=Example` has two: a DN key matches DNs only, never a CN."""
    opened = None
    try:
        opened = _external(cert_broker, pki, "lookalike", "cert-lookalike")
        opened.close()
    except ConnectionException:
        pass
    if opened is not None:
        line = cert_broker.wait_for_log(r"connection open: .*container=cert-lookalike ")
        assert "user=billing" not in line, line
    # Its CN is no configured user either: refused, and said why.
    assert opened is None
    cert_broker.wait_for_log(r"refused during SASL: .*'CN=app2,O=Example'.*not a configured user")


def test_a_user_removed_by_reload_cannot_log_in_again_with_its_certificate(pki, tmp_path):
    from tests.broker_process import BrokerProcess
    head = tls_config(pki)
    acl = """
[[acl]]
user = "app1"
pattern = "orders.#"
permissions = ["send", "consume"]
[[acl]]
user = "root"
permissions = ["all"]
[users.root]
password = "root-pw"
"""
    broker = BrokerProcess(tmp_path / "data", config=head + "[users.app1]\n" + acl).start()
    try:
        conn = _external(broker, pki, "app1", "cert-before")
        _round_trip(conn, "orders.eu")
        broker.reload(head + acl)              # app1 is no longer a user
        broker.wait_for_log(r"configuration reloaded .*users removed: app1")
        try:
            conn.close()
        except Exception:
            pass
        with pytest.raises(ConnectionException):
            again = _external(broker, pki, "app1", "cert-after")
            again.close()
        assert "container=cert-after" not in broker.log_text()
    finally:
        broker.stop()
