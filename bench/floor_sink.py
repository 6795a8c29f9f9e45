#!/usr/bin/env python3
"""The least a Python AMQP 1.0 server can do for a synchronous durable send: proton's
reactor (the same engine the broker drives), every transfer accepted as it arrives,
with `--sync` after an append of its bytes and one fdatasync on the loop itself.
No queue, no store, no second process: bench/sync_floor.py measures the broker's
round trip against it.  Prints "listening <port>" once it listens.

    python bench/floor_sink.py --port 0 [--sync FILE]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from proton.handlers import MessagingHandler
from proton.reactor import Container


class Sink(MessagingHandler):
    def __init__(self, url: str, fd: int | None):
        super().__init__(prefetch=100, auto_accept=False)
        self.url, self.fd, self.offset = url, fd, 0

    def on_start(self, event):
        event.container.listen(self.url)
        print("listening", self.url.rsplit(":", 1)[1], flush=True)

    def on_message(self, event):
        if self.fd is not None:
            body = event.message.body
            data = body if isinstance(body, bytes) else str(body).encode()
            os.pwrite(self.fd, data, self.offset)
            self.offset += len(data)
            os.fdatasync(self.fd)
        self.accept(event.delivery)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--sync", help="append each message to this file and fdatasync it before accepting")
    a = ap.parse_args()
    fd = os.open(a.sync, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600) if a.sync else None
    Container(Sink(f"127.0.0.1:{a.port or free_port()}", fd)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
