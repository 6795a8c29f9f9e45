"""A container health check that knows a pair's backup (docs/ha.md, Dockerfile).

    python3 -m amqpbroker.ha.health     # exit 0: healthy, 1: not

Healthy: the AMQP listener accepts a TCP connection (a broker alone, or the live
broker of a pair); or, with the listener closed, the management API says this
broker is a backup of a pair (GET /api/health: a backup keeps its AMQP listener
closed on purpose until it takes over).  Ports from the environment the image
sets: AMQPBROKER_PORT (default 5672), AMQPBROKER_MANAGEMENT__PORT (default 8161);
host AMQPBROKER_HEALTH_HOST (default 127.0.0.1).  Standard library only: no
broker module is imported, so a check costs a few milliseconds.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request


def check(host: str, amqp_port: int, management_port: int, timeout: float = 2.0) -> tuple[bool, str]:
    try:
        socket.create_connection((host, amqp_port), timeout).close()
        return True, f"AMQP listener on {host}:{amqp_port} accepts"
    except OSError as exc:
        closed = f"AMQP listener on {host}:{amqp_port}: {exc.strerror or exc}"
    url = f"http://{host}:{management_port}/api/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return False, f"{closed}; {url}: {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{closed}; {url}: {exc}"
    return bool(body.get("healthy")), f"{closed}; {body.get('status')}"


def main() -> int:
    env = os.environ
    ok, why = check(env.get("AMQPBROKER_HEALTH_HOST", "127.0.0.1"), int(env.get("AMQPBROKER_PORT", "5672")),
                    int(env.get("AMQPBROKER_MANAGEMENT__PORT", "8161")))
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
