"""TLS for the inter-node connections of a cluster of machines (`[cluster] tls`).

Both ends are verified (mutual TLS): the node that connects checks the listener's
certificate against the cluster's CA (and, by default, that it names the host it
dialled: the advertised address), and the listener requires a certificate from the
same CA of the connecting node (RFC 8446 §4.3.2 CertificateRequest).  The HMAC
handshake of cluster/wire.py runs inside, as without TLS: TLS keeps the bytes private
and the secret still says the peer is a node of this cluster, not just anyone with a
certificate from that CA.

The files are `[cluster] tls_cert_file / tls_key_file / tls_ca_file`, or by default the
broker's own `[tls]` cert_file, key_file and client_ca_file.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from ..server.tls import chosen_file, load_files

SECTION = "[cluster] tls"


@dataclass(frozen=True)
class NodeTls:
    server: ssl.SSLContext       # the inter-node listener's
    client: ssl.SSLContext       # a connection to another node
    verify_hostname: bool


def files(settings: Any) -> tuple[tuple[str, str], tuple[str, str], tuple[str, str]]:
    """(setting, path) of the certificate, key and CA for the inter-node links, each
    named by the setting that gave it; ValueError naming what is missing."""
    cfg, tls = settings.cluster, settings.tls
    cert = chosen_file("tls_cert_file", cfg.tls_cert_file, tls, "cert_file")
    key = chosen_file("tls_key_file", cfg.tls_key_file, tls, "key_file")
    ca = chosen_file("tls_ca_file", cfg.tls_ca_file, tls, "client_ca_file")
    if cert[1] is None or key[1] is None:
        raise ValueError("[cluster] tls needs a certificate: tls_cert_file and tls_key_file, or [tls] cert_file "
                         "and key_file")
    if ca[1] is None:
        raise ValueError("[cluster] tls needs the CA that signs the nodes' certificates: tls_ca_file, or [tls] "
                         "client_ca_file")
    return (cert[0], str(cert[1])), (key[0], str(key[1])), (ca[0], str(ca[1]))


def node_tls(settings: Any) -> NodeTls | None:
    """The contexts of `[cluster] tls` (None: off).  Raises ValueError or OSError (a
    file missing or unreadable, a key that does not match) before anything starts;
    each file named by the setting that gave it (server/tls.py `load_files`)."""
    cfg = settings.cluster
    if cfg is None or not cfg.tls:
        return None
    cert, key, ca = files(settings)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    for ctx in (server, client):
        load_files(SECTION, lambda path, ctx=ctx: ctx.load_verify_locations(cafile=path), **dict([ca]))
        load_files(SECTION, ctx.load_cert_chain, **dict([cert, key]))
    server.verify_mode = ssl.CERT_REQUIRED
    client.check_hostname = cfg.tls_verify_hostname
    return NodeTls(server, client, cfg.tls_verify_hostname)
