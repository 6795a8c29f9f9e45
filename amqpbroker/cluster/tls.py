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
from pathlib import Path
from typing import Any

from ..server.tls import load_files

SECTION = "[cluster] tls"


@dataclass(frozen=True)
class NodeTls:
    server: ssl.SSLContext       # the inter-node listener's
    client: ssl.SSLContext       # a connection to another node
    verify_hostname: bool


def files(settings: Any) -> tuple[Path, Path, Path]:
    """(certificate, key, CA) for the inter-node links; ValueError naming what is missing."""
    cfg, tls = settings.cluster, settings.tls
    cert = cfg.tls_cert_file or (tls.cert_file if tls is not None else None)
    key = cfg.tls_key_file or (tls.key_file if tls is not None else None)
    ca = cfg.tls_ca_file or (tls.client_ca_file if tls is not None else None)
    if cert is None or key is None:
        raise ValueError("[cluster] tls needs a certificate: tls_cert_file and tls_key_file, or [tls] cert_file "
                         "and key_file")
    if ca is None:
        raise ValueError("[cluster] tls needs the CA that signs the nodes' certificates: tls_ca_file, or [tls] "
                         "client_ca_file")
    return Path(cert), Path(key), Path(ca)


def node_tls(settings: Any) -> NodeTls | None:
    """The contexts of `[cluster] tls` (None: off).  Raises ValueError or OSError (a
    file missing or unreadable, a key that does not match) before anything starts."""
    cfg = settings.cluster
    if cfg is None or not cfg.tls:
        return None
    cert, key, ca = files(settings)
    # Each file named by the setting that gave it (server/tls.py `load_files`):
    # OpenSSL's own errors name none.
    pair = {("tls_cert_file" if cfg.tls_cert_file else "[tls] cert_file"): str(cert),
            ("tls_key_file" if cfg.tls_key_file else "[tls] key_file"): str(key)}
    authority = {("tls_ca_file" if cfg.tls_ca_file else "[tls] client_ca_file"): str(ca)}
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    for ctx in (server, client):
        load_files(SECTION, lambda path, ctx=ctx: ctx.load_verify_locations(cafile=path), **authority)
        load_files(SECTION, ctx.load_cert_chain, **pair)
    server.verify_mode = ssl.CERT_REQUIRED
    client.check_hostname = cfg.tls_verify_hostname
    return NodeTls(server, client, cfg.tls_verify_hostname)
