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
