"""`amqpbroker send` / `amqpbroker receive`: a message or two from the command line
(python-qpid-proton's blocking client), for a first try and for scripts.

    amqpbroker send orders "first order" "second order"
    printf '%s\n' a b c | amqpbroker send orders -          # one message per line
    amqpbroker receive orders --count 2
    amqpbroker receive amq.topic/prices.# --wait 30          # a topic: messages sent from now on
    amqpbroker send --url amqps://broker:5671 --user app orders "hello"    # password prompted

Sends are durable and wait for the broker's Accepted (exit status 1 when it
refuses one, with its condition); `receive` prints one body per line and accepts
what it printed.  Exit status: 0 done, 1 refused or nothing received with --count,
3 broker unreachable.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import Iterable

DEFAULT_URL = "amqp://127.0.0.1:5672"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    send = sub.add_parser("send", help="send messages to an address (one per argument, or per line of stdin)")
    send.add_argument("address")
    send.add_argument("body", nargs="*", help="message bodies; `-` or none: one message per line of stdin")
    send.add_argument("--subject", help="the messages' subject (routing key on an exchange)")
    send.add_argument("--non-durable", action="store_true", help="send non-durable messages")
    receive = sub.add_parser("receive", help="receive messages from an address and print their bodies")
    receive.add_argument("address")
    receive.add_argument("--count", type=int, default=0, help="stop after this many (0: until --wait passes "
                                                              "without a message)")
    receive.add_argument("--wait", type=float, default=5.0, help="seconds to wait for the next message")
    for p in (send, receive):
        p.add_argument("--url", default=os.environ.get("AMQPBROKER_URL", DEFAULT_URL),
                       help=f"broker address (default $AMQPBROKER_URL or {DEFAULT_URL}); amqps:// for TLS")
        p.add_argument("--user", help="SASL user (SCRAM-SHA-256, or PLAIN over TLS / loopback)")
        p.add_argument("--password", help="the password (prompted for when a user is given)")


def _connect(args: argparse.Namespace):
    from proton.utils import BlockingConnection

    password = args.password
    if args.user and password is None:
        password = getpass.getpass(f"password for {args.user}: ")
    options = {"user": args.user, "password": password} if args.user else {}
    return BlockingConnection(args.url, timeout=30, **options)


def _bodies(args: argparse.Namespace) -> Iterable[str]:
    if not args.body or args.body == ["-"]:
        return (line.rstrip("\n") for line in sys.stdin)
    return args.body


def main(args: argparse.Namespace) -> int:
    from proton import ConnectionException, Message, Timeout
    from proton.utils import LinkDetached, SendException

    try:
        conn = _connect(args)
    except (ConnectionException, Timeout, OSError) as exc:
        print(f"amqpbroker: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 3
    try:
        if args.command == "send":
            sender = conn.create_sender(args.address)
            sent = 0
            for body in _bodies(args):
                sender.send(Message(body=body, subject=args.subject, durable=not args.non_durable))
                sent += 1
            print(f"sent {sent} message(s) to {args.address}", file=sys.stderr)
            return 0
        receiver = conn.create_receiver(args.address, credit=max(1, min(args.count or 100, 100)))
        got = 0
        while not args.count or got < args.count:
            try:
                msg = receiver.receive(timeout=args.wait)
            except Timeout:
                break
            print(msg.body if isinstance(msg.body, str) else repr(msg.body), flush=True)
            receiver.accept()
            got += 1
        print(f"received {got} message(s) from {args.address}", file=sys.stderr)
        return 1 if args.count and got < args.count else 0
    except (LinkDetached, SendException, ConnectionException) as exc:
        print(f"amqpbroker: {args.command} refused: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 — already gone: nothing to close
            pass


__all__ = ["add_parsers", "main"]
