"""One broker per store: an exclusive lock on `broker.lock` in the store directory.

LMDB itself lets any number of processes open one environment (that is how the
broker and its writer process share it), so two brokers started on one data dir
both run, each with its own idea of the next message id and of what is in each
queue, and overwrite each other's records.  The lock is taken before LMDB opens
the store and held for the broker's lifetime; the holder's PID is written into
the file so that the one refused can name it.

flock(2), not lockf/fcntl locks: an flock belongs to the open file description,
so it is released only when every descriptor for it is closed, and closing some
other descriptor for the same file (LMDB opens its own) does not drop it.  The
store's writer process gets the descriptor (pass_fds), which is on purpose: a
writer still finishing a commit after its broker was killed holds the store
until it has exited too, so the next broker never reads the store while a
writer of the previous one may still write to it.  It dies with its broker
(PR_SET_PDEATHSIG, or at the end of its input), so the lock never outlives both;
a new broker that finds the lock held by a PID that is gone waits for that
writer to finish.  The kernel drops the lock of a killed process: nothing stale
is left behind by `kill -9`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from ..core.numbers import ascii_int
from .base import StoreError

LOCK_FILE = "broker.lock"
DEAD_HOLDER_WAIT = 10.0    # seconds: the writer of a dead broker finishing its commit


class StoreLocked(StoreError):
    """Another process holds the store (another broker, or a store command)."""


def holder_pid(path: Path) -> int | None:
    """The PID written in a lock file (None: none or unreadable)."""
    try:
        text = Path(path).read_text().split()
    except OSError:
        return None
    return ascii_int(text[0]) if text else None


def pid_alive(pid: int) -> bool:
    """Running: not gone, and not a zombie nobody has reaped yet (a killed broker
    whose parent has not waited for it is no holder)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # someone else's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True   # no /proc: kill() said it exists


class StoreLock:
    def __init__(self, directory: Path, name: str = LOCK_FILE):
        self.path = Path(directory) / name
        self.fd: int | None = None

    def acquire(self, dead_holder_wait: float = DEAD_HOLDER_WAIT, what: str = "broker") -> None:
        """Take the lock or raise StoreLocked naming the holder.  A holder whose PID is
        gone is the writer process of a killed broker, exiting: wait for it."""
        if self.fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        started = time.monotonic()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise StoreLocked(f"cannot lock {self.path}: {exc}") from exc
                pid = holder_pid(self.path)
                waited = time.monotonic() - started
                if pid is not None and not pid_alive(pid) and waited < dead_holder_wait:
                    time.sleep(0.05)   # its writer process is exiting
                    continue
                if pid is None:
                    if waited < min(1.0, dead_holder_wait):
                        time.sleep(0.05)   # locked a moment ago, PID not written yet
                        continue
                    who = "another process"
                elif pid_alive(pid):
                    who = f"process {pid}"
                else:
                    who = f"the exiting store writer of process {pid}, which is gone"
                raise StoreLocked(f"store at {self.path.parent} is in use by {who} (lock file {self.path}): "
                                  f"only one {what} may use a data directory at a time")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)   # no PID of a process that no longer holds it
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> "StoreLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
