"""`amqpbroker store check | backup | restore`: the operator's tools for a store.

check    (broker stopped) the checks of start-up (store/integrity.py) and the full
         walk of store/verify.py, in a child process; a summary; exit 0 whole, 2 not
backup   (broker running or not) a compacted copy made by LMDB in one read
         transaction (a consistent snapshot), then checked
restore  (broker stopped) a checked copy put in place of a data dir's store;
         a store already there is kept aside, and only with --force

Every path may be a broker data dir (its store is DIR/store) or a store directory
itself (the one holding data.mdb, as a backup is).  Output goes to stdout, errors
to stderr, one line each.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

from .integrity import DATA_FILE, MARKER, StoreDamaged, preflight, sync_dir, write_marker
from .lock import StoreLock, StoreLocked
from .verify import Report, verify_in_child

MB = 1 << 20


def store_dir_of(path: Path) -> Path:
    """A store directory (holds data.mdb) or a broker data dir (DIR/store)."""
    path = Path(path)
    if (path / DATA_FILE).exists() or (path / MARKER).exists():
        return path
    return path / "store"


def _err(text: str) -> None:
    print(f"amqpbroker store: {text}", file=sys.stderr)


def _lock(store_dir: Path, command: str) -> StoreLock | None:
    """The broker's lock (a running broker must not be checked or replaced under
    it); None when it cannot be created (a read-only copy: nothing runs on it)."""
    lock = StoreLock(store_dir)
    try:
        lock.acquire(dead_holder_wait=2.0, what="broker or store command")
    except StoreLocked as exc:
        raise StoreLocked(f"{exc}; stop the broker before `amqpbroker store {command}`") from None
    except OSError:
        return None
    return lock


def apply_journal(store_dir: Path, out: TextIO) -> str | None:
    """Batches a broker left in the store's journal without a clean stop (a crash:
    store/journal.py) applied, as a broker's start would, before the store is looked
    at or copied.  Only with the store's lock held (no broker on it).  A problem, or None."""
    import lmdb

    from .journal import JournalError
    from .writer import recover
    try:
        applied = recover(store_dir)
    except (OSError, lmdb.Error, JournalError, StoreDamaged) as exc:
        return f"the store's journal could not be applied: {exc}"
    if applied:
        print(f"applied {applied} batch(es) left in the store's journal (as a broker's start does)", file=out)
    return None


def examine(store_dir: Path, out: TextIO) -> Report:
    """Start-up checks and the full walk; the summary printed to `out`."""
    data = store_dir / DATA_FILE
    try:
        found = preflight(store_dir)
    except StoreDamaged as exc:
        return Report(False, problems=[str(exc)])
    if not found.exists:
        return Report(True, notes=[f"no store in {store_dir} ({DATA_FILE} absent or empty, no {MARKER}): "
                                   "a broker starts an empty one there"])
    m = found.meta
    print(f"store {store_dir}: {DATA_FILE} {data.stat().st_size / MB:,.1f} MB, page size {m.page_size}, "
          f"{m.last_page + 1} pages used, map size {m.map_size / MB:,.0f} MB, last transaction {m.txnid}",
          file=out)
    return verify_in_child(store_dir, full=True)


def print_report(report: Report, out: TextIO) -> None:
    for name, count in sorted(report.counts.items()):
        print(f"  {name:<14} {count:>12,} record(s)", file=out)
    for note in report.notes:
        print(f"  note: {note}", file=out)
    for problem in report.problems:
        print(f"  PROBLEM: {problem}", file=out)
    if report.ok:
        print("result: whole", file=out)
    else:
        print(f"result: NOT WHOLE ({len(report.problems)} problem(s)); see docs/operations.md, "
              "\"Store safety and recovery\"", file=out)


def check(path: Path, out: TextIO = sys.stdout) -> int:
    store_dir = store_dir_of(path)
    if not store_dir.is_dir():
        _err(f"no store directory at {store_dir}")
        return 2
    try:
        lock = _lock(store_dir, "check")
    except StoreLocked as exc:
        _err(str(exc))
        return 2
    try:
        problem = apply_journal(store_dir, out)
        report = examine(store_dir, out) if problem is None else Report(False, problems=[problem])
    finally:
        if lock is not None:
            lock.release()
    print_report(report, out)
    return 0 if report.ok else 2


COPY_ATTEMPTS = 5   # a hot backup starts again when the broker grows the store's map under it


def backup(path: Path, dest: Path, compact: bool = True, out: TextIO = sys.stdout) -> int:
    """A copy of the store (running broker or not) into the new directory `dest`."""
    import lmdb

    store_dir = store_dir_of(path)
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        _err(f"{dest} exists and is not empty")
        return 2
    lock = StoreLock(store_dir)   # no broker on it: what a crash left in the journal first
    try:
        lock.acquire(dead_holder_wait=0.0, what="store command")
    except (StoreLocked, OSError):
        lock = None                   # a running broker: its store is whole in memory
    if lock is not None:
        try:
            problem = apply_journal(store_dir, out)
        finally:
            lock.release()
        if problem is not None:
            _err(f"store at {store_dir} not copied: {problem}")
            return 2
    try:
        preflight(store_dir)   # a truncated file would kill this process (SIGBUS) while copying
    except StoreDamaged as exc:
        _err(f"store at {store_dir} is damaged, not copied: {exc}")
        return 2
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        _err(f"cannot create {dest}: {exc}")
        return 2
    started = time.monotonic()
    for attempt in range(COPY_ATTEMPTS):
        try:
            env = lmdb.open(str(store_dir), readonly=True, create=False, max_dbs=64, readahead=False)
            try:
                env.copy(str(dest), compact=compact)
            finally:
                env.close()
            break
        except lmdb.MapResizedError as exc:
            # The running broker's writer grew the map while this read (LMDB: a reader
            # adopts the new size by opening again); the partial copy is dropped.
            (dest / DATA_FILE).unlink(missing_ok=True)
            if attempt + 1 == COPY_ATTEMPTS:
                _err(f"copying {store_dir} failed: the store kept growing under the copy: {exc}")
                return 2
        except lmdb.Error as exc:
            _err(f"copying {store_dir} failed: {exc}")
            return 2
    print(f"copied {store_dir} to {dest} in {time.monotonic() - started:.1f} s "
          f"({(dest / DATA_FILE).stat().st_size / MB:,.1f} MB); checking the copy", file=out)
    report = verify_in_child(dest, full=True)
    print_report(report, out)
    return 0 if report.ok else 2


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def restore(src: Path, path: Path, force: bool = False, out: TextIO = sys.stdout) -> int:
    """Put the store copy `src` in place of the store of data dir `path`."""
    src_dir = store_dir_of(src)
    if not (src_dir / DATA_FILE).is_file():
        _err(f"no {DATA_FILE} in {src_dir}")
        return 2
    print(f"checking the copy {src_dir}", file=out)
    report = examine(src_dir, out)
    if not report.ok:
        print_report(report, out)
        _err(f"{src_dir} is not whole: not restored")
        return 2
    target = store_dir_of(path)
    if _same_dir(src_dir, target):
        _err(f"{src_dir} is the store it would replace: nothing to restore (give the backup's directory)")
        return 2
    target.mkdir(parents=True, exist_ok=True)
    try:
        lock = _lock(target, "restore")
    except StoreLocked as exc:
        _err(str(exc))
        return 2
    if lock is None:
        _err(f"cannot lock {target}")
        return 2
    try:
        current = target / DATA_FILE
        replacing = current.exists() and current.stat().st_size > 0
        if replacing and not force:
            _err(f"{target} already holds a store ({current.stat().st_size / MB:,.1f} MB): "
                 "not replaced without --force")
            return 2
        # The copy first, whole and synced; only then the store there is put aside:
        # a copy that fails leaves the data dir as it was.
        tmp = target / f"{DATA_FILE}.restoring"
        shutil.copyfile(src_dir / DATA_FILE, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if replacing:
            aside = target / f"{DATA_FILE}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            os.link(current, aside)      # kept, and `current` stays in place until replaced
            print(f"the store that was there is kept as {aside}", file=out)
        os.replace(tmp, current)
        try:
            os.unlink(target / "lock.mdb")   # the reader table of the store replaced: LMDB makes a new one
        except FileNotFoundError:
            pass
        try:
            os.unlink(target / MARKER)
        except FileNotFoundError:
            pass
        sync_dir(target)
        found = preflight(target)
        write_marker(target, found.meta.page_size if found.meta else 4096)
    except (OSError, StoreDamaged) as exc:
        _err(f"restoring into {target} failed: {exc}")
        return 2
    finally:
        lock.release()
    print(f"restored {src_dir} into {target}", file=out)
    return 0


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="amqpbroker store", description="check, copy and restore a store")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="check a stopped broker's store; exit 0 whole, 2 not")
    c.add_argument("--data-dir", type=Path, default=Path("data"), help="broker data dir or store dir")
    b = sub.add_parser("backup", help="copy the store (the broker may run) into a new directory")
    b.add_argument("dest", type=Path)
    b.add_argument("--data-dir", type=Path, default=Path("data"))
    b.add_argument("--no-compact", action="store_true", help="copy free pages too (faster)")
    r = sub.add_parser("restore", help="put a checked copy in place of a stopped broker's store")
    r.add_argument("src", type=Path, help="a backup (directory holding data.mdb) or a data dir")
    r.add_argument("--data-dir", type=Path, default=Path("data"))
    r.add_argument("--force", action="store_true", help="replace a store that is there (kept aside)")
    args = p.parse_args(argv)
    if args.command == "check":
        return check(args.data_dir)
    if args.command == "backup":
        return backup(args.data_dir, args.dest, compact=not args.no_compact)
    return restore(args.src, args.data_dir, force=args.force)
