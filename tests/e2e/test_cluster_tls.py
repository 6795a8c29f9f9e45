"""End to end: `[cluster] tls`, a cluster of three broker processes and a real ZooKeeper
(tests/cluster_process.py ZkCluster) whose inter-node connections are TLS, verified both
ways against the cluster's CA (cluster/tls.py).

How it could fail, and the test for each: the links are not encrypted at all (a plain
socket gets the node handshake's nonce: it must get nothing readable); a peer with a
certificate from another CA, or none, is let in (the TLS handshake must fail and be
logged); forwarding breaks over TLS (a message through a node that owns nothing);
a node told to use TLS without a certificate starts anyway (it must refuse to start).
"""

from __future__ import annotations

import re
import socket
import ssl
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from proton import Message

from amqpbroker.core.placement import slot_of, static_map
from tests.client import connect
from tests.cluster_process import ZkCluster
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender

pytestmark = pytest.mark.e2e

OWNERS = static_map(["a", "b", "c"], {"a": 0}).owners
INTER_RE = re.compile(r"cluster: node (\w+) of .* inter-node ([\d.]+):(\d+) \(TLS\)")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(key),
             "-out", str(cert), "-subj", f"/CN={name}")
    return cert, key


def _node_cert(d: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A node's certificate: names the host the nodes dial (127.0.0.1), usable as a
    server's and as a client's (no extended key usage: mutual TLS)."""
    cert, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "2", "-out", str(cert), "-extfile", str(ext))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster-pki")
    ca = _ca(d, "cluster-ca")
    rogue = _ca(d, "rogue-ca")
    return {"ca": ca[0], "node": _node_cert(d, "node", ca), "rogue": _node_cert(d, "rogue", rogue)}


@pytest.fixture(scope="module")
def tls_cluster(pki, tmp_path_factory):
    cert, key = pki["node"]
    extra = (f'tls = true\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\ntls_ca_file = "{pki["ca"]}"\n')
    cl = ZkCluster(tmp_path_factory.mktemp("zk-tls"), cluster_extra=extra).start()
    yield cl
    cl.stop()


def inter_node_address(cl: ZkCluster, node: str) -> tuple[str, int]:
    line = cl.members[node].wait_for_log(rf"cluster: node {node} of .*inter-node .* \(TLS\)", timeout=10)
    m = INTER_RE.search(line)
    return m.group(2), int(m.group(3))


def owned_by(node: str) -> str:
    while True:
        name = f"q-{uuid.uuid4().hex[:8]}"
        if OWNERS[slot_of(name)] == node:
            return name


def test_messages_cross_nodes_over_tls(tls_cluster):
    q = owned_by("b")
    conn = connect(tls_cluster.url)   # node a: owns nothing, everything forwarded
    try:
        snd = sender(conn, q)
        for i in range(20):
            snd.send(Message(body=i, durable=True))   # each Accepted after b's commit
        assert drain_bodies(conn, receiver(conn, q, credit=50)) == list(range(20))
    finally:
        conn.close()


def test_the_inter_node_listener_says_nothing_in_clear(tls_cluster):
    """A plain TCP peer never sees the node handshake's nonce (the listener waits for a
    TLS ClientHello, and what it sends back is TLS, not the 16 bytes)."""
    host, port = inter_node_address(tls_cluster, "b")
    with socket.create_connection((host, port), timeout=5) as plain:
        plain.settimeout(1.0)
        try:
            got = plain.recv(64)
        except socket.timeout:
            got = b""
    assert got == b"", "the plain nonce would be 16 bytes sent at once"


def test_a_node_certificate_from_the_clusters_ca_gets_the_node_handshake(tls_cluster, pki):
    host, port = inter_node_address(tls_cluster, "c")
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    ctx.load_cert_chain(*map(str, pki["node"]))
    with socket.create_connection((host, port), timeout=5) as raw, ctx.wrap_socket(raw, server_hostname=host) as tls:
        tls.settimeout(5)
        nonce = tls.recv(64)
    assert len(nonce) == 16   # cluster/wire.py: the owner's nonce, inside TLS


@pytest.mark.parametrize("client_cert", ["rogue", None])
def test_a_peer_without_a_certificate_of_the_clusters_ca_is_refused_and_logged(tls_cluster, pki, client_cert):
    host, port = inter_node_address(tls_cluster, "b")
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    if client_cert is not None:
        ctx.load_cert_chain(*map(str, pki[client_cert]))
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        with socket.create_connection((host, port), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                tls.settimeout(5)
                if not tls.recv(64):   # TLS 1.3: the refusal may come with the first read
                    raise ConnectionError("closed")
    tls_cluster.members["b"].wait_for_log(r"cluster: TLS handshake with 127\.0\.0\.1:\d+ failed", timeout=10)


def test_a_node_told_to_use_tls_without_a_certificate_does_not_start(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('[cluster]\nzookeeper = "127.0.0.1:1"\nnode_id = "a"\nnodes = ["a", "b"]\n'
                   'secret = "0123456789abcdef0123"\ntls = true\n')
    run = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir",
                          str(tmp_path / "data"), "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60,
                         env={"AMQPBROKER_MANAGEMENT__PORT": "0", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2
    assert "[cluster] tls needs a certificate" in run.stderr


def test_tls_without_zookeeper_is_a_configuration_error():
    from amqpbroker.config import ClusterConfig
    with pytest.raises(ValueError, match="tls goes with zookeeper"):
        ClusterConfig(tls=True)
    with pytest.raises(ValueError, match="go together"):
        ClusterConfig(zookeeper="zk:2181", node_id="a", nodes=["a"], secret="x" * 16, tls_cert_file="c.pem")
