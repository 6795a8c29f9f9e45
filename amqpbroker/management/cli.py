"""`amqpbroker admin …`: the management API from the command line (httpx).

Tables (rich) for people, `--json` for scripts.  Exit status: 0 done, 1 the broker
refused (the API's error is printed), 2 usage error, 3 broker unreachable.

    amqpbroker admin queues
    amqpbroker admin queues --name 'orders.*' --sort depth --limit 20
    amqpbroker admin subscriptions --abandoned --idle 7d
    amqpbroker admin delete-subscription orders-audit --namespace billing-app --force
    amqpbroker admin --url https://broker:8161 --user admin close-connection 12
    amqpbroker admin dlq replay DLQ --filter "JMSType = 'order'" --limit 100
    amqpbroker admin move orders --to orders.parked
    amqpbroker admin jobs
    amqpbroker admin cancel-job move-3
    amqpbroker admin messages DLQ --limit 20
    amqpbroker admin backup /var/backups/amqpbroker/2024-05-01
    amqpbroker admin reload
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
from typing import Any, Callable
from urllib.parse import quote

from ..core.durations import format_duration, parse_duration
from ..core.numbers import ascii_int

DEFAULT_URL = "http://127.0.0.1:8161"
DEFAULT_QUEUE_LIMIT = 100


# ---------------------------------------------------------------------- formatting (pure)

def _ago(epoch: float | None, now: float) -> str:
    return "never" if epoch is None else f"{format_duration(now - epoch)} ago"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _kind(s: dict) -> str:
    parts = ["durable" if s["durable"] else "non-durable"]
    if s["shared"]:
        parts.append("shared")
    if s["global"]:
        parts.append("global")
    return ", ".join(parts)


Columns = list[str]
Rows = list[list[str]]


def table_for(command: str, data: list[dict], now: float | None = None) -> tuple[Columns, Rows]:
    """Column titles and cell texts for a listing command."""
    now = time.time() if now is None else now
    if command == "queues":
        cols = ["name", "depth", "bytes", "consumers", "in/s", "out/s", "enqueued", "delivered", "acked",
                "last delivered"]
        rows = [[q["name"], str(q["depth"]), _bytes(q["bytes"]), str(q["consumers"]),
                 f"{q['enqueue_rate']:.1f}", f"{q['ack_rate']:.1f}", str(q["enqueued_total"]),
                 str(q["delivered_total"]), str(q["acked_total"]), _ago(q["last_delivered_at"], now)]
                for q in data]
    elif command == "exchanges":
        cols = ["name", "type", "durable", "built-in", "bindings"]
        rows = [[e["name"], e["type"], _yes(e["durable"]), _yes(e["builtin"]), str(e["bindings"])]
                for e in data]
    elif command == "bindings":
        cols = ["exchange", "key", "queue", "selector", "no-local"]
        rows = [[b["exchange"], b["key"], b["queue"], b["selector"] or "", _yes(b["no_local"])]
                for b in data]
    elif command == "subscriptions":
        cols = ["name", "namespace", "topic", "selector", "kind", "consumers", "pending", "bytes",
                "created", "last delivered", "last consumer", "abandoned"]
        rows = [[s["name"], s["namespace"], s["topic"], s["selector"] or "", _kind(s),
                 str(s["consumers"]), str(s["pending"]), _bytes(s["pending_bytes"]),
                 _ago(s["created_at"], now), _ago(s["last_delivered_at"], now),
                 _ago(s["last_consumer_at"], now), "ABANDONED" if s["abandoned"] else ""] for s in data]
    elif command == "connections":
        cols = ["id", "container-id", "user", "remote address", "listener", "sessions", "links"]
        rows = [[str(c["id"]), c["container_id"] or "", c["user"] or "", c["remote_address"],
                 c["listener"], str(c["sessions"]), str(c["links"])] for c in data]
    else:
        raise ValueError(f"no table for '{command}'")
    return cols, rows


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def title_for(command: str, shown: int, total: int | None = None, offset: int = 0) -> str:
    """"queues (3)", or for a page of a longer listing "queues (3 of 10; --offset 3 for more)"."""
    if total is None or (offset == 0 and shown >= total):
        return f"{command} ({shown})"
    more = f"; --offset {offset + shown} for more" if offset + shown < total else ""
    first = f", from {offset + 1}" if offset else ""
    return f"{command} ({shown} of {total}{first}{more})"


def print_table(command: str, data: list[dict], out: Any = None, title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    cols, rows = table_for(command, data)
    out = out or sys.stdout
    tty = getattr(out, "isatty", lambda: False)()
    # A pipe or file gets the whole table (no folding at 80 columns).
    console = Console(file=out, soft_wrap=False, width=None if tty else 250)
    table = Table(title=title or f"{command} ({len(rows)})", title_justify="left")
    numeric = {"depth", "bytes", "consumers", "in/s", "out/s", "enqueued", "delivered", "acked",
               "bindings", "pending", "sessions", "links", "id"}
    for col in cols:
        table.add_column(col, justify="right" if col in numeric else "left", overflow="fold")
    for row, item in zip(rows, data):
        style = "bold yellow" if command == "subscriptions" and item.get("abandoned") else None
        table.add_row(*row, style=style)
    console.print(table)


def move_summary(verb: str, r: dict) -> str:
    """One line for a move or replay report."""
    where = ", ".join(f"{n} to {d}" for d, n in r["destinations"].items())
    text = f"{verb}: {r['moved']} message(s) moved from '{r['queue']}'" + (f" ({where})" if where else "")
    if r["skipped"]:
        text += "; left in place: " + ", ".join(f"{n} {why}" for why, n in r["skip_reasons"].items())
    if r["stopped"]:
        text += f"; stopped: {r['stopped']}"
    return text


def _wait(args: argparse.Namespace) -> float:
    """Seconds a request may wait for a job to end (within the HTTP timeout)."""
    return max(0.0, min(args.timeout - 1.0, 30.0))


def follow(client: Any, job: dict, args: argparse.Namespace) -> dict:
    """Wait for a move or replay job to end (it runs on the broker whatever we do):
    Ctrl-C cancels it (DELETE /api/jobs/{id})."""
    try:
        while job["state"] == "running":
            job = client.call("GET", job["href"], wait=_wait(args))
    except KeyboardInterrupt:
        job = client.call("DELETE", job["href"])
    return job


def message_rows(page: dict) -> Rows:
    rows = []
    for m in page["messages"]:
        props = m["properties"] or {}
        ann = m["message_annotations"] or {}
        body = m["body"]
        preview = str(body.get("preview") or "")[:60] + ("…" if body.get("truncated") else "")
        dlq = ann.get("x-opt-amqpbroker-dlq-queue")
        origin = f"{dlq} ({ann.get('x-opt-amqpbroker-dlq-reason')})" if dlq else ""
        rows.append([str(m["sequence"]), m["state"], str(props.get("message_id") or ""),
                     str(props.get("subject") or ""), str(m["delivery_count"]), _bytes(m["size"]),
                     json.dumps(m["application_properties"] or {})[:60], origin, preview])
    return rows


def print_messages(page: dict, out: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    tty = getattr(out, "isatty", lambda: False)()
    console = Console(file=out, soft_wrap=False, width=None if tty else 250)
    shown = len(page["messages"])
    table = Table(title=f"messages of {page['queue']} ({shown} from {page['offset'] + 1}; depth {page['depth']}, "
                        f"{page['unacked']} held by consumers)" if shown else
                  f"messages of {page['queue']} (none from {page['offset'] + 1}; depth {page['depth']})",
                  title_justify="left")
    for col in ("seq", "state", "message-id", "subject", "deliveries", "size", "application-properties",
                "dead-lettered from", "body"):
        table.add_column(col, overflow="fold")
    for row in message_rows(page):
        table.add_row(*row)
    console.print(table)


# ---------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    # In the sub-commands the defaults are SUPPRESS so options given before the
    # command are not reset by the sub-parser.
    def add_common(p: argparse.ArgumentParser, top: bool) -> None:
        d = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
        p.add_argument("--url", default=d(os.environ.get("AMQPBROKER_ADMIN_URL", DEFAULT_URL)),
                       help=f"management API address (default $AMQPBROKER_ADMIN_URL or {DEFAULT_URL})")
        p.add_argument("--user", default=d(os.environ.get("AMQPBROKER_ADMIN_USER")),
                       help="user for HTTP basic authentication (default $AMQPBROKER_ADMIN_USER)")
        p.add_argument("--password", default=d(os.environ.get("AMQPBROKER_ADMIN_PASSWORD")),
                       help="password (default $AMQPBROKER_ADMIN_PASSWORD; prompted when a user is given)")
        p.add_argument("--json", action="store_true", default=d(False), help="print JSON, for scripts")
        p.add_argument("--timeout", type=float, default=d(10.0), help="seconds (default 10)")
        p.add_argument("--cacert", default=d(None), help="CA certificate for an https URL")
        p.add_argument("--insecure", action="store_true", default=d(False),
                       help="do not verify the server certificate")

    p = argparse.ArgumentParser(prog="amqpbroker admin", description="Manage a running amqpbroker.")
    add_common(p, True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        add_common(sp, False)
        return sp

    sp = cmd("queues", "list queues: depth, bytes, consumers, rates and totals (a page at a time)")
    sp.add_argument("--name", help="only names matching this glob (orders.*) or prefix (orders.)")
    sp.add_argument("--sort", choices=("name", "depth"), default="name",
                    help="by name (default) or by depth, deepest first")
    sp.add_argument("--limit", type=int, default=DEFAULT_QUEUE_LIMIT,
                    help=f"at most this many queues (default {DEFAULT_QUEUE_LIMIT}, at most 10000)")
    sp.add_argument("--offset", type=int, default=0, help="skip this many first (the next page)")
    cmd("exchanges", "list exchanges")
    cmd("bindings", "list bindings")
    sp = cmd("subscriptions", "list subscriptions (the abandoned-subscription report with --abandoned)")
    sp.add_argument("--abandoned", action="store_true", help="only subscriptions without a consumer for --idle")
    sp.add_argument("--idle", default="7d", help="idle time that makes a durable subscription abandoned "
                                                 "(default 7d; e.g. 90s, 12h, 2w)")
    cmd("connections", "list AMQP connections")
    sp = cmd("purge", "remove the ready messages of a queue")
    sp.add_argument("queue")
    sp = cmd("delete-subscription", "delete a subscription and its backlog (admin unsubscribe)")
    sp.add_argument("name")
    sp.add_argument("--namespace", help="the client-id, or _global_ (needed when the name is ambiguous)")
    dur = sp.add_mutually_exclusive_group()
    dur.add_argument("--durable", dest="durable", action="store_const", const=True, default=None)
    dur.add_argument("--non-durable", dest="durable", action="store_const", const=False)
    sp.add_argument("--force", action="store_true",
                    help="detach attached consumers (amqp:resource-deleted) instead of refusing")
    sp = cmd("close-connection", "close a connection with amqp:connection:forced")
    sp.add_argument("id", type=int)
    sp = cmd("dlq", "dead-letter queues: `dlq replay QUEUE` sends messages back to their origin")
    sp.add_argument("action", choices=("replay",))
    sp.add_argument("queue")
    _move_options(sp, required_to=False)
    sp = cmd("move", "move waiting messages of a queue to another address, each atomically")
    sp.add_argument("queue")
    _move_options(sp, required_to=True)
    cmd("jobs", "moves and replays running or recently ended (progress, report)")
    sp = cmd("cancel-job", "cancel a running move or replay (what moved stays moved)")
    sp.add_argument("id")
    sp = cmd("messages", "browse a queue's waiting messages (nothing is delivered or changed)")
    sp.add_argument("queue")
    sp.add_argument("--offset", type=int, default=0, help="skip this many first")
    sp.add_argument("--limit", type=int, default=20, help="at most this many (default 20, at most 1000)")
    sp.add_argument("--selector", help="JMS selector: only the messages it accepts")
    sp = cmd("backup", "hot backup: a consistent copy of the running broker's store into DEST (on its host)")
    sp.add_argument("dest", help="a new or empty directory on the broker's host (absolute path)")
    sp = cmd("reload", "live reload: the broker re-reads its configuration file (users, ACLs, expiry policies, "
                       "queue limits)")
    sp.add_argument("--allow-open", action="store_true",
                    help="take a file that turns access control off, removes every user or gives the "
                         "anonymous identity more (refused otherwise)")
    return p


def _move_options(sp: argparse.ArgumentParser, *, required_to: bool) -> None:
    sp.add_argument("--to", required=required_to,
                    help="destination address" + ("" if required_to else " (default: each message's origin)"))
    sp.add_argument("--filter", "--selector", dest="selector", help="JMS selector: only the messages it accepts")
    sp.add_argument("--limit", type=int, default=0, help="at most this many (default: all)")


def reload_summary(r: dict) -> str:
    """One line per thing a reload changed (pure)."""
    lines = [f"configuration reloaded from {r['source']}" + ("" if r["changed"] else ": nothing reloadable changed")]
    for key, what in (("users_added", "users added"), ("users_removed", "users removed"),
                      ("users_changed", "users changed")):
        if r.get(key):
            lines.append(f"  {what}: {', '.join(r[key])}")
    for key, what in (("acl_changed", "[[acl]] changed"), ("anonymous_changed", "[anonymous] changed"),
                      ("expiry_policies_changed", "expiry policies changed")):
        if r.get(key):
            lines.append(f"  {what}")
    if r.get("queue_limits_changed"):
        lines.append(f"  limits changed on {len(r['queue_limits_changed'])} queue(s): "
                     f"{', '.join(sorted(r['queue_limits_changed']))}")
    lines.append(f"  {r['connections_closed']} connection(s) closed, {r['links_detached']} link(s) detached")
    if r.get("restart_needed"):
        lines.append(f"  needs a restart to apply: {', '.join(r['restart_needed'])}")
    for what in r.get("opened") or ():
        lines.append(f"  opened (--allow-open): {what}")
    return "\n".join(lines)


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Client:
    def __init__(self, args: argparse.Namespace):
        import httpx

        auth = None
        if args.user:
            password = args.password
            if password is None:
                password = getpass.getpass(f"password for {args.user}: ") if sys.stdin.isatty() else ""
            auth = (args.user, password)
        verify: Any = True
        if args.insecure:
            verify = False
        elif args.cacert:
            import ssl
            verify = ssl.create_default_context(cafile=args.cacert)
        self.http = httpx.Client(base_url=args.url.rstrip("/"), auth=auth, timeout=args.timeout, verify=verify)
        self.total: int | None = None       # X-Total-Count of the last listing

    def call(self, method: str, path: str, body: dict | None = None, **params: Any) -> Any:
        query = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items() if v is not None}
        # Changes say they are JSON: the API refuses other content types on them (a
        # browser cannot send that cross-origin without asking first).
        headers = {} if method in ("GET", "HEAD") else {"Content-Type": "application/json"}
        content = None if body is None else json.dumps(body).encode()
        resp = self.http.request(method, path, params=query, headers=headers, content=content)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            message = body.get("error") if isinstance(body, dict) else None
            raise ApiError(resp.status_code, message or f"HTTP {resp.status_code} {resp.reason_phrase}")
        total = resp.headers.get("x-total-count")
        self.total = ascii_int(total) if total is not None else None
        return body


def run(args: argparse.Namespace, client: Client, out: Any) -> int:
    c = args.command
    listing: dict[str, Callable[[], Any]] = {
        "queues": lambda: client.call("GET", "/api/queues", name=args.name, sort=args.sort, limit=args.limit,
                                      offset=args.offset),
        "exchanges": lambda: client.call("GET", "/api/exchanges"),
        "bindings": lambda: client.call("GET", "/api/bindings"),
        "connections": lambda: client.call("GET", "/api/connections"),
        "subscriptions": lambda: client.call("GET", "/api/subscriptions", idle=args.idle,
                                             abandoned=args.abandoned),
    }
    if c in listing:
        data = listing[c]()
        if args.json:
            print(json.dumps(data, indent=2), file=out)
        else:
            print_table(c, data, out, title_for(c, len(data), client.total, getattr(args, "offset", 0)))
        return 0
    if c == "purge":
        result = client.call("POST", f"/api/queues/{quote(args.queue, safe='')}/purge")
        message = f"purged {result['purged']} message(s) from '{args.queue}'"
    elif c == "delete-subscription":
        result = client.call("DELETE", f"/api/subscriptions/{quote(args.name, safe='')}",
                             namespace=args.namespace, durable=args.durable, force=args.force or None)
        message = (f"deleted subscription '{result['name']}' (namespace {result['namespace']}): "
                   f"{result['pending']} pending message(s) dropped"
                   + (f", {result['consumers_detached']} consumer(s) detached"
                      if result.get("consumers_detached") else ""))
    elif c in ("dlq", "move"):
        body = {k: v for k, v in (("to", args.to), ("selector", args.selector), ("limit", args.limit)) if v}
        verb = "replay" if c == "dlq" else "move"
        job = client.call("POST", f"/api/queues/{quote(args.queue, safe='')}/{verb}", body, wait=_wait(args))
        job = follow(client, job, args)
        result = job["report"] if not args.json else job
        message = move_summary(verb, job["report"]) + ("" if job["state"] in ("done", "stopped")
                                                        else f" ({job['state']}, job {job['id']})")
    elif c == "jobs":
        jobs = client.call("GET", "/api/jobs")
        if args.json:
            print(json.dumps(jobs, indent=2), file=out)
        else:
            for j in jobs:
                p = j["progress"]
                print(f"{j['id']}  {j['state']:<9} {j['kind']} of '{j['queue']}' by {j['who']}: "
                      f"{p['examined']}/{p['total']} examined; {move_summary(j['kind'], j['report'])}", file=out)
        return 0
    elif c == "cancel-job":
        result = client.call("DELETE", f"/api/jobs/{quote(args.id, safe='')}")
        message = f"job {result['id']} {result['state']}: {move_summary(result['kind'], result['report'])}"
    elif c == "messages":
        result = client.call("GET", f"/api/queues/{quote(args.queue, safe='')}/messages", offset=args.offset,
                             limit=args.limit, selector=args.selector)
        if not args.json:
            print_messages(result, out)
            return 0
    elif c == "backup":
        result = client.call("POST", "/api/backup", {"dest": args.dest})
        message = (f"backed up the store to {result['dest']} in {result['seconds']:.1f} s "
                   f"({_bytes(result['bytes'])}, {'whole' if result['whole'] else 'NOT WHOLE'})")
    elif c == "reload":
        result = client.call("POST", "/api/reload", allow_open=True if args.allow_open else None)
        message = reload_summary(result)
    elif c == "close-connection":
        result = client.call("DELETE", f"/api/connections/{args.id}")
        message = (f"closed connection {result['id']} (container {result['container_id']}, "
                   f"{result['remote_address']})")
    else:  # argparse prevents this
        raise ValueError(c)
    print(json.dumps(result, indent=2) if args.json else message, file=out)
    return 0


def main(argv: list[str] | None = None, out: Any = None) -> int:
    args = _parser().parse_args(argv)
    out = out or sys.stdout
    if args.command == "queues" and not (1 <= args.limit <= 10_000 and args.offset >= 0):
        print("amqpbroker admin: --limit must be 1 to 10000 and --offset 0 or more", file=sys.stderr)
        return 2
    if args.command in ("dlq", "move") and args.limit < 0 or args.command == "messages" and not (
            1 <= args.limit <= 1000 and args.offset >= 0):
        print("amqpbroker admin: --limit must be 0 or more (messages: 1 to 1000) and --offset 0 or more",
              file=sys.stderr)
        return 2
    if args.command == "subscriptions":
        try:
            parse_duration(args.idle)
        except ValueError as exc:
            print(f"amqpbroker admin: --idle: {exc}", file=sys.stderr)
            return 2
    import httpx

    try:
        client = Client(args)
        return run(args, client, out)
    except ApiError as exc:
        print(f"amqpbroker admin: {exc.message} (HTTP {exc.status})", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"amqpbroker admin: cannot reach the broker at {args.url}: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
