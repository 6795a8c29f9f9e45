"""`amqpbroker serve …` and friends."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .config import ConfigError, Settings, load_settings
from .server.resources import tune_gc

log = logging.getLogger("amqpbroker")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="amqpbroker", description="AMQP 1.0 message broker")
    p.add_argument("--version", action="version", version=f"amqpbroker {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the broker")
    serve.add_argument("--config", type=Path, help="TOML config file")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="AMQP port (default 5672; 0 picks a free port)")
    serve.add_argument("--data-dir", type=Path, help="data directory (default ./data)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--workers", default="1",
                       help="broker nodes on this machine sharing the port, each with its own store in "
                            "DATA_DIR/node-K (N or auto = cores; default 1: one broker, no cluster); "
                            "docs/cluster.md")
    serve.add_argument("--worker-weights", help="slots each worker owns, in proportion (e.g. 0,1,1: the "
                                                "first owns nothing and only forwards)")
    serve.add_argument("--worker", type=int, help=argparse.SUPPRESS)        # set by the supervisor
    serve.add_argument("--worker-spec", type=Path, help=argparse.SUPPRESS)
    hp = sub.add_parser("hash-password", help="print a salted SCRAM-SHA-256 hash for a user's password")
    hp.add_argument("password", nargs="?", help="the password (prompted for when omitted)")
    sub.add_parser("admin", help="manage a running broker over its management API "
                                 "(see `amqpbroker admin --help`)", add_help=False)
    sub.add_parser("store", help="check, back up or restore a store "
                                 "(see `amqpbroker store --help`)", add_help=False)
    from .client_cli import add_parsers
    add_parsers(sub)                                   # send, receive
    sub.add_parser("config", help="check a configuration file, print the configuration reference "
                                  "(see `amqpbroker config --help`)", add_help=False)
    sub.add_parser("cluster", help="look at a cluster, or remap it: `amqpbroker cluster status`, `cluster remap` "
                                   "(docs/cluster.md)",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["admin"]:
        from .management.cli import main as admin_main
        return admin_main(argv[1:])
    if argv[:1] == ["cluster"]:
        from .cluster.cli import main as cluster_main
        return cluster_main(argv[1:])
    if argv[:1] == ["store"]:
        from .store.tool import main as store_main
        return store_main(argv[1:])
    if argv[:1] == ["config"]:
        from .config_tool import main as config_main
        return config_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command in ("send", "receive"):
        from .client_cli import main as client_main
        return client_main(args)
    if args.command == "hash-password":
        from .security.users import hash_password
        print(hash_password(args.password or getpass.getpass("password: ")))
        return 0
    overrides = {"host": args.host, "port": args.port, "data_dir": args.data_dir, "log_level": args.log_level}
    try:
        settings = load_settings(args.config, **overrides)
    except ConfigError as exc:
        for line in exc.problems:             # one line each, naming the key
            print(f"amqpbroker: {line}", file=sys.stderr)
        return 2
    if args.worker is None and args.workers != "1" and settings.cluster is not None \
            and settings.cluster.zookeeper is not None:
        print("amqpbroker: --workers and [cluster] do not go together yet (docs/cluster.md)", file=sys.stderr)
        return 2
    if args.worker is None and args.workers != "1" and settings.ha is not None:
        # The workers would each run a plain broker: the [ha] section would be silently
        # dropped (a node of a cluster that is a pair is a [cluster] node: docs/cluster.md).
        print("amqpbroker: --workers and [ha] do not go together (the workers are not HA pairs; a cluster "
              "node that is a pair runs with [cluster] and [ha]: docs/cluster.md)", file=sys.stderr)
        return 2
    if args.worker is None and (args.workers != "1" or args.worker_weights):   # serve --workers N (docs/cluster.md)
        from .cluster.workers import check_options, supervise, worker_count
        try:
            count = worker_count(args.workers)
            if args.worker_weights and count == 1:   # one broker: the weights would be dropped without a word
                raise ValueError("--worker-weights goes with --workers N, more than one worker")
            if count > 1:
                check_options(settings, count, args.worker_weights)   # refused here, not by each worker
        except ValueError as exc:
            print(f"amqpbroker: {exc}", file=sys.stderr)
            return 2
        if count > 1:
            return supervise(settings, count, args.worker_weights, _without_workers(argv))
    # A reload reads the same file with the same command-line flags.
    return serve(settings, config_file=args.config, overrides=overrides,
                 worker=(args.worker, args.worker_spec) if args.worker is not None else None)


def _without_workers(argv: list[str]) -> list[str]:
    """The serve command line a worker gets: the same, minus the supervisor's options."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--workers", "--worker-weights"):
            skip = True
            continue
        if arg.startswith(("--workers=", "--worker-weights=")):
            continue
        out.append(arg)
    return out


def serve(settings: Settings, *, config_file: Path | None = None, overrides: dict | None = None,
          worker: tuple[int, Path] | None = None) -> int:
    # The workers of `serve --workers N` share the supervisor's stderr: each line names its node.
    node = f"[n{worker[0]}] " if worker is not None else ""
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {node}%(name)s: %(message)s")
    from .config_help import unknown_environment
    for line in unknown_environment(Settings, os.environ):   # AMQPBROKER_* names that set nothing
        log.warning("%s", line)
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        if worker is not None:   # one node of `serve --workers N` (cluster/workers.py)
            from .cluster.node import WorkerSpec, run_worker
            spec = WorkerSpec.read(worker[1])
            return loop.run_until_complete(run_worker(settings, loop, spec, worker[0], config_file, overrides))
        return loop.run_until_complete(_run(settings, loop, config_file, overrides))
    finally:
        loop.close()


async def _run(settings: Settings, loop: asyncio.AbstractEventLoop, config_file: Path | None = None,
               overrides: dict | None = None) -> int:
    from .store.layout import worker_stores
    nodes = worker_stores(settings.data_dir)
    if nodes:   # one broker would open none of them: their messages would be hidden (store/layout.py)
        log.error("cannot start: %s holds the stores of `serve --workers` nodes (node-%s), which one broker does "
                  "not open: start with --workers %d, or use another --data-dir", settings.data_dir,
                  ", node-".join(map(str, nodes)), nodes[-1] + 1)
        return 2
    if settings.cluster is not None and settings.cluster.zookeeper is None:
        log.error("cannot start: [cluster] without zookeeper holds options of `serve --workers N` "
                  "(docs/cluster.md)")
        return 2
    if settings.cluster is not None:   # one node of a cluster (docs/cluster.md): nothing of it loads otherwise
        if settings.ha is not None:   # the node is an HA pair: its live broker serves it
            from .cluster.pair import run_pair
            return await run_pair(settings, loop, config_file, overrides)
        from .cluster.node import run_member
        return await run_member(settings, loop, config_file, overrides)
    if settings.ha is not None:   # a replicated pair (docs/ha.md): nothing of it loads otherwise
        from .ha.node import run_node
        return await run_node(settings, loop, config_file, overrides)
    import lmdb

    from .server.app import BrokerServer, install_signal_handlers
    from .store.base import StoreError

    stopped = asyncio.Event()
    try:
        server = BrokerServer(settings, loop, config_file=config_file, overrides=overrides)
        # Before the start, not after: a SIGTERM while the broker starts (recovery, the
        # listeners) must stop it cleanly once it is up, not kill it with the store's
        # last checkpoint unwritten.
        install_signal_handlers(loop, stopped.set)
        await server.start()
    except (ValueError, OSError, StoreError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    except lmdb.Error as exc:   # the store checks and recovery turn these into StoreError: a last net
        log.error("cannot start: store at %s: %s: %s", settings.data_dir / "store", type(exc).__name__, exc)
        return 2
    tune_gc()
    install_signal_handlers(loop, stopped.set, server.reloader.on_signal)   # SIGHUP: live reload, once started
    await stopped.wait()
    log.info("shutting down")
    await server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
