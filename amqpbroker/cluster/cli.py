"""`amqpbroker cluster status`: the cluster as one node sees it (GET /api/cluster),
through the management API of any node (the admin CLI's client and options).
`amqpbroker cluster remap`: a new slot map from a node's configuration, written to
ZooKeeper with every node stopped (cluster/remap.py).

    amqpbroker cluster status --url http://node-a:8161
    amqpbroker cluster status --json
    amqpbroker cluster remap --config node.toml [--dry-run] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..management.cli import DEFAULT_URL, ApiError, Client


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="amqpbroker cluster", description="Look at a cluster (docs/cluster.md).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sp = sub.add_parser("status", help="nodes, which are live, their slots, forwarded links")
    sp.add_argument("--url", default=os.environ.get("AMQPBROKER_ADMIN_URL", DEFAULT_URL),
                    help=f"management API of any node (default $AMQPBROKER_ADMIN_URL or {DEFAULT_URL})")
    sp.add_argument("--user", default=os.environ.get("AMQPBROKER_ADMIN_USER"))
    sp.add_argument("--password", default=os.environ.get("AMQPBROKER_ADMIN_PASSWORD"))
    sp.add_argument("--json", action="store_true", help="print JSON, for scripts")
    sp.add_argument("--timeout", type=float, default=10.0)
    sp.add_argument("--cacert", default=None)
    sp.add_argument("--insecure", action="store_true")
    rp = sub.add_parser("remap", help="a new slot map from the configuration's nodes and weights (every node "
                                      "stopped; docs/cluster.md)")
    rp.add_argument("--config", required=True, help="a node's configuration file: its [cluster] zookeeper, name, "
                                                    "nodes and weights")
    rp.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    rp.add_argument("--force", action="store_true", help="leave out nodes that have not reported being empty "
                                                         "(their machine is gone for good: what they hold is lost)")
    return p


def remap_main(args: argparse.Namespace, out: Any) -> int:
    from pathlib import Path

    from ..config import ConfigError, load_settings
    from ..core.remap import RemapRefused
    from .remap import remap
    try:
        settings = load_settings(Path(args.config))
    except ConfigError as exc:   # one line each, naming the key (as `amqpbroker serve` says them)
        for line in exc.problems:
            print(f"amqpbroker cluster remap: {args.config}: {line}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"amqpbroker cluster remap: {args.config}: {exc}", file=sys.stderr)
        return 2
    if settings.cluster is None or settings.cluster.zookeeper is None:
        print("amqpbroker cluster remap: the configuration has no [cluster] with zookeeper (a `serve --workers` "
              "map follows N and the weights at each start)", file=sys.stderr)
        return 2
    try:
        done = remap(settings, write=not args.dry_run, force=args.force)
    except RemapRefused as exc:
        print(f"amqpbroker cluster remap: refused: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"amqpbroker cluster remap: {exc}", file=sys.stderr)
        return 3
    print(done.text, file=out)
    print("(dry run: nothing written)" if args.dry_run else
          f"written: slot map epoch {done.epoch}; start every node: none serves a client until each has moved "
          f"out what it no longer owns", file=out)
    return 0


def render(view: dict) -> str:
    """The status as text (pure)."""
    if not view.get("enabled"):
        return "this broker is not a node of a cluster"
    lines = [f"node {view['node']} ({'serving' if view['serving'] else 'NOT SERVING'}), "
             f"slot map epoch {view['epoch']}, {view['slots']} slots"]
    if view.get("gate"):
        lines.append(f"clients wait: {view['gate']}")
    zk = view.get("zookeeper")
    if zk:
        lines.append(f"ZooKeeper {zk['zookeeper']} {zk['path']}: session {zk['session']}")
    lines.append(f"{'node':<12} {'live':<5} {'slots':>5} {'connections from here':>22}")
    for n in view["nodes"]:
        mark = " (this node)" if n["here"] else ""
        lines.append(f"{n['node']:<12} {'yes' if n['live'] else 'NO':<5} {n['slots']:>5} "
                     f"{n['connections']:>22}{mark}{_last_stop(n)}")
    f = view["forwarded"]
    lines.append(f"forwarded: {f['links']} links of {f['clients']} clients over {f['connections']} connections; "
                 f"{f['waiting_on_owners']} deliveries waiting on other nodes; {f['links_total']} links since start")
    if view.get("pinned_exchanges"):
        lines.append(f"pinned exchanges: {', '.join(view['pinned_exchanges'])}")
    return "\n".join(lines)


def _last_stop(node: dict) -> str:
    """A node that is not live: what it held at its last clean stop (a node leaves the
    map only once that says nothing under the current map: cluster remap)."""
    report = node.get("last_stop")
    if node["live"] or "last_stop" not in node:
        return ""
    if report is None:
        return "  (no report of a clean stop: killed, or never run)"
    return (f"  (stopped under epoch {report['epoch']} holding {report['messages']} message(s), "
            f"{report['subscriptions']} durable subscription(s))")


def main(argv: list[str] | None = None, out: Any = None) -> int:
    import httpx

    args = _parser().parse_args(argv)
    out = out or sys.stdout
    if args.command == "remap":
        return remap_main(args, out)
    try:
        view = Client(args).call("GET", "/api/cluster")
    except ApiError as exc:
        print(f"amqpbroker cluster: {exc.message} (HTTP {exc.status})", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"amqpbroker cluster: cannot reach the node at {args.url}: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(view, indent=2) if args.json else render(view), file=out)
    return 0
