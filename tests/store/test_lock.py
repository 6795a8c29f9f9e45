"""One broker per store (store/lock.py): the lock names its holder, dies with it,
and lasts while a writer process of a killed broker still runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from amqpbroker.store.lmdb_store import LmdbStore
from amqpbroker.store.lock import LOCK_FILE, StoreLock, StoreLocked, holder_pid, pid_alive


def spawn_holder(directory, *, grandchild: bool = False) -> subprocess.Popen:
    """A process that takes the lock and says "locked" (with `grandchild`: hands the
    descriptor to a child, as the broker does to its writer, and exits without
    releasing it; the child then prints its PID and waits for its stdin to close)."""
    code = textwrap.dedent(f"""
        import os, subprocess, sys
        from amqpbroker.store.lock import StoreLock
        lock = StoreLock({str(directory)!r})
        lock.acquire()
        if {grandchild!r}:
            child = subprocess.Popen([sys.executable, "-c",
                                      "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()"],
                                     pass_fds=(lock.fd,), stdin=0)
            os._exit(0)
        print("locked", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    return proc


def test_a_second_lock_on_the_store_names_the_holder(tmp_path):
    first = StoreLock(tmp_path)
    first.acquire()
    assert holder_pid(tmp_path / LOCK_FILE) == os.getpid()
    with pytest.raises(StoreLocked, match=rf"is in use by process {os.getpid()} \(lock file .*broker.lock\)"):
        StoreLock(tmp_path).acquire(dead_holder_wait=0)
    first.release()
    again = StoreLock(tmp_path)
    again.acquire()
    again.release()


def test_the_lock_of_a_killed_process_is_gone_at_once(tmp_path):
    holder = spawn_holder(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLocked, match=f"in use by process {holder.pid} "):
            StoreLock(tmp_path).acquire(dead_holder_wait=0)
    finally:
        holder.kill()
        holder.wait()
    lock = StoreLock(tmp_path)
    lock.acquire(dead_holder_wait=0)   # no stale lock after kill -9
    assert holder_pid(tmp_path / LOCK_FILE) == os.getpid()
    lock.release()


def test_a_child_that_inherited_the_lock_holds_it_until_it_exits(tmp_path):
    """The broker's writer process gets the descriptor: a broker killed while its
    writer still commits keeps the store locked until the writer is gone too, and
    the next broker waits for that instead of failing."""
    parent = spawn_holder(tmp_path, grandchild=True)
    child_pid = int(parent.stdout.readline())
    parent.wait()
    assert holder_pid(tmp_path / LOCK_FILE) == parent.pid    # the PID written is the dead parent's
    with pytest.raises(StoreLocked, match=f"exiting store writer of process {parent.pid}, which is gone"):
        StoreLock(tmp_path).acquire(dead_holder_wait=0)
    parent.stdin.close()     # the child reads the same stdin: it ends now
    lock = StoreLock(tmp_path)
    lock.acquire(dead_holder_wait=20)    # waits for the child, not for the timeout
    lock.release()
    assert not pid_alive(child_pid)


def open_files(pid: int) -> list[str]:
    """What a process's descriptors name (one it closes between the listing and the
    look, as the writer does with its journal at a checkpoint, is passed over)."""
    names = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            names.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return names


def test_an_open_store_is_locked_and_its_writer_holds_the_lock_too(tmp_path):
    loop = asyncio.new_event_loop()
    store = LmdbStore(tmp_path / "store")
    try:
        store.open(loop)
        with pytest.raises(StoreLocked, match=f"in use by process {os.getpid()}"):
            LmdbStore(tmp_path / "store").open(loop)
        lock_path = str((tmp_path / "store" / LOCK_FILE).resolve())
        writer_fds = open_files(store._writer.pid)
        assert lock_path in writer_fds
        store.close()
        again = LmdbStore(tmp_path / "store")
        again.open(loop)     # released at close
        again.close()
    finally:
        if store._writer is not None:
            store.close()
        loop.close()
