#!/usr/bin/env python3
"""Memory a durable burst leaves behind: broker and store-writer RSS before, during
and after a burst of durable messages with no consumer.

1. start amqpbroker on a fresh data dir;
2. RSS of the broker process and of its store writer process (its child, found
   through /proc/<pid>/task/*/children), from /proc/PID/status;
3. send a durable burst (default 200,000 x 1 KiB, no consumer) with
   bench/build/loadgen (`--receivers 0 --durable`) when it is built, else with a
   python-qpid-proton sender (slower); RSS is sampled every 0.2 s meanwhile (the
   peak is shown);
4. wait idle (default 5 s) and sample again: what the burst left behind.

    .venv/bin/python bench/store_memory.py
    .venv/bin/python bench/store_memory.py --messages 50000 --senders 4
    .venv/bin/python bench/store_memory.py --repo /tmp/store-old     # another source tree

`--repo` runs the broker from another checkout (e.g. a `git worktree` of an older
commit) with this repository's virtualenv.  A benchmark: it prints figures and
asserts nothing.  Every process it starts is killed in a finally block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backlog import kill_now  # noqa: E402  (bench/backlog.py)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LOADGEN = HERE / "build" / "loadgen"
PYTHON = REPO / ".venv" / "bin" / "python"
LISTEN_RE = re.compile(r"amqp listening on [\d.]+:(\d+)")
MB = 1 << 20
KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in KEYS:
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def writer_pid(pid: int) -> int | None:
    """The broker's store writer process (`python -m amqpbroker.store.writer`)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"amqpbroker.store.writer" in f.read():
                        return child
            except FileNotFoundError:
                pass
    return None


def fmt(st: dict[str, int]) -> str:
    if not st:
        return "(gone)"
    return (f"RSS {st.get('VmRSS', 0) / MB:7.1f} MB (anon {st.get('RssAnon', 0) / MB:6.1f}, "
            f"file {st.get('RssFile', 0) / MB:6.1f})")


class Sampler(threading.Thread):
    """Peak RSS of broker and writer while the burst runs."""

    def __init__(self, broker: int):
        super().__init__(daemon=True)
        self.broker = broker
        self.peak = {"broker": 0, "writer": 0}
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.wait(0.2):
            for name, pid in (("broker", self.broker), ("writer", writer_pid(self.broker))):
                if pid is not None:
                    self.peak[name] = max(self.peak[name], status(pid).get("VmRSS", 0))


def start_broker(repo: Path, data: Path, log_path: Path) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", AMQPBROKER_MANAGEMENT__PORT="0",
               PYTHONPATH=str(repo))
    cmd = [str(PYTHON), "-m", "amqpbroker.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--data-dir", str(data), "--log-level", "info"]
    proc = subprocess.Popen(cmd, cwd=str(repo), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    port: list[int] = []
    ready = threading.Event()

    def read() -> None:
        with open(log_path, "a") as f:
            for line in proc.stderr:
                f.write(line)
                f.flush()
                m = LISTEN_RE.search(line)
                if m and not port:
                    port.append(int(m.group(1)))
                    ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120) or not port:
        raise RuntimeError(f"broker did not start; see {log_path}")
    return proc, port[0]


def send_loadgen(port: int, address: str, n: int, size: int, senders: int, window: int,
                 timeout: float) -> dict:
    cmd = [str(LOADGEN), "--url", f"127.0.0.1:{port}", "--address", address, "--messages", str(n),
           "--size", str(size), "--senders", str(senders), "--receivers", "0", "--durable",
           "--window", str(window), "--timeout", str(timeout)]
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout + 30)
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    return json.loads(line) if line else {"error": p.stderr.strip()[-300:]}


def send_python(port: int, address: str, n: int, size: int, window: int) -> dict:
    """Fallback sender: python-qpid-proton, unsettled, `window` in flight."""
    from proton import Message
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Burst(MessagingHandler):
        def __init__(self):
            super().__init__()
            self.sent = self.settled = self.accepted = 0
            self.body = b"x" * size

        def on_start(self, event):
            conn = event.container.connect(f"amqp://127.0.0.1:{port}", reconnect=False)
            event.container.create_sender(conn, address)

        def on_sendable(self, event):
            s = event.sender
            while s.credit and self.sent < n and self.sent - self.settled < window:
                s.send(Message(body=self.body, durable=True))
                self.sent += 1

        def on_settled(self, event):
            self.settled += 1
            if event.delivery.remote_state == event.delivery.ACCEPTED:
                self.accepted += 1
            if self.settled >= n:
                event.connection.close()
            else:
                self.on_sendable(event)

    h = Burst()
    t0 = time.monotonic()
    Container(h).run()
    return {"sent": h.sent, "accepted": h.accepted, "seconds": round(time.monotonic() - t0, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--senders", type=int, default=1)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds idle after the burst")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--repo", type=Path, default=REPO, help="source tree to run the broker from")
    ap.add_argument("--python-sender", action="store_true", help="do not use bench/build/loadgen")
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="store-memory-"))
    proc = None
    try:
        proc, port = start_broker(args.repo.resolve(), tmp / "data", tmp / "broker.log")
        deadline = time.monotonic() + 10
        while writer_pid(proc.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        wpid = writer_pid(proc.pid)
        print(f"broker from {args.repo}: pid {proc.pid}, writer pid {wpid}, port {port}")
        print(f"before  broker {fmt(status(proc.pid))}   writer {fmt(status(wpid) if wpid else {})}")
        sampler = Sampler(proc.pid)
        sampler.start()
        t0 = time.monotonic()
        if LOADGEN.exists() and not args.python_sender:
            result = send_loadgen(port, "burst", args.messages, args.size, args.senders, args.window,
                                  args.timeout)
        else:
            result = send_python(port, "burst", args.messages, args.size, args.window)
        elapsed = time.monotonic() - t0
        sampler.stop_flag.set()
        sampler.join()
        print(f"burst   {args.messages} x {args.size} B durable, {args.senders} sender(s), window "
              f"{args.window}: {elapsed:.1f} s  {json.dumps({k: result.get(k) for k in ('sent', 'accepted', 'msgs_per_s', 'error') if k in result})}")
        wpid = writer_pid(proc.pid)
        print(f"during  broker peak RSS {sampler.peak['broker'] / MB:7.1f} MB   "
              f"writer peak RSS {sampler.peak['writer'] / MB:7.1f} MB")
        print(f"end     broker {fmt(status(proc.pid))}   writer {fmt(status(wpid) if wpid else {})}")
        time.sleep(args.idle)
        wpid = writer_pid(proc.pid)
        b, w = status(proc.pid), status(wpid) if wpid else {}
        print(f"idle {args.idle:.0f}s broker {fmt(b)}   writer {fmt(w)}")
        print(f"        peak (VmHWM) broker {b.get('VmHWM', 0) / MB:.1f} MB, writer {w.get('VmHWM', 0) / MB:.1f} MB")
        store = tmp / "data" / "store" / "data.mdb"
        if store.exists():
            print(f"        data.mdb {store.stat().st_size / MB:.1f} MB")
    finally:
        kill_now(proc)
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
