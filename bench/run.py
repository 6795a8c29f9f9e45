#!/usr/bin/env python3
"""Broker benchmark runner (a benchmark, not a test: it prints figures).

Starts the brokers under comparison (amqpbroker, the Qpid Proton C example
broker, RabbitMQ 3.10 with its AMQP 1.0 plugin), runs the scenarios against
each of them with the C load generator (bench/build/loadgen), interleaved,
and prints a table scenario x broker plus ratio columns.

    /work/main/.venv/bin/python bench/run.py                       # everything
    /work/main/.venv/bin/python bench/run.py --brokers cbroker,rabbitmq \
        --scenarios p2p,latency --repeat 3 --json bench/out/run.json

Every process the runner starts is in its own process group and is killed in
a finally block (also on Ctrl-C / SIGTERM); every loadgen run is bounded by
--timeout.  See bench/README.md.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUILD = HERE / "build"
LOADGEN = BUILD / "loadgen"
CBROKER = BUILD / "cbroker"
AMQPBROKER = REPO / ".venv" / "bin" / "amqpbroker"
RABBIT_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
RABBITMQCTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")

ALL_BROKERS = ["amqpbroker", "cbroker", "rabbitmq"]
ALL_SCENARIOS = ["p2p", "fanout", "competing", "latency"]
LABELS = {"amqpbroker": "amqpbroker", "cbroker": "C example", "rabbitmq": "RabbitMQ",
          "baseline": "amqpbroker before"}

try:  # rich is optional
    from rich.console import Console
    from rich.table import Table

    HAVE_RICH = True
except Exception:  # pragma: no cover - depends on the venv
    HAVE_RICH = False


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# process helpers
# --------------------------------------------------------------------------


class BrokerStartError(Exception):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def tail_text(path: Path | None, lines: int = 12, chars: int = 1500) -> str:
    if not path or not path.exists():
        return ""
    try:
        data = path.read_text(errors="replace")
    except OSError:
        return ""
    out = "\n".join(data.rstrip().splitlines()[-lines:])
    return out[-chars:]


def kill_group(proc: subprocess.Popen | None, grace: float = 5.0) -> None:
    """SIGTERM the process group of proc, then SIGKILL whatever lingers."""
    if proc is None:
        return
    pgid = proc.pid  # started with start_new_session=True: pgid == pid
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None and not group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(pgid):
                break
            time.sleep(0.05)
    try:
        proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def session_cpu_seconds(sid: int) -> float:
    """user+sys CPU seconds of the live processes of session sid (Linux /proc)."""
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        rest = raw[raw.rfind(")") + 2 :].split()
        # rest[0] = state (field 3); session = field 6; utime/stime = 14/15
        try:
            if int(rest[3]) != sid:
                continue
            total += int(rest[11]) + int(rest[12])
        except (IndexError, ValueError):
            continue
    return total / _CLK


# --------------------------------------------------------------------------
# brokers
# --------------------------------------------------------------------------


class Broker:
    name = "?"
    supports_topic = True

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.tmp: Path | None = None
        self.port: int | None = None
        self.stdout_path: Path | None = None
        self.stderr_path: Path | None = None
        self.start_error: str | None = None

    # -- lifecycle
    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        kill_group(self.proc)
        self.proc = None
        if self.tmp and not self.args.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        return session_cpu_seconds(self.proc.pid) if self.proc else 0.0

    def output_tail(self) -> str:
        t = tail_text(self.stderr_path)
        if not t.strip():
            t = tail_text(self.stdout_path)
        return t

    def _spawn(self, cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> None:
        assert self.tmp is not None
        self.stdout_path = self.tmp / "stdout.log"
        self.stderr_path = self.tmp / "stderr.log"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=str(cwd) if cwd else None,
                env=env,
                start_new_session=True,
            )

    def _wait_port(self, timeout: float) -> None:
        assert self.port is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise BrokerStartError(
                    f"exited with code {self.proc.returncode}: {self.output_tail() or '(no output)'}"
                )
            if port_open(self.port):
                return
            time.sleep(0.1)
        raise BrokerStartError(
            f"port {self.port} not accepting TCP after {timeout:.0f}s: "
            f"{self.output_tail() or '(no output)'}"
        )

    # -- addressing
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def queue_address(self, name: str) -> str:
        return name

    def topic_address(self, key: str) -> str:
        raise NotImplementedError

    def after_run(self, queues: list[str]) -> None:
        pass

    def describe(self) -> str:
        return self.name


class AmqpBroker(Broker):
    name = "amqpbroker"

    def start(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-amqpbroker-"))
        data = self.tmp / "data"
        data.mkdir()
        exe = Path(self.args.amqpbroker_bin)
        if not exe.exists():
            raise BrokerStartError(f"{exe} not found")
        self.port = free_port()
        cmd = [
            str(exe), "serve",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--data-dir", str(data),
            "--log-level", "warning",
        ]
        # The management listener on a free port: the fixed 8161 may be taken.
        self._spawn(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1", AMQPBROKER_MANAGEMENT__PORT="0"))
        self._wait_port(self.args.start_timeout)

    def topic_address(self, key: str) -> str:
        return f"amq.topic/{key}"

    def describe(self) -> str:
        return f"amqpbroker ({self.args.amqpbroker_bin})"


class BaselineBroker(AmqpBroker):
    """amqpbroker from another source tree (e.g. `git archive <commit> amqpbroker`),
    run by this venv's Python: the same dependencies, the code before a change, in
    the same run (`--baseline-src` of rates.py, durable.py)."""
    name = "baseline"

    def start(self) -> None:
        src = Path(self.args.baseline_src).resolve()
        if not (src / "amqpbroker" / "__init__.py").exists():
            raise BrokerStartError(f"{src}/amqpbroker not found")
        python = REPO / ".venv" / "bin" / "python"
        self.args = argparse.Namespace(**vars(self.args))
        wrapper = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "amqpbroker"
        # (run from the tree itself: `python -m` puts the working directory first on the path)
        wrapper.write_text(f"#!/bin/sh\ncd {src} && PYTHONPATH={src} exec {python} -m amqpbroker.cli \"$@\"\n")
        wrapper.chmod(0o755)
        self.args.amqpbroker_bin = str(wrapper)
        super().start()

    def describe(self) -> str:
        return f"amqpbroker from {self.args.baseline_src}"


class CBroker(Broker):
    name = "cbroker"
    supports_topic = False  # the example broker only has queues

    def start(self) -> None:
        if not CBROKER.exists():
            raise BrokerStartError(f"{CBROKER} not built: run bench/build.sh")
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-cbroker-"))
        self.port = free_port()
        # cwd=build so that it finds build/ssl-certs
        self._spawn([str(CBROKER), "127.0.0.1", str(self.port)], cwd=BUILD)
        self._wait_port(self.args.start_timeout)

    def describe(self) -> str:
        return "Qpid Proton C example broker (libqpid-proton11 examples/c/broker.c, 4 threads)"


class RabbitMQ(Broker):
    name = "rabbitmq"
    NODE = "bench@localhost"

    def __init__(self, args):
        super().__init__(args)
        self.epmd: subprocess.Popen | None = None
        self.env: dict = {}

    def start(self) -> None:
        if not RABBIT_SERVER.exists():
            raise BrokerStartError(f"{RABBIT_SERVER} not found (apt-get install rabbitmq-server)")
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-rabbitmq-"))
        home = self.tmp / "home"
        for d in ("home", "mnesia", "log"):
            (self.tmp / d).mkdir()
        self.port = self.args.rabbitmq_port
        if port_open(self.port):
            self.port = free_port()
        dist_port = free_port()
        (self.tmp / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users.guest = true\n"
            "log.console = false\n"
            "log.file.level = warning\n"
        )
        (self.tmp / "enabled_plugins").write_text("[rabbitmq_amqp1_0].\n")
        (self.tmp / "rabbitmq-env.conf").write_text(
            f"NODENAME={self.NODE}\n"
            f"CONFIG_FILE={self.tmp / 'rabbitmq.conf'}\n"
            f"ENABLED_PLUGINS_FILE={self.tmp / 'enabled_plugins'}\n"
            f"MNESIA_BASE={self.tmp / 'mnesia'}\n"
            f"LOG_BASE={self.tmp / 'log'}\n"
            f"DIST_PORT={dist_port}\n"
            "SERVER_ADDITIONAL_ERL_ARGS=\"-kernel inet_dist_use_interface {127,0,0,1}\"\n"
        )
        self.env = dict(
            os.environ,
            HOME=str(home),
            RABBITMQ_CONF_ENV_FILE=str(self.tmp / "rabbitmq-env.conf"),
            ERL_EPMD_ADDRESS="127.0.0.1",
        )
        # Erlang would start epmd as a daemon that outlives us; start it
        # ourselves, in the foreground and in its own process group, unless
        # one is already listening.
        if not port_open(4369):
            epmd = shutil.which("epmd") or "/usr/bin/epmd"
            with open(self.tmp / "epmd.log", "wb") as f:
                self.epmd = subprocess.Popen(
                    [epmd, "-address", "127.0.0.1"],
                    stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                    env=self.env, start_new_session=True,
                )
            for _ in range(50):
                if port_open(4369):
                    break
                time.sleep(0.1)
        self._spawn([str(RABBIT_SERVER)], env=self.env, cwd=self.tmp)
        self._wait_port(self.args.start_timeout + 60)
        r = self.ctl(["await_startup", "--timeout", "60"], timeout=90)
        if r is None or r.returncode != 0:
            raise BrokerStartError(f"await_startup failed: {self.output_tail()}")

    def ctl(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(
                [str(RABBITMQCTL), "-n", self.NODE, *argv],
                env=self.env, stdin=subprocess.DEVNULL, capture_output=True,
                timeout=timeout, start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.alive():
            self.ctl(["stop"], timeout=60)
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
        kill_group(self.proc)
        self.proc = None
        kill_group(self.epmd, grace=2)
        self.epmd = None
        if self.tmp and not self.args.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def output_tail(self) -> str:
        t = super().output_tail()
        if self.tmp:
            t = (t + "\n" + tail_text(self.tmp / "log" / f"{self.NODE}.log", 6)).strip()
        return t

    def url(self) -> str:
        return f"guest:guest@127.0.0.1:{self.port}"  # SASL PLAIN

    def queue_address(self, name: str) -> str:
        return f"/queue/{name}"  # declares the queue on attach

    def topic_address(self, key: str) -> str:
        return f"/topic/{key}"

    def after_run(self, queues: list[str]) -> None:
        for q in queues:
            self.ctl(["delete_queue", q], timeout=30)

    def describe(self) -> str:
        v = ""
        for p in Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*"):
            v = p.name.split("-", 1)[1]
        return f"RabbitMQ {v} (rabbitmq_amqp1_0 plugin)"


BROKER_CLASSES = {"amqpbroker": AmqpBroker, "cbroker": CBroker, "rabbitmq": RabbitMQ,
                  "baseline": BaselineBroker}


# --------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------


def scenario_params(name: str, args: argparse.Namespace) -> dict:
    base = dict(size=args.size, window=1000, credit=1000, senders=1)
    if name == "p2p":
        return dict(base, receivers=1, messages=args.messages, kind="queue")
    if name == "fanout":
        return dict(base, receivers=4, messages=args.messages, kind="topic", fanout=True)
    if name == "competing":
        return dict(base, receivers=4, messages=args.messages, kind="queue")
    if name == "latency":
        n = int(round(args.latency_rate * args.latency_seconds))
        return dict(base, receivers=1, messages=n, kind="queue", rate=args.latency_rate,
                    burst=args.latency_burst)
    raise ValueError(name)


def run_loadgen(broker: Broker, scenario: str, rep: int, args: argparse.Namespace) -> dict:
    p = scenario_params(scenario, args)
    tag = f"bench-{scenario}-{uuid.uuid4().hex[:8]}"
    queues: list[str] = []
    if p["kind"] == "topic":
        address = broker.topic_address(tag)
    else:
        address = broker.queue_address(tag)
        queues.append(tag)
    cmd = [
        str(LOADGEN),
        "--url", broker.url(),
        "--address", address,
        "--messages", str(p["messages"]),
        "--size", str(p["size"]),
        "--senders", str(p["senders"]),
        "--receivers", str(p["receivers"]),
        "--window", str(p["window"]),
        "--credit", str(p["credit"]),
        "--timeout", str(args.timeout),
        "--threads", str(args.loadgen_threads),
    ]
    if p.get("fanout"):
        cmd += ["--fanout", "--start-delay", str(args.fanout_start_delay)]
    if p.get("rate"):
        cmd += ["--rate", str(p["rate"])]
    if p.get("burst"):
        cmd += ["--burst", str(p["burst"])]
    if args.durable:
        cmd.append("--durable")
        if broker.name == "rabbitmq" and p["kind"] == "queue":
            # RabbitMQ declares /queue/NAME durable only for a durable terminus; in a
            # non-durable queue it keeps persistent messages in memory.
            cmd.append("--terminus-durable")

    result: dict = {"scenario": scenario, "broker": broker.name, "rep": rep, "cmd": cmd}
    cpu0 = broker.cpu_seconds()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, text=True,
    )
    try:
        out, err = proc.communicate(timeout=args.timeout + 20)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace=1)
        out, err = proc.communicate()
        result["error"] = f"loadgen killed after {args.timeout + 20}s"
    finally:
        if proc.poll() is None:
            kill_group(proc, grace=1)
    wall = time.monotonic() - t0
    cpu1 = broker.cpu_seconds()
    result["broker_cpu_s"] = max(0.0, cpu1 - cpu0)
    result["run_wall_s"] = wall
    result["loadgen_rc"] = proc.returncode
    result["loadgen_stderr"] = (err or "")[-2000:]
    line = next((ln for ln in reversed((out or "").splitlines()) if ln.startswith("{")), None)
    if line:
        try:
            result.update(json.loads(line))
        except json.JSONDecodeError:
            result.setdefault("error", f"bad loadgen output: {line[:200]}")
    else:
        result.setdefault("error", f"no loadgen result (rc={proc.returncode}): {(err or '').strip()[-300:]}")
    if "seconds" in result and result.get("loadgen_wall_s"):
        result["loadgen_cpu_pct"] = 100.0 * result["loadgen_cpu_s"] / result["loadgen_wall_s"]
        # broker CPU was sampled around the whole loadgen process
        result["broker_cpu_pct"] = 100.0 * result["broker_cpu_s"] / wall
    deliveries = result.get("unique") or 0
    if deliveries:
        # broker CPU per delivered message (fan-out: per delivery), the figure to
        # compare between a moderate rate and full speed
        result["broker_cpu_us_per_msg"] = result["broker_cpu_s"] / deliveries * 1e6
    if scenario == "competing" and result.get("per_receiver"):
        counts = result["per_receiver"]
        even = sum(counts) / len(counts)
        result["split_max_dev_pct"] = (
            max(abs(c - even) for c in counts) / even * 100.0 if even else None
        )
    if not broker.alive():
        result.setdefault("error", "broker died")
        result["broker_died"] = broker.output_tail()
    try:
        broker.after_run(queues)
    except Exception as e:  # cleanup must not abort the benchmark
        log(f"{broker.name}: cleanup failed: {e}")
    return result


# --------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------


def med(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict]) -> dict:
    """(scenario, broker) -> medians over repeats."""
    out: dict = {}
    for r in runs:
        out.setdefault((r["scenario"], r["broker"]), []).append(r)
    summ = {}
    for key, rs in out.items():
        # runs that ended in an error (connection lost, broker died) are not
        # measurements; timed-out runs are kept and flagged
        ok = [r for r in rs if "msgs_per_s" in r and not r.get("error")]
        s = {
            "runs": len(rs),
            "msgs_per_s": med([r["msgs_per_s"] for r in ok]),
            "p50_ms": med([r.get("p50_ms") for r in ok]),
            "p99_ms": med([r.get("p99_ms") for r in ok]),
            "p999_ms": med([r.get("p999_ms") for r in ok]),
            "max_ms": med([r.get("max_ms") for r in ok]),
            "over_5ms": med([r.get("over_5ms") for r in ok]),
            "cpu_us": med([r.get("broker_cpu_us_per_msg") for r in ok]),
            "loadgen_cpu_pct": med([r.get("loadgen_cpu_pct") for r in ok]),
            "broker_cpu_pct": med([r.get("broker_cpu_pct") for r in ok]),
            "split_max_dev_pct": med([r.get("split_max_dev_pct") for r in ok]),
            "per_receiver": [r.get("per_receiver") for r in ok],
            "timeouts": sum(1 for r in rs if r.get("timeout")),
            "duplicates": max((r.get("duplicates") or 0) for r in rs),
            "errors": [r["error"] for r in rs if r.get("error")],
        }
        summ[key] = s
    return summ


def fmt_rate(v):
    return "—" if v is None else f"{v:,.0f}"


def fmt_ms(v):
    if v is None:
        return "—"
    return f"{v:.2f}" if v < 100 else f"{v:,.0f}"


def fmt_ratio(a, b, invert=False):
    if a is None or b is None or b == 0 or a == 0:
        return "—"
    r = (b / a) if invert else (a / b)
    return f"{r:.2f}×" if r >= 0.1 else f"{r:.2g}×"


def build_rows(summ: dict, scenarios: list[str], brokers: list[str], failed: dict,
               died: dict) -> tuple[list, list]:
    """Rows of the main table: (label, {broker: cell}, ratio_rabbit, ratio_c)."""
    ratio_to = [b for b in ("rabbitmq", "cbroker", "baseline") if b in brokers and "amqpbroker" in brokers]
    header = ["scenario", "metric"] + [LABELS[b] for b in brokers] + [
        f"amqpbroker / {LABELS[b]}" for b in ratio_to]
    rows = []

    def cell(sc, b, metric, fmt, flagged=True):
        if b in failed:
            return "failed to start"
        s = summ.get((sc, b))
        if s is None:
            return "broker died" if b in died else "—"
        v = s.get(metric)
        txt = fmt(v)
        if v is None and s["errors"]:
            return "broker died" if b in died else "error"
        flags = []
        if s["timeouts"]:
            flags.append("timeout")
        if s["errors"] and not s["timeouts"]:
            flags.append("error")
        if s.get("duplicates"):
            flags.append(f"{s['duplicates']:,} dup")
        if flags and flagged:
            txt += " [" + ",".join(flags) + "]"
        return txt

    def value(sc, b, metric):
        if b in failed:
            return None
        s = summ.get((sc, b))
        return s.get(metric) if s else None

    metrics = {
        "p2p": [("msgs/s", "msgs_per_s", fmt_rate, False)],
        "fanout": [("deliveries/s", "msgs_per_s", fmt_rate, False)],
        "competing": [("msgs/s", "msgs_per_s", fmt_rate, False),
                      ("split max dev %", "split_max_dev_pct",
                       lambda v: "—" if v is None else f"{v:.1f}", None)],
        "latency": [("p50 ms", "p50_ms", fmt_ms, True), ("p99 ms", "p99_ms", fmt_ms, True),
                    ("p99.9 ms", "p999_ms", fmt_ms, True), ("max ms", "max_ms", fmt_ms, True),
                    ("messages > 5 ms", "over_5ms", fmt_rate, None),
                    ("achieved msgs/s", "msgs_per_s", fmt_rate, False)],
    }
    for rows_of in metrics.values():
        rows_of.append(("broker CPU µs/msg", "cpu_us", lambda v: "—" if v is None else f"{v:.1f}", True))
    def cpu_cell(sc, b):
        s = summ.get((sc, b))
        if b in failed or not s or s.get("loadgen_cpu_pct") is None:
            return "—"
        return f"{s['loadgen_cpu_pct']:.0f} / {s['broker_cpu_pct']:.0f}"

    for sc in scenarios:
        for i, (label, metric, fmt, lower_better) in enumerate(metrics[sc]):
            cells = [cell(sc, b, metric, fmt, flagged=(i == 0)) for b in brokers]
            a = value(sc, "amqpbroker", metric)
            # ratio > 1 means amqpbroker is better (faster / lower latency)
            ratios = ["" if lower_better is None
                      else fmt_ratio(a, value(sc, b, metric), invert=lower_better)
                      for b in ratio_to]
            rows.append([sc if i == 0 else "", label, *cells, *ratios])
        rows.append(["", "CPU % loadgen / broker", *[cpu_cell(sc, b) for b in brokers],
                     *["" for _ in ratio_to]])
    return header, rows


def rabbitmq_durable_rate(messages: int, size: int, reps: int, say=print) -> float | None:
    """Median RabbitMQ durable p2p msgs/s (persistent messages, a durable queue) for
    benchmarks that put a figure of their own against it; None when RabbitMQ is not
    installed (bench/setup.sh) or does not start."""
    if not Path("/usr/lib/rabbitmq/bin").exists():
        return None
    args = parse_args(["--brokers", "rabbitmq", "--scenarios", "p2p", "--durable",
                       "--messages", str(messages), "--size", str(size)])
    broker = BROKER_CLASSES["rabbitmq"](args)
    try:
        broker.start()
        rates = [run_loadgen(broker, "p2p", i, args).get("msgs_per_s") for i in range(reps)]
    except BrokerStartError as exc:
        say(f"RabbitMQ did not start: {exc}")
        return None
    finally:
        broker.stop()
    rates = [r for r in rates if r]
    return statistics.median(rates) if rates else None


def own_ratios(summ: dict, brokers: list[str]) -> list[str]:
    """Each broker against its own p2p in the same run: fan-out deliveries/s and
    competing msgs/s over p2p msgs/s, and broker CPU per message in the latency
    scenario (a moderate rate) over CPU per message at full speed (p2p)."""
    lines = []
    for b in brokers:
        p2p = summ.get(("p2p", b), {})
        parts = []
        for sc, label in (("fanout", "fan-out 1→4 / p2p"), ("competing", "competing 1→4 / p2p")):
            v = summ.get((sc, b), {}).get("msgs_per_s")
            if v and p2p.get("msgs_per_s"):
                parts.append(f"{label} {v / p2p['msgs_per_s']:.2f}×")
        lat_cpu = summ.get(("latency", b), {}).get("cpu_us")
        if lat_cpu and p2p.get("cpu_us"):
            parts.append(f"CPU/msg at the latency rate / at full speed {lat_cpu / p2p['cpu_us']:.2f}× "
                         f"({lat_cpu:.0f} / {p2p['cpu_us']:.0f} µs)")
        if parts:
            lines.append(f"{LABELS[b]}: " + ", ".join(parts))
    return lines


def print_table(header, rows, args) -> None:
    if HAVE_RICH and not args.plain:
        console = Console(width=max(180, shutil.get_terminal_size((180, 40)).columns))
        t = Table(title="AMQP 1.0 broker benchmark (median of repeats)", show_lines=False)
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
        for r in rows:
            t.add_row(*r)
        console.print(t)
    else:
        widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
        line = " | ".join(h.ljust(w) for h, w in zip(header, widths))
        print(line)
        print("-+-".join("-" * w for w in widths))
        for r in rows:
            print(" | ".join((str(c).ljust(w) if i < 2 else str(c).rjust(w))
                             for i, (c, w) in enumerate(zip(r, widths))))
    print("cells: median over repeats; CPU % is of one core (100% = one core busy; 2 cores here),"
          " loadgen CPU = its user+sys CPU s / its wall s")
    print("ratios: >1× means amqpbroker is better (higher rate, or lower latency)")
    print("rates count distinct messages (fan-out: per receiver); 'dup' = redelivered duplicates seen")


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default=",".join(ALL_BROKERS),
                    help="comma list of %s (and baseline, with --baseline-src)" % ",".join(ALL_BROKERS))
    ap.add_argument("--scenarios", default=",".join(ALL_SCENARIOS),
                    help="comma list of %s" % ",".join(ALL_SCENARIOS))
    ap.add_argument("--messages", type=int, default=100_000,
                    help="messages sent per p2p/fanout/competing run (default 100000)")
    ap.add_argument("--size", type=int, default=256, help="body size in bytes (default 256)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="repeats, interleaved across brokers; the table shows the median")
    ap.add_argument("--latency-rate", type=float, default=1000.0, help="msgs/s of the latency scenario")
    ap.add_argument("--latency-seconds", type=float, default=10.0, help="duration of the latency scenario")
    ap.add_argument("--latency-burst", type=int, default=512,
                    help="messages the latency scenario's sender sends at once before pacing, as far as "
                         "the broker's credit allows (amqp-bench's first batch; 0: paced from the first)")
    ap.add_argument("--timeout", type=float, default=120.0, help="bound of each loadgen run, seconds")
    ap.add_argument("--start-timeout", type=float, default=30.0, help="seconds to wait for a broker to listen")
    ap.add_argument("--warmup", type=int, default=5000,
                    help="messages of an unreported p2p warm-up run per broker (0: none)")
    ap.add_argument("--fanout-start-delay", type=int, default=200,
                    help="ms between all topic receivers attached and the first send")
    ap.add_argument("--loadgen-threads", type=int, default=1)
    ap.add_argument("--durable", action="store_true", help="send durable messages")
    ap.add_argument("--amqpbroker-bin", default=str(AMQPBROKER))
    ap.add_argument("--baseline-src", help="with broker `baseline`: a source tree holding amqpbroker/ "
                                           "(the code before a change, in the same run)")
    ap.add_argument("--rabbitmq-port", type=int, default=5674)
    ap.add_argument("--json", metavar="OUT", help="also write all results as JSON to OUT")
    ap.add_argument("--plain", action="store_true", help="plain-text table even if rich is installed")
    ap.add_argument("--keep-tmp", action="store_true", help="keep broker temp dirs (logs) afterwards")
    args = ap.parse_args(argv)
    args.broker_list = [b.strip() for b in args.brokers.split(",") if b.strip()]
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for b in args.broker_list:
        if b not in BROKER_CLASSES:
            ap.error(f"unknown broker {b!r}")
    for s in args.scenario_list:
        if s not in ALL_SCENARIOS:
            ap.error(f"unknown scenario {s!r}")
    if "baseline" in args.broker_list and not args.baseline_src:
        ap.error("broker baseline needs --baseline-src")
    return args


def repo_revision() -> str | None:
    """HEAD commit of the repository, read from .git (no git command)."""
    git = REPO / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).exists():
            return (git / ref).read_text().strip()
        packed = git / "packed-refs"
        if packed.exists():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        pass
    return None


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not LOADGEN.exists():
        print(f"{LOADGEN} missing: run bench/build.sh (or bench/setup.sh)", file=sys.stderr)
        return 2
    # Ctrl-C must reach us even if SIGINT was inherited as ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGHUP, _sigterm)

    brokers: list[Broker] = []
    failed: dict[str, str] = {}  # failed to start
    died: dict[str, str] = {}  # died during the benchmark
    runs: list[dict] = []
    interrupted = False
    started_at = _dt.datetime.now().isoformat(timespec="seconds")
    try:
        for name in args.broker_list:
            b = BROKER_CLASSES[name](args)
            brokers.append(b)
            log(f"starting {name} ...")
            try:
                b.start()
                log(f"{name} listening on 127.0.0.1:{b.port}")
            except BrokerStartError as e:
                msg = " ".join(str(e).split())[-600:]
                failed[name] = msg
                print(f"{name}: failed to start ({msg})", flush=True)
                b.stop()

        live = [b for b in brokers if b.name not in failed]
        if args.warmup > 0:
            for b in live:
                wa = argparse.Namespace(**vars(args))
                wa.messages = args.warmup
                r = run_loadgen(b, "p2p", -1, wa)
                log(f"warm-up {b.name}: {fmt_rate(r.get('msgs_per_s'))} msgs/s"
                    + (f" error: {r['error']}" if r.get("error") else ""))

        for rep in range(args.repeat):
            order = live[rep % len(live):] + live[:rep % len(live)] if live else []
            for sc in args.scenario_list:
                for b in order:
                    if b.name in died:
                        continue
                    if sc == "fanout" and not b.supports_topic:
                        continue
                    if not b.alive():
                        died[b.name] = (f"exit code {b.proc.returncode if b.proc else '?'}: "
                                        + " ".join(b.output_tail().split())[-600:])
                        print(f"{b.name}: broker died ({died[b.name]})", flush=True)
                        continue
                    r = run_loadgen(b, sc, rep, args)
                    runs.append(r)
                    msg = (f"rep {rep + 1}/{args.repeat} {sc:9s} {b.name:10s} "
                           f"{fmt_rate(r.get('msgs_per_s'))} msgs/s  p50 {fmt_ms(r.get('p50_ms'))} ms  "
                           f"p99 {fmt_ms(r.get('p99_ms'))} ms  loadgen CPU "
                           f"{r.get('loadgen_cpu_pct', 0):.0f}%  broker CPU {r.get('broker_cpu_pct', 0):.0f}%")
                    if r.get("per_receiver") and len(r["per_receiver"]) > 1:
                        msg += f"  per receiver {r['per_receiver']}"
                    if r.get("duplicates"):
                        msg += f"  DUPLICATES {r['duplicates']}"
                    if r.get("unclosed"):
                        msg += f"  ({r['unclosed']} connection(s) not closed by the broker within 3 s)"
                    if r.get("timeout"):
                        msg += "  TIMEOUT"
                    if r.get("error"):
                        msg += f"  ERROR {r['error']}"
                    log(msg)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up")
    finally:
        for b in brokers:
            try:
                b.stop()
            except BaseException as e:  # keep stopping the others
                log(f"stopping {b.name}: {e!r}")

    summ = summarize(runs)
    header, rows = build_rows(summ, args.scenario_list, args.broker_list, failed, died)
    print()
    print_table(header, rows, args)
    for line in own_ratios(summ, args.broker_list):
        print(line)
    for name, msg in failed.items():
        print(f"{name}: failed to start ({msg})")
    for name, msg in died.items():
        print(f"{name}: broker died during the benchmark ({msg})")
    errs = [r for r in runs if r.get("error")]
    for r in errs:
        print(f"error in {r['scenario']} on {r['broker']} (rep {r['rep'] + 1}): {r['error']}")
    if interrupted:
        print("interrupted: the table holds the runs finished so far")
    comp = [(b, summ.get(("competing", b))) for b in args.broker_list]
    comp = [(b, s) for b, s in comp if s and s["per_receiver"]]
    if comp:
        print("competing consumers, per-receiver counts:")
        for b, s in comp:
            print(f"  {LABELS[b]}: " + "; ".join(
                "[" + ", ".join(f"{c:,}" for c in counts) + "]" for counts in s["per_receiver"])
                + f"  (max deviation from an even split {s['split_max_dev_pct']:.1f}%)")
    if "fanout" in args.scenario_list and "cbroker" in args.broker_list:
        print("fan-out: the C example broker has no topics (—)")

    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "started_at": started_at,
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                     "python": sys.version.split()[0]},
            "args": {k: v for k, v in vars(args).items() if k not in ("broker_list", "scenario_list")},
            "brokers": {b.name: b.describe() for b in brokers},
            "repo_head": repo_revision(),  # the working tree may differ from it
            "failed": failed,
            "died": died,
            "runs": runs,
            "summary": [dict(scenario=k[0], broker=k[1], **v) for k, v in summ.items()],
            "table": {"header": header, "rows": rows},
            "interrupted": interrupted,
        }
        out.write_text(json.dumps(doc, indent=2))
        print(f"results written to {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
