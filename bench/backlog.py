#!/usr/bin/env python3
"""A durable backlog of 1,000,000 x 256 B: memory held, restart time, drain rate.

1. start amqpbroker (defaults: queue_memory_budget 16 MiB, so entries beyond it are
   kept only in the store, the queue's paged region, and read back in batches);
2. fill one durable queue with bench/build/loadgen --receivers 0 --durable
   (unsettled sends, window 1000: every message Accepted after its group commit);
3. broker RSS with the backlog held (/proc/PID/status: VmRSS = RssAnon + RssFile;
   RssFile is LMDB's memory map, clean pages the kernel can drop);
4. SIGTERM, restart on the same store: start-up time (process start -> the
   "amqp listening" log line; the "store recovered" line gives the recovery part),
   RSS after the restart;
5. kill -9 in the middle of another durable fill (--crash-messages): the restart
   applies the store's journal again (store/journal.py: what was committed since
   the last checkpoint) on top of the backlog: start-up time again;
6. drain with loadgen --senders 0 (one receiver, credit 1000): msgs/s.

Targets: RSS <= 300 MB with the backlog held, restart < 10 s (after SIGTERM and
after kill -9).

    .venv/bin/python bench/backlog.py                        # 1M x 256 B
    .venv/bin/python bench/backlog.py --messages 200000      # quicker look
    .venv/bin/python bench/backlog.py --profile              # + per-entry memory breakdown

A benchmark: it prints figures and asserts nothing.  One broker at a time; every
process it starts is killed in a finally block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LOADGEN = HERE / "build" / "loadgen"
PYTHON = REPO / ".venv" / "bin" / "python"
LISTEN_RE = re.compile(r"amqp listening on [\d.]+:(\d+)")
RECOVERED_RE = re.compile(r"store recovered .* in ([\d.]+) s")
JOURNAL_RE = re.compile(r"(\d+) batch\(es\) of the journal applied again")
MB = 1 << 20


def log(msg: str) -> None:
    print(f"[backlog {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _one_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmSize"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile (bytes) of the broker: its process plus its
    children (the store's writer process), summed."""
    pids = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            pids += [int(c) for c in f.read().split()]
    out: dict[str, int] = {}
    for p in pids:
        try:
            for key, value in _one_status(p).items():
                out[key] = out.get(key, 0) + value
        except FileNotFoundError:
            pass
    return out


def fmt_mem(st: dict[str, int]) -> str:
    return (f"VmRSS {st['VmRSS'] / MB:,.0f} MB (anon {st['RssAnon'] / MB:,.0f} MB + file/LMDB map "
            f"{st['RssFile'] / MB:,.0f} MB), peak VmHWM {st['VmHWM'] / MB:,.0f} MB")


class Broker:
    def __init__(self, data: Path, log_path: Path, config: Path | None, src: Path | None = None):
        self.data = data
        self.log_path = log_path
        self.config = config
        self.src = Path(src).resolve() if src else None   # another source tree (the code before a change)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()

    def start(self, timeout: float = 300) -> float:
        """Start; seconds from the process start to the 'amqp listening' line."""
        cmd = [str(PYTHON), "-m", "amqpbroker.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--data-dir", str(self.data), "--log-level", "info"]
        if self.config:
            cmd += ["--config", str(self.config)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", AMQPBROKER_MANAGEMENT__PORT="0")
        if self.src:   # run from that tree: `python -m` puts the working directory first
            env["PYTHONPATH"] = str(self.src)
        self.lines = []
        self.port = None
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=str(self.src or REPO), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        deadline = t0 + timeout
        with self.cond:
            while self.port is None:
                if self.proc.poll() is not None:
                    raise RuntimeError("broker exited:\n" + self.tail())
                if time.monotonic() > deadline:
                    raise RuntimeError("broker did not start in time:\n" + self.tail())
                self.cond.wait(0.2)
            return self.listen_at - t0

    def _read(self, proc):
        with open(self.log_path, "a") as f:
            for line in proc.stderr:
                now = time.monotonic()
                f.write(line)
                with self.cond:
                    self.lines.append((now, line))
                    m = LISTEN_RE.search(line)
                    if m and self.port is None:
                        self.port = int(m.group(1))
                        self.listen_at = now
                    self.cond.notify_all()

    def tail(self, n: int = 15) -> str:
        return "".join(line for _, line in self.lines[-n:])

    def find(self, rx: re.Pattern) -> re.Match | None:
        for _, line in self.lines:
            m = rx.search(line)
            if m:
                return m
        return None

    def stop(self, timeout: float = 120) -> float:
        """SIGTERM; seconds until the process exited."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        return time.monotonic() - t0

    def kill(self):
        kill_now(self.proc)


def kill_now(proc: subprocess.Popen | None) -> None:
    """SIGKILL a process started with start_new_session (its whole group) if it runs."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def loadgen(url: str, args: list[str], timeout: float) -> dict:
    cmd = [str(LOADGEN), "--url", url, *args, "--timeout", str(timeout)]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    if not line:
        return {"error": f"no loadgen result: {err.strip()[-300:]}"}
    return json.loads(line)


def du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def profile_entries(n: int, size: int) -> str:
    """Where a backlog's memory goes, measured in this process with the broker's own
    classes (tracemalloc): a paged-out entry (index only, as after a restart or once
    past the queue's memory budget) and an entry whose body is held in memory."""
    import tracemalloc

    sys.path.insert(0, str(REPO))
    from proton import Message as PnMessage

    from amqpbroker.core.message import Message
    from amqpbroker.core.queues import Entry, Queue
    from amqpbroker.store.durability import _shared

    def measure(fill) -> tuple[float, list[str]]:
        tracemalloc.start()
        base = tracemalloc.take_snapshot()
        keep = fill()
        stats = tracemalloc.take_snapshot().compare_to(base, "lineno")
        tracemalloc.stop()
        del keep
        total = sum(s.size_diff for s in stats)
        top = [f"      {s.size_diff / n:6.1f} B  {s.traceback[0].filename.split('/')[-1]}:{s.traceback[0].lineno}"
               for s in stats[:5] if s.size_diff / n >= 4]
        return total / n, top

    def paged():
        q = Queue("p", durable=True)
        for seq in range(1, n + 1):
            q.restore(Entry.paged(seq, 10**7 + seq, size=_shared(size + 19), priority=4, delivery_count=0,
                                  expires_at=None, deliver_at=None, group=None))
        return q

    raw = PnMessage(body=b"x" * size, durable=True).encode()

    def loaded():
        q = Queue("m", durable=True)
        for _ in range(n):
            q.enqueue(Message(bytes(raw)))
        return q

    p, ptop = measure(paged)
    m, mtop = measure(loaded)
    return "\n".join([
        f"memory profile (tracemalloc, {n:,} entries each):",
        f"  paged-out entry (Entry object 120 B + seq int + store id int + ready-list slot): {p:.0f} B"
        f" -> {p * 1e6 / MB:,.0f} MB per million", *ptop,
        f"  entry with its body in memory ({len(raw)} B encoded, counted as {len(raw)} B against the"
        f" queue_memory_budget): {m:.0f} B -> a 16 MiB budget holds {16 * MB / len(raw):,.0f} bodies"
        f" = {16 * MB / len(raw) * m / MB:,.0f} MB", *mtop])


def crash_kill_restart(broker: Broker, a, res: dict) -> None:
    """kill -9 while a durable fill runs, then start again on the same store."""
    url = f"127.0.0.1:{broker.port}"
    cmd = [str(LOADGEN), "--url", url, "--address", f"crash-{os.getpid()}", "--messages", str(a.crash_messages),
           "--size", str(a.size), "--senders", "1", "--receivers", "0", "--window", str(a.window), "--durable",
           "--timeout", str(a.timeout)]
    filler = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        time.sleep(2.0)   # well into the fill: group commits journaled since the last checkpoint
        broker.kill()
        log(f"kill -9 during a fill of {a.crash_messages:,} durable messages")
    finally:
        kill_now(filler)
    res["crash_restart_s"] = broker.start()
    m = broker.find(RECOVERED_RE)
    res["crash_recovery_s"] = float(m.group(1)) if m else None
    j = broker.find(JOURNAL_RE)
    res["journal_batches"] = int(j.group(1)) if j else 0
    log(f"restart after kill -9: listening {res['crash_restart_s']:.2f} s after the process start "
        f"({res['journal_batches']} journaled batch(es) applied again; {m.group(0) if m else 'no recovery line'})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=900, help="bound of each loadgen run, seconds")
    ap.add_argument("--config", help="TOML text for the broker (e.g. '[store]\\nqueue_memory_budget = 0')")
    ap.add_argument("--profile", action="store_true", help="also measure per-entry memory with tracemalloc")
    ap.add_argument("--crash-messages", type=int, default=200_000,
                    help="durable messages of the fill killed -9 half way (0: no kill -9 restart)")
    ap.add_argument("--keep", action="store_true", help="keep the data dir and broker log")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    if not LOADGEN.exists():
        print(f"{LOADGEN} missing: run bench/build.sh", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="bench-backlog-"))
    cfg = None
    if a.config:
        cfg = tmp / "broker.toml"
        cfg.write_text(a.config.replace("\\n", "\n") + "\n")
    broker = Broker(tmp / "data", tmp / "broker.log", cfg)
    queue = f"backlog-{os.getpid()}"
    res: dict = {"messages": a.messages, "size": a.size}
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        res["first_start_s"] = broker.start()
        res["rss_empty"] = proc_status(broker.proc.pid)
        log(f"broker up in {res['first_start_s']:.2f} s on port {broker.port}; {fmt_mem(res['rss_empty'])}")
        url = f"127.0.0.1:{broker.port}"

        log(f"filling {queue} with {a.messages:,} x {a.size} B durable messages ...")
        t0 = time.monotonic()
        fill = loadgen(url, ["--address", queue, "--messages", str(a.messages), "--size", str(a.size),
                             "--senders", "1", "--receivers", "0", "--window", str(a.window), "--durable"],
                       a.timeout)
        res["fill"] = fill
        res["fill_s"] = time.monotonic() - t0
        log(f"fill: accepted {fill.get('accepted')} rejected {fill.get('rejected')} in {fill.get('seconds', 0):.1f} s"
            f" = {fill.get('msgs_per_s', 0):,.0f} msgs/s" + (f" ERROR {fill['error']}" if fill.get("error") else ""))
        time.sleep(2)   # page-outs run after their commits
        res["rss_held"] = proc_status(broker.proc.pid)
        res["store_bytes"] = du(tmp / "data" / "store")
        log(f"backlog held: {fmt_mem(res['rss_held'])}; store on disk {res['store_bytes'] / MB:,.0f} MB")

        res["stop_s"] = broker.stop()
        log(f"SIGTERM: exited in {res['stop_s']:.2f} s (rc {broker.proc.returncode})")
        res["restart_s"] = broker.start()
        m = broker.find(RECOVERED_RE)
        res["recovery_s"] = float(m.group(1)) if m else None
        res["recovered_line"] = m.group(0) if m else None
        time.sleep(1)
        res["rss_restarted"] = proc_status(broker.proc.pid)
        log(f"restart: listening {res['restart_s']:.2f} s after the process start "
            f"({res['recovered_line']}); {fmt_mem(res['rss_restarted'])}")

        if a.crash_messages:
            crash_kill_restart(broker, a, res)
        url = f"127.0.0.1:{broker.port}"
        log("draining ...")
        drain = loadgen(url, ["--address", queue, "--messages", str(a.messages), "--size", str(a.size),
                              "--senders", "0", "--receivers", "1", "--credit", "1000"], a.timeout)
        res["drain"] = drain
        res["rss_drained"] = proc_status(broker.proc.pid)
        log(f"drain: {drain.get('unique')} distinct ({drain.get('duplicates')} dup) in {drain.get('seconds', 0):.1f} s"
            f" = {drain.get('msgs_per_s', 0):,.0f} msgs/s" + (f" ERROR {drain['error']}" if drain.get("error") else ""))
        broker.stop()
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        broker.kill()
        if a.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    def mb(key, field="VmRSS"):
        st = res.get(key)
        return f"{st[field] / MB:,.0f} MB" if st else "—"

    print()
    print(f"durable backlog: {a.messages:,} x {a.size} B" + (f"  (config: {a.config})" if a.config else ""))
    fill, drain = res.get("fill", {}), res.get("drain", {})
    print(f"  fill (loadgen, window {a.window}, durable)   {fill.get('msgs_per_s', 0):>10,.0f} msgs/s"
          f"   accepted {fill.get('accepted')}, rejected {fill.get('rejected')}")
    print(f"  RSS, empty broker                 {mb('rss_empty'):>10}")
    print(f"  RSS, backlog held                 {mb('rss_held'):>10}   (anon {mb('rss_held', 'RssAnon')},"
          f" LMDB map {mb('rss_held', 'RssFile')}; target <= 300 MB)")
    print(f"  store on disk                     {res.get('store_bytes', 0) / MB:>7,.0f} MB")
    print(f"  SIGTERM -> exit                   {res.get('stop_s', 0):>8.2f} s")
    print(f"  restart -> 'amqp listening'       {res.get('restart_s', 0):>8.2f} s   (store recovery "
          f"{res.get('recovery_s') or 0:.2f} s; target < 10 s)")
    print(f"  RSS after restart                 {mb('rss_restarted'):>10}   (anon {mb('rss_restarted', 'RssAnon')},"
          f" LMDB map {mb('rss_restarted', 'RssFile')}; peak {mb('rss_restarted', 'VmHWM')})")
    if res.get("crash_restart_s"):
        print(f"  kill -9 mid-fill -> 'amqp listening' {res['crash_restart_s']:>5.2f} s   (journal: "
              f"{res.get('journal_batches') or 0:,} batch(es) applied again; store recovery "
              f"{res.get('crash_recovery_s') or 0:.2f} s; target < 10 s)")
    print(f"  drain (1 receiver, credit 1000)   {drain.get('msgs_per_s', 0):>10,.0f} msgs/s"
          f"   received {drain.get('unique')} distinct, {drain.get('duplicates')} duplicates")
    print(f"  RSS after the drain               {mb('rss_drained'):>10}")
    held = res.get("rss_held", {}).get("VmRSS")
    restarted = res.get("rss_restarted", {}).get("VmRSS")
    verdicts = []
    if held:
        verdicts.append(f"RSS held {'OK' if held <= 300 * MB else 'MISSED'}")
    if restarted:
        verdicts.append(f"RSS after restart {'OK' if restarted <= 300 * MB else 'MISSED'}")
    if res.get("restart_s"):
        verdicts.append(f"restart {'OK' if res['restart_s'] < 10 else 'MISSED'}")
    if res.get("crash_restart_s"):
        verdicts.append(f"restart after kill -9 {'OK' if res['crash_restart_s'] < 10 else 'MISSED'}")
    print("  targets: " + ", ".join(verdicts))
    if a.profile:
        print(profile_entries(min(a.messages, 100_000), a.size))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2, default=str))
        print(f"results written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
