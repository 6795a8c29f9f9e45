"""Walk a store and say whether every record in it can be read back.

Damaged pages do not always raise: LMDB follows the page numbers and offsets it
finds, and garbage in a branch or leaf page can point past the end of the file,
which kills the reading process with SIGBUS or SIGSEGV.  So the walk runs in a
child process (`python -m amqpbroker.store.verify DIR [--full]`, one JSON line on
stdout, exit 0 whole / 2 not) and `verify_in_child` turns a death by signal into
"damaged" instead of taking the broker down with it.

quick (every broker start-up, before LMDB is opened in the broker): every page of
every named database is visited and the first and last byte of every value
touched, so every page the broker's recovery and page-in can reach is known to
be inside the file; records are not decoded (recovery decodes what it reads and
turns a failure into StoreDamaged).

full (`amqpbroker store check`): as quick, and every record is decoded as the
broker decodes it (JSON entities, subscriptions, entry records, message headers,
duplicate-detection ids, reader claims); entries whose message is missing are
problems, messages no entry refers to are notes (space that is never freed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

DBS = ("meta", "exchanges", "queues", "seqs", "bindings", "subscriptions", "messages", "entries",
       "dedup", "readers", "routes", "cursors")
MAX_PROBLEMS = 20   # per database; the rest are counted


@dataclass
class Report:
    ok: bool = True
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.ok = False
        self.problems.append(text)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Report":
        d = json.loads(text)
        return cls(bool(d["ok"]), dict(d["counts"]), list(d["problems"]), list(d["notes"]))


# ---------------------------------------------------------------------- decoders (full)


def _decoders() -> dict[str, Callable[[bytes, bytes, dict], None]]:
    """name → decode(key, value, seen): raises on a record the broker could not use."""
    import struct

    from ..core.message import Message
    from .base import QueueRecord
    from .batch import ENTRY_KEY, ENTRY_VAL
    from .subscription_json import subscription_from_json
    from .logrecords import decode_cursor, decode_record, decode_route

    u64 = struct.Struct(">Q")

    def meta(k, v, seen):
        if k == b"format":
            int(v.decode("ascii"))
        elif k == b"next_msg_id":
            seen["next_msg_id"] = u64.unpack(v)[0]
        elif k.startswith(b"delivered-to:"):   # a queue's delivery watermark (store/marks.py)
            u64.unpack(v)

    def exchanges(k, v, seen):
        d = json.loads(v)
        if d["name"] != k.decode() or not isinstance(d["type"], str):
            raise ValueError("name or type does not match its key")

    def queues(k, v, seen):
        rec = QueueRecord(**json.loads(v))
        if rec.name != k.decode():
            raise ValueError(f"record names {rec.name!r}")
        seen.setdefault("queue_ids", set()).add(rec.queue_id)

    def seqs(k, v, seen):
        if len(k) != 4 or len(v) != 8:
            raise ValueError(f"key of {len(k)} / value of {len(v)} bytes")

    def bindings(k, v, seen):
        exchange, key, queue = json.loads(k)
        if not isinstance(json.loads(v), dict):
            raise ValueError("arguments are not an object")

    def subscriptions(k, v, seen):
        subscription_from_json(json.loads(v))

    def messages(k, v, seen):
        (mid,) = u64.unpack(k)
        Message(bytes(v))   # what recovery does: the section scan and the header
        seen.setdefault("message_ids", set()).add(mid)

    def entries(k, v, seen):
        queue_id, pos = ENTRY_KEY.unpack(k)
        if queue_id == 0:   # the topic log (store/topiclog.py)
            msg_id = decode_record(pos, v).msg_id
        else:
            msg_id = ENTRY_VAL.unpack_from(v)[0]
            if len(v) > ENTRY_VAL.size:
                bytes(v[ENTRY_VAL.size:]).decode("utf-8")
        seen.setdefault("entry_refs", []).append((queue_id, msg_id))

    def routes(k, v, seen):
        if len(k) != 4:
            raise ValueError(f"key of {len(k)} bytes")
        decode_route(v)

    def cursors(k, v, seen):
        if len(k) != 4:
            raise ValueError(f"key of {len(k)} bytes")
        decode_cursor(v)

    def dedup(k, v, seen):
        address, sep, _ = bytes(k).partition(b"\x00")
        address.decode("utf-8")
        if not sep or len(v) != 8:
            raise ValueError("not an address/id key with a 64-bit value")

    def readers(k, v, seen):
        if not isinstance(json.loads(v), dict):
            raise ValueError("not a reader claim")

    return {"meta": meta, "exchanges": exchanges, "queues": queues, "seqs": seqs, "bindings": bindings,
            "subscriptions": subscriptions, "messages": messages, "entries": entries, "dedup": dedup,
            "readers": readers, "routes": routes, "cursors": cursors}


# ---------------------------------------------------------------------- the walk


def walk(store_dir: Path, full: bool = False) -> Report:
    """Visit every record of every named database (this process may die of SIGBUS
    on a damaged store: run it through verify_in_child)."""
    import lmdb

    report = Report()
    try:
        env = lmdb.open(str(store_dir), readonly=True, lock=False, create=False, max_dbs=64,
                        readahead=False, subdir=True)
    except lmdb.Error as exc:
        report.problem(f"LMDB cannot open the store: {exc}")
        return report
    decode = _decoders() if full else {}
    seen: dict[str, Any] = {}
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        for raw in names:
            name = raw.decode("utf-8", "replace")
            if name not in DBS:
                report.notes.append(f"database {name!r} is not one this broker uses")
            _walk_db(env, raw, name, decode.get(name), seen, report)
        for name in DBS:
            if name.encode() not in names:
                report.counts.setdefault(name, 0)
        if full:
            _cross_check(seen, report)
    except lmdb.Error as exc:
        report.problem(f"LMDB cannot read the list of databases: {exc}")
    finally:
        env.close()
    return report


def _walk_db(env: Any, raw: bytes, name: str, decode: Callable | None, seen: dict, report: Report) -> None:
    import lmdb

    n = bad = 0
    try:
        db = env.open_db(raw, create=False)
        with env.begin(db=db, buffers=True) as txn:
            for k, v in txn.cursor().iternext():
                n += 1
                if len(v):
                    v[0], v[-1]   # both ends of the value are inside the file
                if decode is not None:
                    try:
                        decode(bytes(k), bytes(v), seen)
                    except Exception as exc:   # noqa: BLE001 - any failure is the record's
                        bad += 1
                        if bad <= MAX_PROBLEMS:
                            report.problem(f"database {name}: record {bytes(k)[:40]!r} cannot be "
                                           f"decoded: {type(exc).__name__}: {exc}")
    except lmdb.Error as exc:
        report.problem(f"database {name}: LMDB error after {n} record(s): {type(exc).__name__}: {exc}")
    if bad > MAX_PROBLEMS:
        report.problem(f"database {name}: {bad - MAX_PROBLEMS} more record(s) cannot be decoded")
    report.counts[name] = n


def _cross_check(seen: dict, report: Report) -> None:
    """Entries point at messages (a missing one fails its delivery); a message no
    entry points at is space never freed."""
    messages = seen.get("message_ids", set())
    queue_ids = seen.get("queue_ids", set())
    refs = seen.get("entry_refs", [])
    missing = [(q, m) for q, m in refs if m not in messages]
    if missing:
        report.problem(f"database entries: {len(missing)} entr{'y refers' if len(missing) == 1 else 'ies refer'} "
                       f"to missing messages, e.g. queue {missing[0][0]} message {missing[0][1]}")
    strays = {q for q, _ in refs if q not in queue_ids and q != 0}   # (0: the topic log)
    if strays:
        report.notes.append(f"entries of {len(strays)} queue id(s) no queue record has (ignored at start-up)")
    orphans = len(messages - {m for _, m in refs})
    if orphans:
        report.notes.append(f"{orphans} message(s) no entry refers to (space not reclaimed)")
    top = max(messages, default=0)
    next_id = seen.get("next_msg_id")
    if next_id is not None and top >= next_id:
        report.problem(f"database meta: next_msg_id {next_id} is not above the highest stored message id {top}")


# ---------------------------------------------------------------------- parent side


def verify_in_child(store_dir: Path, full: bool = False, timeout: float | None = None) -> Report:
    """Run the walk in a child process; a death by signal is a damaged store."""
    root = str(Path(__file__).resolve().parents[2])   # where this amqpbroker package lives
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "amqpbroker.store.verify", str(store_dir)] + (["--full"] if full else [])
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Report(False, problems=[f"reading the store did not finish within {timeout:.0f} s"])
    if p.returncode < 0:
        try:
            name = signal.Signals(-p.returncode).name
        except ValueError:
            name = f"signal {-p.returncode}"
        return Report(False, problems=[f"reading the store killed the checking process with {name}: "
                                       "pages of data.mdb are damaged (they point outside the file)"])
    lines = p.stdout.decode(errors="replace").strip().splitlines()
    try:
        return Report.from_json(lines[-1])
    except (IndexError, ValueError, KeyError):
        tail = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return Report(False, problems=[f"the store check failed (exit {p.returncode}): {tail[0]}"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m amqpbroker.store.verify STORE_DIR [--full]", file=sys.stderr)
        return 2
    report = walk(Path(args[0]), full="--full" in args[1:])
    sys.stdout.write(report.to_json() + "\n")
    sys.stdout.flush()
    return 0 if report.ok else 2


if __name__ == "__main__":
    sys.exit(main())
