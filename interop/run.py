#!/usr/bin/env python3
"""Run the interop scenarios against amqpbroker with independent AMQP 1.0 clients.

    python3 interop/run.py                          # start a broker, all clients, all scenarios
    python3 interop/run.py --clients python,cpp --scenarios queue,types
    python3 interop/run.py --url amqp://127.0.0.1:5672   # an already running broker

Prints a matrix (client x scenario, then sender client x receiver client for the
AMQP types round trip), the failures with their reasons, and ends with one line
`N passed, M failed`. Exit status 0 only when nothing failed.  Standard library only;
see interop/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ALL_CLIENTS = ["rhea", "python", "cpp"]
SCENARIOS = ["queue", "topic", "shared-global", "shared-clientid", "unsubscribe", "selector", "large", "drain",
             "consumer-close", "types", "transaction"]
LISTEN_RE = re.compile(r"amqp listening on ([\d.]+|\[[0-9a-f:]+\]|[\w.-]+):(\d+)")

QUEUE_COUNT = 1000
TOPIC_COUNT = 500
SHARED_COUNT = 200


def venv_python() -> str:
    for cand in (ROOT / ".venv" / "bin" / "python", ROOT / ".venv" / "Scripts" / "python.exe"):
        if cand.exists():
            return str(cand)
    return sys.executable


# --------------------------------------------------------------------- clients

@dataclass
class Client:
    name: str
    command: list[str]
    missing: str | None = None          # why it cannot run (set-up not done)
    info: dict = field(default_factory=dict)

    @property
    def transactions(self) -> bool:
        return bool(self.info.get("transactions"))


def find_clients(names: list[str]) -> dict[str, Client]:
    out: dict[str, Client] = {}
    for name in names:
        if name == "python":
            py = venv_python()
            c = Client(name, [py, str(HERE / "python" / "client.py")])
            probe = subprocess.run([py, "-c", "import proton"], capture_output=True, text=True)
            if probe.returncode != 0:
                c.missing = f"{py} cannot import proton (python-qpid-proton): run scripts/setup.sh"
        elif name == "rhea":
            node = shutil.which("node")
            c = Client(name, [node or "node", str(HERE / "js" / "client.js")])
            if node is None:
                c.missing = "node is not installed: run interop/setup.sh"
            elif not (HERE / "js" / "node_modules" / "rhea" / "package.json").exists():
                c.missing = "interop/js/node_modules is absent (rhea not installed): run interop/setup.sh"
        elif name == "cpp":
            exe = HERE / "cpp" / "build" / "interop-client"
            c = Client(name, [str(exe)])
            if not os.access(exe, os.X_OK):
                c.missing = "interop/cpp/build/interop-client is not built: run interop/setup.sh"
        else:
            raise SystemExit(f"run.py: unknown client {name!r} (known: {', '.join(ALL_CLIENTS)})")
        if c.missing is None:
            res = run_once(c, "", ["--scenario", "info"], timeout=30)
            if res.get("result") != "pass":
                c.missing = f"'{name}' client does not start: {res.get('error')}"
            else:
                c.info = res
        out[name] = c
    return out


# --------------------------------------------------------------------- processes

class Proc:
    """A client process: JSON lines on stdout are events or the final result."""

    def __init__(self, client: Client, url: str, args: list[str], timeout: float, verbose: bool = False):
        self.client = client
        self.cmd = client.command + (["--url", url] if url else []) + args + ["--timeout", str(timeout)]
        self.timeout = timeout
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.result: dict | None = None
        self.stderr: list[str] = []
        self.verbose = verbose
        if verbose:
            print("   $ " + " ".join(self.cmd), file=sys.stderr)
        self.p = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  encoding="utf-8", errors="replace", stdin=subprocess.DEVNULL)
        self._t_out = threading.Thread(target=self._read_out, daemon=True)
        self._t_err = threading.Thread(target=self._read_err, daemon=True)
        self._t_out.start()
        self._t_err.start()

    def _read_out(self) -> None:
        for line in self.p.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                self.stderr.append("stdout: " + line)
                continue
            if "event" in obj:
                self.events.put(obj)
            elif "result" in obj:
                self.result = obj
        self.events.put({"event": "exit"})

    def _read_err(self) -> None:
        for line in self.p.stderr:
            self.stderr.append(line.rstrip())

    def wait_event(self, name: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if ev.get("event") == name:
                return ev
            if ev.get("event") == "exit":
                return None

    def wait(self, extra: float = 15.0) -> dict:
        try:
            self.p.wait(self.timeout + extra)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            self._t_out.join(2)
            return {"result": "fail", "error": f"killed: no result within {self.timeout + extra:.0f}s"}
        self._t_out.join(5)
        self._t_err.join(2)
        if self.result is None:
            tail = " | ".join(self.stderr[-5:])
            return {"result": "fail", "error": f"exited with status {self.p.returncode} and no result line"
                                                + (f": {tail}" if tail else "")}
        return self.result

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def run_once(client: Client, url: str, args: list[str], timeout: float = 60, verbose: bool = False) -> dict:
    return Proc(client, url, args, timeout, verbose).wait()


# --------------------------------------------------------------------- results

@dataclass
class Cell:
    status: str               # pass | fail | n/a
    detail: str = ""
    seconds: float = 0.0


def summarize(results: list[dict], label: list[str]) -> Cell:
    """Pass when every process passed; else the first failure, named by its role."""
    for res, who in zip(results, label):
        if res.get("result") != "pass":
            return Cell("fail", f"{who}: {res.get('error', 'failed')}")
    return Cell("pass")


# --------------------------------------------------------------------- scenarios

class Runner:
    def __init__(self, url: str, clients: dict[str, Client], timeout: float, verbose: bool):
        self.url = url
        self.clients = clients
        self.timeout = timeout
        self.verbose = verbose
        self.run_id = uuid.uuid4().hex[:8]

    def uid(self, *parts: str) -> str:
        return ".".join(("interop",) + parts + (self.run_id, uuid.uuid4().hex[:6]))

    def spawn(self, client: Client, scenario: str, role: str, *args: str) -> Proc:
        return Proc(client, self.url, ["--scenario", scenario, "--role", role, *args], self.timeout, self.verbose)

    def receivers_then_sender(self, client: Client, scenario: str, receivers: list[list[str]],
                              sender_args: list[str]) -> tuple[list[dict], list[str]]:
        """Start receivers, wait until each has attached, then run the sender."""
        procs, labels = [], []
        for i, rargs in enumerate(receivers):
            procs.append(self.spawn(client, scenario, "receiver", *rargs))
            labels.append(f"receiver{i + 1}" if len(receivers) > 1 else "receiver")
        for p, who in zip(procs, labels):
            if p.wait_event("ready", self.timeout) is None:
                p.kill()
                res = p.wait()
                for q in procs:
                    q.kill()
                if res.get("result") == "pass":
                    res = {"result": "fail", "error": "exited before attaching"}
                return [res], [f"{who} (never attached)"]
        sender = self.spawn(client, scenario, "sender", *sender_args)
        results = [sender.wait()] + [p.wait() for p in procs]
        return results, ["sender"] + labels

    def scenario(self, client: Client, name: str) -> Cell:
        t0 = time.monotonic()
        cell = getattr(self, "s_" + name.replace("-", "_"))(client)
        cell.seconds = time.monotonic() - t0
        return cell

    def s_queue(self, c: Client) -> Cell:
        addr = self.uid("queue", c.name)
        results, labels = self.receivers_then_sender(
            c, "queue", [["--address", addr, "--count", str(QUEUE_COUNT)]],
            ["--address", addr, "--count", str(QUEUE_COUNT)])
        return summarize(results, labels)

    def s_topic(self, c: Client) -> Cell:
        addr = "amq.topic/" + self.uid("topic", c.name)
        rargs = ["--address", addr, "--count", str(TOPIC_COUNT)]
        results, labels = self.receivers_then_sender(c, "topic", [rargs, rargs],
                                                     ["--address", addr, "--count", str(TOPIC_COUNT)])
        return summarize(results, labels)

    def s_shared_global(self, c: Client) -> Cell:
        topic = self.uid("sg", c.name)
        sub = f"sg-{c.name}-{self.run_id}-{uuid.uuid4().hex[:4]}"
        rargs = ["--address", topic, "--sub", sub]
        results, labels = self.receivers_then_sender(c, "shared-global", [rargs, rargs],
                                                     ["--address", "amq.topic/" + topic,
                                                      "--count", str(SHARED_COUNT)])
        cell = summarize(results, labels)
        if cell.status != "pass":
            return cell
        got = [r.get("received", []) for r in results[1:]]
        merged = sorted(s for g in got for s in g)
        if merged != list(range(SHARED_COUNT)):
            dup = len(merged) - len(set(merged))
            return Cell("fail", f"the two processes together got {len(merged)} message(s) "
                                f"({dup} duplicate(s)), expected each of {SHARED_COUNT} exactly once")
        if min(len(g) for g in got) == 0:
            return Cell("fail", f"no split: {[len(g) for g in got]}")
        return Cell("pass", f"split {len(got[0])}/{len(got[1])}")

    def s_shared_clientid(self, c: Client) -> Cell:
        topic = self.uid("sc", c.name)
        sub = f"sc-{c.name}-{self.run_id}-{uuid.uuid4().hex[:4]}"
        cid = f"interop-{c.name}-{self.run_id}-{uuid.uuid4().hex[:6]}"
        results, labels = self.receivers_then_sender(
            c, "shared-clientid",
            [["--address", topic, "--sub", sub, "--container-id", cid, "--count", str(SHARED_COUNT)]],
            ["--address", "amq.topic/" + topic, "--count", str(SHARED_COUNT)])
        cell = summarize(results, labels)
        if cell.status == "pass":
            split = results[1].get("per_link", {})
            cell.detail = "split " + "/".join(str(v) for v in split.values())
        return cell

    def single(self, c: Client, scenario: str, *args: str) -> Cell:
        res = self.spawn(c, scenario, "run", *args).wait()
        if res.get("result") == "unsupported":
            return Cell("n/a", res.get("error", "not supported by the client library"))
        return summarize([res], ["run"])

    def s_unsubscribe(self, c: Client) -> Cell:
        return self.single(c, "unsubscribe", "--address", self.uid("unsub", c.name),
                           "--sub", f"us-{c.name}-{self.run_id}-{uuid.uuid4().hex[:4]}",
                           "--container-id", f"interop-{c.name}-{self.run_id}-{uuid.uuid4().hex[:6]}")

    def s_selector(self, c: Client) -> Cell:
        return self.single(c, "selector", "--address", self.uid("sel", c.name))

    def s_large(self, c: Client) -> Cell:
        return self.single(c, "large", "--address", self.uid("large", c.name), "--size", str(1024 * 1024))

    def s_drain(self, c: Client) -> Cell:
        return self.single(c, "drain", "--address", self.uid("drain", c.name))

    def s_consumer_close(self, c: Client) -> Cell:
        return self.single(c, "consumer-close", "--address", self.uid("cclose", c.name))

    def s_transaction(self, c: Client) -> Cell:
        if not c.transactions:
            return Cell("n/a", c.info.get("transactions_note", "no transaction API in the client library"))
        return self.single(c, "transaction", "--address", self.uid("txn", c.name))

    def types_pair(self, s: Client, r: Client) -> Cell:
        t0 = time.monotonic()
        excluded = sorted(set(s.info.get("unsupported_types", [])) | set(r.info.get("unsupported_types", [])))
        addr = self.uid("types", s.name, r.name)
        extra = ["--exclude-types", ",".join(excluded)] if excluded else []
        sent = self.spawn(s, "types", "sender", "--address", addr, *extra).wait()
        if sent.get("result") != "pass":
            cell = summarize([sent], ["sender"])
        else:
            got = self.spawn(r, "types", "receiver", "--address", addr, *extra).wait()
            cell = summarize([got], ["receiver"])
            if cell.status == "pass" and excluded:
                cell.detail = "without " + ",".join(excluded)
        cell.seconds = time.monotonic() - t0
        return cell


# --------------------------------------------------------------------- broker

class Broker:
    def __init__(self, log_level: str = "info"):
        self.dir = Path(tempfile.mkdtemp(prefix="amqpbroker-interop-"))
        self.lines: list[str] = []
        self.port: int | None = None
        self.host = "127.0.0.1"
        self._ready = threading.Event()
        cmd = [venv_python(), "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir",
               str(self.dir / "data"), "--log-level", log_level]
        env = dict(os.environ)
        # the management listener (if this broker version has one) on a free port too
        env.setdefault("AMQPBROKER_MANAGEMENT__PORT", "0")
        self.p = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, encoding="utf-8", errors="replace", env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append(line.rstrip())
            m = LISTEN_RE.search(line)
            if m and self.port is None:
                self.host, self.port = m.group(1), int(m.group(2))
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 30) -> str:
        self._ready.wait(timeout)
        if self.port is None:
            self.stop()
            raise SystemExit("run.py: the broker did not start:\n" + "\n".join(self.lines[-30:]))
        return f"amqp://{self.host}:{self.port}"

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------- output

def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def mark(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    return {"pass": "pass", "fail": "FAIL", "n/a": "n/a"}[cell.status]


def live_url(urls: list[str], wait: float) -> str | None:
    """The first of `urls` whose broker accepts a TCP connection, tried in turn until
    `wait` seconds have passed (None: none did)."""
    deadline = time.monotonic() + wait
    while True:
        for url in urls:
            parts = urlsplit(url if "://" in url else "amqp://" + url)
            try:
                with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=1.0):
                    return url
            except OSError:
                continue
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default=",".join(ALL_CLIENTS), help="comma-separated: rhea,python,cpp")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ",".join(SCENARIOS))
    ap.add_argument("--url", help="use this running broker instead of starting one; a comma-separated "
                    "list (an HA pair, docs/ha.md): the one that accepts connections, waited for up to "
                    "--live-wait seconds (a backup keeps its listener closed until it is live)")
    ap.add_argument("--live-wait", type=float, default=60.0, help="seconds to wait for a live broker in --url")
    ap.add_argument("--timeout", type=float, default=30.0, help="per client process, seconds (default 30)")
    ap.add_argument("--json", metavar="FILE", help="also write every result as JSON to FILE")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each client command line")
    ap.add_argument("--broker-log", metavar="FILE", help="write the started broker's log to FILE")
    args = ap.parse_args(argv)

    names = [c for c in args.clients.split(",") if c]
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r} (known: {', '.join(SCENARIOS)})")
    clients = find_clients(names)
    missing = {n: c.missing for n, c in clients.items() if c.missing}
    for n, why in missing.items():
        print(f"MISSING client {n}: {why}", file=sys.stderr)

    broker = None
    if args.url:
        url = live_url(args.url.split(","), args.live_wait)
        if url is None:
            print(f"no broker of {args.url} accepted connections within {args.live_wait:g} s", file=sys.stderr)
            return 1
    else:
        broker = Broker()
        url = broker.wait_ready()
    print(f"broker: {url}" + ("" if args.url else f" (started by run.py, data in {broker.dir})"))
    print("clients: " + ", ".join(
        f"{n} ({c.info.get('library', '?')} {c.info.get('version', '?')})" if not c.missing else f"{n} (MISSING)"
        for n, c in clients.items()))
    runner = Runner(url, clients, args.timeout, args.verbose)
    per_scenario = [s for s in scenarios if s != "types"]
    cells: dict[tuple[str, str], Cell] = {}
    pairs: dict[tuple[str, str], Cell] = {}
    t_start = time.monotonic()
    try:
        for n in names:
            c = clients[n]
            for s in per_scenario:
                if c.missing:
                    cells[(n, s)] = Cell("fail", f"client missing: {c.missing}")
                    continue
                cell = runner.scenario(c, s)
                cells[(n, s)] = cell
                print(f"  {n:<7} {s:<16} {mark(cell):<5} {cell.seconds:5.1f}s  {cell.detail}"[:200], flush=True)
        if "types" in scenarios:
            for sn in names:
                for rn in names:
                    s, r = clients[sn], clients[rn]
                    if s.missing or r.missing:
                        pairs[(sn, rn)] = Cell("fail", "client missing: " + (s.missing or r.missing))
                        continue
                    cell = runner.types_pair(s, r)
                    pairs[(sn, rn)] = cell
                    print(f"  types   {sn + ' -> ' + rn:<16} {mark(cell):<5} {cell.seconds:5.1f}s  {cell.detail}"[:200],
                          flush=True)
    finally:
        if broker is not None:
            broker.stop()
            broker_lines = list(broker.lines)
            if args.broker_log:
                Path(args.broker_log).write_text("\n".join(broker_lines) + "\n")
        else:
            broker_lines = []
    elapsed = time.monotonic() - t_start

    print()
    if per_scenario:
        print("client x scenario")
        rows = [["client"] + per_scenario]
        for n in names:
            rows.append([n] + [mark(cells.get((n, s))) for s in per_scenario])
        print(table(rows))
        print()
    if pairs:
        print("types round trip (rows: sender, columns: receiver)")
        rows = [["sender \\ receiver"] + names]
        for sn in names:
            rows.append([sn] + [mark(pairs.get((sn, rn))) for rn in names])
        print(table(rows))
        print()

    all_cells = [(f"{n}/{s}", c) for (n, s), c in cells.items()] + \
                [(f"types {s}->{r}", c) for (s, r), c in pairs.items()]
    failed = [(k, c) for k, c in all_cells if c.status == "fail"]
    na = [(k, c) for k, c in all_cells if c.status == "n/a"]
    passed = [k for k, c in all_cells if c.status == "pass"]
    if failed:
        print("failures:")
        for k, c in failed:
            print(f"  {k}: {c.detail}")
        if broker_lines:
            print("broker log (last 15 lines):")
            for line in broker_lines[-15:]:
                print("  | " + line)
        print()
    if na:
        print("not applicable (not counted):")
        for k, c in na:
            print(f"  {k}: {c.detail}")
        print()
    if missing:
        print("missing clients (counted as failures): " + ", ".join(missing) + " - run interop/setup.sh")
    print(f"took {elapsed:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "url": url,
            "clients": {n: (c.info or {"missing": c.missing}) for n, c in clients.items()},
            "scenarios": {f"{n}/{s}": vars(c) for (n, s), c in cells.items()},
            "types": {f"{s}->{r}": vars(c) for (s, r), c in pairs.items()},
        }, indent=1))
    print(f"{len(passed)} passed, {len(failed)} failed")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
