"""Check that the installed python-qpid-proton can do what the broker's clients and
tests need: TLS, and SASL SCRAM-SHA-256 as a client.

python-qpid-proton compiles its C core when it is installed from source, and
silently leaves out TLS when the OpenSSL headers are missing, and every SASL
mechanism but ANONYMOUS, PLAIN and EXTERNAL when the Cyrus SASL headers are
missing.  pip then keeps that wheel in its cache and installs it again later,
after the headers are there.  scripts/setup.sh runs this check and rebuilds the
package without the cache when it fails.

The SCRAM check is a real exchange: proton's client transport authenticates
with SCRAM-SHA-256 against the broker's own SASL server (server/sasl.py), in
memory, no socket.  Exit status 0 when everything is there; otherwise one line
per missing capability on stderr and status 1.
"""

from __future__ import annotations

import sys


def tls_missing() -> str | None:
    import proton
    return None if proton.SSL.present() else "python-qpid-proton was built without TLS (OpenSSL)"


def scram_missing() -> str | None:
    from proton import SASL, Connection, Transport

    from amqpbroker.security.users import UserStore, hash_password
    from amqpbroker.server.sasl import Handshake, HandshakeState, SaslPolicy

    if not SASL.extended():
        return ("python-qpid-proton was built without Cyrus SASL: no SCRAM-SHA-256 "
                "(only ANONYMOUS, PLAIN, EXTERNAL)")
    server = Handshake(SaslPolicy(("SCRAM-SHA-256",), allow_no_sasl=False),
                       UserStore({"check": hash_password("check-password")}))
    client = Transport()
    sasl = client.sasl()
    sasl.allowed_mechs("SCRAM-SHA-256")
    conn = Connection()
    conn.user, conn.password = "check", "check-password"
    client.bind(conn)
    conn.open()
    for _ in range(50):
        pending = client.pending()
        if pending > 0:
            server.feed(client.peek(pending))
            client.pop(pending)
        out = server.data_to_send()
        if out:
            client.push(out)
        if server.state in (HandshakeState.DONE, HandshakeState.FAILED):
            break
    if server.state is HandshakeState.DONE and (server.user, server.mechanism) == ("check", "SCRAM-SHA-256"):
        return None
    why = server.error or (client.condition.description if client.condition else "no outcome")
    return f"python-qpid-proton cannot authenticate with SCRAM-SHA-256: {why}"


def main() -> int:
    problems = [p for p in (tls_missing(), scram_missing()) if p]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
