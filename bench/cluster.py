#!/usr/bin/env python3
"""The cluster on one machine (docs/cluster.md): what `serve --workers N` adds.

One command, one interleaved run (every scenario's variants alternate, --repeat
times; the table shows medians).  The load tool (bench/build/loadgen, C) runs on
the same cores as the brokers, as in the other benches.

1. queues   8 queues, each with its own loadgen (1 sender + 1 receiver connection,
            N/8 x 256 B, window 1000, credit 1000), all at once, against
              workers1   `serve` alone (today's broker, nothing of the cluster loaded)
              workers2   `serve --workers 2`, clients on the shared port (the kernel
                         puts each connection on either node); a connection whose
                         first link is the other node's is handed to it (socket and
                         all, cluster/handoff.py)
              forwarding the same with `[cluster] handoff = false`: such a
                         connection stays and its links are forwarded
              placed     the same cluster, each client on its queue owner's own port
                         (what a placement redirect gives a client)
            aggregate msgs/s and the ratio to workers1 (target >= 1.6x).
2. forwarded  one queue of node n1 of the `handoff = false` 2-worker cluster, reached
            directly (n1's port) and through n0 (every link forwarded): msgs/s, the ratio
            (target >= 0.5x), and each node's CPU per message (from /proc) so the
            forwarding cost per message is printed.
3. partitioned  a topic with one shared subscription (4 consumers, 4 producer links),
            against
              one node   `serve` alone, a plain topic
              logical    `serve --workers 2` with the topic partitioned over 2 members,
                         clients on the shared port using its one name (every message
                         passes through a node's partitioned link: forwarded)
              members    the same cluster, each member's producers and consumers on its
                         owner's own port, naming the member (`amq.topic/<topic>.p0` ...)
            aggregate msgs/s and the ratio to one node (target >= 1.5x).
4. single   (with --baseline-bin BIN) p2p on one broker run from BIN (e.g. the main
            branch's .venv/bin/amqpbroker) against this tree's: the single-node broker
            must not be slower.  Start both the same way (each venv's console script):
            a broker started with `python -S` ran about 5 % faster here than the same
            code through the console script.

    .venv/bin/python bench/cluster.py --messages 100000 --repeat 3 --baseline-bin /path/to/main/.venv/bin/amqpbroker

A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from amqpbroker.core.placement import slot_of, static_map  # noqa: E402

LOADGEN = HERE / "build" / "loadgen"
NODE_RE = re.compile(r"amqp-node listening on ([\d.]+):(\d+) \(node (\S+)\)")
LISTEN_RE = re.compile(r"\bamqp listening on ([\d.]+):(\d+)")
CLK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


class Server:
    """A broker process (alone, or a --workers supervisor) logging to a file."""

    def __init__(self, exe: str, workers: int = 1, weights: str | None = None, name: str = "broker",
                 config: str | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-cluster-{name}-"))
        cmd = [exe, "serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(self.tmp / "data"),
               "--log-level", "info"]
        if config:
            (self.tmp / "broker.toml").write_text(config)
            cmd += ["--config", str(self.tmp / "broker.toml")]
        if workers > 1:
            cmd += ["--workers", str(workers)] + (["--worker-weights", weights] if weights else [])
        self.log = open(self.tmp / "log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True,
                                     env=dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0"))
        self.workers = workers
        self.port = 0
        self.nodes: dict[str, int] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = (self.tmp / "log").read_text()
            m = LISTEN_RE.search(text)
            self.nodes = {n.group(3): int(n.group(2)) for n in NODE_RE.finditer(text)}
            if m and (workers == 1 or len(self.nodes) == workers):
                self.port = int(m.group(2))
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{text[-2000:]}")
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{name} did not start")

    def pids(self) -> dict[str, int]:
        """node → pid (alone: {"n0": the broker})."""
        if self.workers == 1:
            return {"n0": self.proc.pid}
        out = {}
        for i in range(self.workers):
            found = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "--", f"--worker {i} "],
                                   capture_output=True, text=True).stdout.split()
            out[f"n{i}"] = int(found[0])
        return out

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


def loadgen_cmd(port: int, address: str, messages: int, size: int, timeout: float) -> list[str]:
    return [str(LOADGEN), "--url", f"127.0.0.1:{port}", "--address", address, "--messages", str(messages),
            "--size", str(size), "--senders", "1", "--receivers", "1", "--window", "1000", "--credit", "1000",
            "--timeout", str(timeout)]


def shared_sub_cmd(port: int, topic: str, messages: int, size: int, timeout: float, senders: int = 4,
                   receivers: int = 4) -> list[str]:
    """Producers on topic `topic`, consumers sharing one subscription of it."""
    return [str(LOADGEN), "--url", f"127.0.0.1:{port}", "--address", f"amq.topic/{topic}", "--recv-address",
            topic, "--shared-sub", f"bench-sub-{uuid.uuid4().hex[:8]}", "--messages", str(messages),
            "--size", str(size), "--senders", str(senders), "--receivers", str(receivers), "--window", "1000",
            "--credit", "1000", "--start-delay", "300", "--timeout", str(timeout)]


PARTITIONED_TOPIC = "bench-pt"
PARTITIONED_CONFIG = f"""
[cluster]
partitioned = [{{address = "{PARTITIONED_TOPIC}", members = 2, topic = true}}]
"""


def run_loadgens(cmds: list[list[str]], timeout: float) -> dict:
    """Start them all at once; aggregate = every message received / the longest run."""
    import resource
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout + 60)
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
        results.append(json.loads(line) if line else {"error": err[-300:]})
    bad = [r for r in results if "error" in r or r.get("timeout")]
    received = sum(r.get("received", 0) for r in results)
    seconds = max((r.get("seconds", 0) for r in results), default=0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)   # the load tools (waited for), not the brokers
    client_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"rate": received / seconds if seconds else 0.0, "received": received, "runs": results,
            "failed": len(bad), "client_us_per_msg": client_cpu * 1e6 / received if received else 0.0}


def queue_names(count: int, owners: tuple[str, ...]) -> list[str]:
    """`count` fresh queue names, spread evenly over the nodes (by the real slot map)."""
    names: list[str] = []
    want = {n: count // len(set(owners)) for n in set(owners)}
    while len(names) < count:
        name = f"bench-cl-{uuid.uuid4().hex[:10]}"
        owner = owners[slot_of(name, len(owners))]
        if want.get(owner, 0) > 0:
            want[owner] -= 1
            names.append(name)
    return names


def member_nodes(topic: str, owners: tuple[str, ...]) -> list[tuple[str, str]]:
    """(member topic name, its node) of the bench's partitioned topic (core/placement.py)."""
    from amqpbroker.core.placement import SlotMap, partition_members
    slots = SlotMap(owners, frozenset(owners), partitioned={f"amq.topic/{topic}": 2})
    return [(address[len("amq.topic/"):], node) for address, node in
            partition_members(f"amq.topic/{topic}", 2, slots)]


def rotate(items: list, rep: int) -> list:
    """The variants in a different order each repeat (no variant always first)."""
    k = rep % len(items)
    return items[k:] + items[:k]


def med(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000, help="messages per scenario run (default 100000)")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--queues", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--bin", default=str(ROOT / ".venv" / "bin" / "amqpbroker"), help="this tree's amqpbroker")
    ap.add_argument("--baseline-bin", help="another amqpbroker (e.g. main's) for the single-node comparison")
    ap.add_argument("--scenarios", default="queues,forwarded,partitioned,single")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not LOADGEN.exists():
        subprocess.run(["bash", str(HERE / "build.sh")], check=True)
    scenarios = args.scenarios.split(",")
    if not args.baseline_bin and "single" in scenarios:
        scenarios.remove("single")
    started: list[Server] = []
    rows: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    runs: list[dict] = []

    def record(name: str, result: dict) -> None:
        rows.setdefault(name, []).append(result["rate"])
        cpu.setdefault(f"{name} (load tool)", []).append(result["client_us_per_msg"])
        runs.append({"variant": name, **result})
        note = f" ({result['failed']} loadgen runs incomplete)" if result["failed"] else ""
        print(f"  {name:<28} {result['rate']:>10,.0f} msgs/s{note}", file=sys.stderr, flush=True)

    def measured(node_pids: dict[str, int], run, name: str) -> dict:
        """run() with each node's CPU per message received recorded under `name`."""
        before = {n: cpu_ticks(p) for n, p in node_pids.items()}
        result = run()
        after = {n: cpu_ticks(p) for n, p in node_pids.items()}
        for n in before:
            cpu.setdefault(f"{name} {n}", []).append((after[n] - before[n]) / CLK * 1e6 / max(1, result["received"]))
        return result

    try:
        alone = Server(args.bin, name="alone")
        started.append(alone)
        two = Server(args.bin, workers=2, name="workers2")
        started.append(two)
        fwd = (Server(args.bin, workers=2, name="forwarding", config="[cluster]\nhandoff = false\n")
               if "queues" in scenarios or "forwarded" in scenarios else None)
        if fwd:
            started.append(fwd)
        parts = (Server(args.bin, workers=2, name="partitioned", config=PARTITIONED_CONFIG)
                 if "partitioned" in scenarios else None)
        if parts:
            started.append(parts)
        base = Server(args.baseline_bin, name="baseline") if "single" in scenarios else None
        if base:
            started.append(base)
        owners = static_map(["n0", "n1"]).owners
        pids = fwd.pids() if fwd else {}
        per_queue = max(1, args.messages // args.queues)
        for rep in range(args.repeat):
            print(f"repeat {rep + 1}/{args.repeat}", file=sys.stderr, flush=True)
            if "queues" in scenarios:
                variants = [("queues: workers1", lambda q: alone.port),
                            ("queues: workers2", lambda q: two.port),
                            ("queues: workers2 forwarding", lambda q: fwd.port),
                            ("queues: workers2 placed", lambda q: two.nodes[owners[slot_of(q, len(owners))]])]
                node_pids = {"queues: workers1": alone.pids(), "queues: workers2": two.pids(),
                             "queues: workers2 placed": two.pids(), "queues: workers2 forwarding": pids}
                for name, port_of in rotate(variants, rep):
                    qs = queue_names(args.queues, owners)   # fresh queues, half on each node
                    record(name, measured(node_pids[name], lambda: run_loadgens(
                        [loadgen_cmd(port_of(q), q, per_queue, args.size, args.timeout) for q in qs],
                        args.timeout), name))
            if "forwarded" in scenarios:
                q = next(n for n in queue_names(2, owners) if owners[slot_of(n, len(owners))] == "n1")
                for name, node in rotate([("forwarded: direct (n1)", "n1"), ("forwarded: through n0", "n0")], rep):
                    record(name, measured(pids, lambda: run_loadgens(
                        [loadgen_cmd(fwd.nodes[node], q, args.messages, args.size, args.timeout)], args.timeout), name))
            if parts is not None:
                members = member_nodes(PARTITIONED_TOPIC, owners)
                variants = [
                    ("partitioned: one node", lambda: [shared_sub_cmd(alone.port, PARTITIONED_TOPIC + "-1",
                                                                      args.messages, args.size, args.timeout)]),
                    ("partitioned: logical", lambda: [shared_sub_cmd(parts.port, PARTITIONED_TOPIC,
                                                                     args.messages, args.size, args.timeout)]),
                    ("partitioned: members", lambda: [shared_sub_cmd(parts.nodes[node], member, args.messages // 2,
                                                                     args.size, args.timeout, 2, 2)
                                                      for member, node in members]),
                ]
                node_pids = {"partitioned: one node": alone.pids()}
                node_pids["partitioned: logical"] = node_pids["partitioned: members"] = parts.pids()
                for name, cmds in rotate(variants, rep):
                    record(name, measured(node_pids[name], lambda: run_loadgens(cmds(), args.timeout), name))
            if base is not None:
                for name, server in rotate([("single: baseline", base), ("single: this tree", alone)], rep):
                    record(name, run_loadgens([loadgen_cmd(server.port, f"bench-p2p-{uuid.uuid4().hex[:8]}",
                                                           args.messages, args.size, args.timeout)], args.timeout))
    finally:
        for s in started:
            s.stop()
    print()
    print(f"{'variant':<30} {'msgs/s (median)':>16}   runs")
    for name, values in rows.items():
        print(f"{name:<30} {med(values):>16,.0f}   " + ", ".join(f"{v:,.0f}" for v in values))
    ratios = []
    if "queues: workers1" in rows:
        w1 = med(rows["queues: workers1"])
        for v in ("queues: workers2", "queues: workers2 forwarding", "queues: workers2 placed"):
            ratios.append((f"{v} / workers1", med(rows[v]) / w1 if w1 else 0, 1.6))
    if "forwarded: direct (n1)" in rows:
        d = med(rows["forwarded: direct (n1)"])
        ratios.append(("forwarded: through n0 / direct", med(rows["forwarded: through n0"]) / d if d else 0, 0.5))
    if "partitioned: one node" in rows:
        one = med(rows["partitioned: one node"])
        for v in ("partitioned: logical", "partitioned: members"):
            ratios.append((f"{v} / one node", med(rows[v]) / one if one else 0, 1.5))
    if "single: baseline" in rows:
        b = med(rows["single: baseline"])
        ratios.append(("single: this tree / baseline", med(rows["single: this tree"]) / b if b else 0, 1.0))
    print()
    for label, value, target in ratios:
        print(f"{label:<40} {value:5.2f}x   (target >= {target:g}x)")
    if cpu:
        print()
        print("CPU per message (us, median over repeats; from /proc, all threads of each node):")
        for label, values in cpu.items():
            print(f"  {label:<36} {med(values):6.1f}")
        fw = med(cpu.get("forwarded: through n0 n0", []))
        print(f"  forwarding cost per message (node n0, which owns nothing): {fw:.1f} us")
    print("\n(figures from a shared, busy machine are indicative; compare ratios within one run)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "cpu": cpu, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
