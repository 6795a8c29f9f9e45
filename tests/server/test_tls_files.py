"""A TLS listener's files (server/tls.py `server_context`): a file that is missing or
not what it should be stops the start with a line naming the section, the key and
the path; OpenSSL's own errors name none (`[Errno 2] No such file or directory`,
`PEM lib`), which left a user guessing which of three files was meant."""

from __future__ import annotations

import pytest

from amqpbroker.server.tls import server_context
from tests.e2e.helpers_conn import make_self_signed


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls-files")
    cert, key = make_self_signed(d)
    junk = d / "junk.pem"
    junk.write_text("not a certificate\n")
    other_key = d / "other"
    other_key.mkdir()
    _, stranger = make_self_signed(other_key)
    return {"cert": str(cert), "key": str(key), "junk": str(junk), "stranger": str(stranger),
            "missing": str(d / "missing.pem")}


def test_the_right_files_make_a_context(files):
    assert server_context(files["cert"], files["key"], files["cert"]) is not None


@pytest.mark.parametrize("cert, key, ca, section, said", [
    ("missing", "key", None, "[tls]", "[tls]: no such file: cert_file {missing}"),
    ("cert", "missing", None, "[websocket]", "[websocket]: no such file: key_file {missing}"),
    ("cert", "key", "missing", "[tls]", "[tls]: no such file: client_ca_file {missing}"),
    ("junk", "key", None, "[tls]", "[tls] cert_file {junk}, key_file {key}: not PEM of the kind expected"),
    ("cert", "stranger", None, "[tls]", "[tls] cert_file {cert}, key_file {stranger}: not PEM of the kind expected, "
                                        "or a key that does not match"),
    ("cert", "key", "junk", "[tls]", "[tls] client_ca_file {junk}: not PEM of the kind expected"),
])
def test_a_file_that_cannot_be_used_is_named(files, cert, key, ca, section, said):
    with pytest.raises(ValueError) as refused:
        server_context(files[cert], files[key], files[ca] if ca else None, section)
    assert said.format(**files) in str(refused.value)


# The HA replication link (ha/node.py `replication_tls`) and the inter-node links of a
# cluster (cluster/tls.py `node_tls`) load their files the same way: each is named by
# the setting that gave it, its own or the [tls] one it falls back to.

HA = '[ha]\nzookeeper = "127.0.0.1:2181"\nsecret = "0123456789abcdef"\nreplication_tls = true\n'
CLUSTER = ('[cluster]\nzookeeper = "127.0.0.1:1"\nnode_id = "a"\nnodes = ["a", "b"]\n'
           'secret = "0123456789abcdef0123"\ntls = true\n')


def _settings(text: str, files: dict):
    from amqpbroker.config import load_settings
    return load_settings(text=text.format(**files))


def _replication(settings):
    from amqpbroker.ha.node import replication_tls
    return replication_tls(settings)


def _inter_node(settings):
    from amqpbroker.cluster.tls import node_tls
    return node_tls(settings)


@pytest.mark.parametrize("load, text, said", [
    (_replication, HA + 'replication_cert_file = "{missing}"\nreplication_key_file = "{key}"\n',
     "[ha] replication_tls: no such file: replication_cert_file {missing}"),
    (_replication, HA + 'replication_cert_file = "{cert}"\nreplication_key_file = "{stranger}"\n',
     "[ha] replication_tls replication_cert_file {cert}, replication_key_file {stranger}: not PEM"),
    (_replication, HA + 'replication_cert_file = "{cert}"\nreplication_key_file = "{key}"\n'
                        'replication_ca_file = "{junk}"\n',
     "[ha] replication_tls replication_ca_file {junk}: not PEM"),
    (_replication, '[tls]\ncert_file = "{cert}"\nkey_file = "{missing}"\n' + HA,
     "[ha] replication_tls: no such file: [tls] key_file {missing}"),
    (_inter_node, CLUSTER + 'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\ntls_ca_file = "{missing}"\n',
     "[cluster] tls: no such file: tls_ca_file {missing}"),
    (_inter_node, CLUSTER + 'tls_cert_file = "{junk}"\ntls_key_file = "{key}"\ntls_ca_file = "{cert}"\n',
     "[cluster] tls tls_cert_file {junk}, tls_key_file {key}: not PEM"),
    (_inter_node, '[tls]\ncert_file = "{cert}"\nkey_file = "{stranger}"\nclient_ca_file = "{cert}"\n' + CLUSTER,
     "[cluster] tls [tls] cert_file {cert}, [tls] key_file {stranger}: not PEM of the kind expected, "
     "or a key that does not match"),
    (_inter_node, '[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\nclient_ca_file = "{missing}"\n' + CLUSTER,
     "[cluster] tls: no such file: [tls] client_ca_file {missing}"),
])
def test_a_replication_or_inter_node_file_that_cannot_be_used_is_named(files, load, text, said):
    with pytest.raises(ValueError) as refused:
        load(_settings(text, files))
    assert said.format(**files) in str(refused.value)


def test_the_right_replication_files_make_both_contexts(files):
    text = HA + 'replication_cert_file = "{cert}"\nreplication_key_file = "{key}"\n'
    server, client = _replication(_settings(text, files))
    assert server is not None and client is not None


def test_the_right_inter_node_files_make_both_contexts(files):
    text = CLUSTER + 'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\ntls_ca_file = "{cert}"\n'
    made = _inter_node(_settings(text, files))
    assert made is not None and made.server.verify_mode.name == "CERT_REQUIRED"
