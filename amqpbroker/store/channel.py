"""The way from LmdbStore to its writer process and back: hand-over, framing, the
pipe, commit results, callbacks in order, writer loss, and the store's health.

A mixin of LmdbStore (store/lmdb_store.py), which owns the state it uses (created
in LmdbStore.__init__) and starts writer processes (`_start_writer`).

Nothing is reported committed that was not: callbacks run with None only for
batches up to the number in a commit result of the current writer.  A batch that
cannot be sealed, framed or written is failed (`Batch.fail`: its callbacks get
StoreFault, its new entries and messages become deletes, its removals still go to
the disk); its callbacks run once every batch before it is settled, so callbacks
keep their hand-over order.  A result stream that cannot be trusted, or part of a
frame in the pipe when a write fails, replaces the writer (`_lost`): the new one
replays every batch not reported committed.  Any such fault makes the store
`degraded` (durable messages refused at the door, one log line) until a batch
handed over after it commits; an empty probe batch tests the way while nothing
else is stored.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import time
from collections import deque
from typing import Any

import lmdb

from ..looptrace import TRACE
from . import writer as writer_proc
from .base import StoreError, StoreFault, StoreFull
from .batch import ENTRY_KEY, Batch
from .maps import give_back_memory

log = logging.getLogger("amqpbroker.store")

MAP_RELEASE_INTERVAL = 2.0   # seconds: the broker unmaps store pages its reads touched this often
MAX_RESTARTS, RESTART_WINDOW = 3, 60.0   # writers lost in that many seconds: wait before the next
RESTART_BACKOFF = (5.0, 60.0)  # first wait and ceiling (doubling) before a writer is tried again
RETRY_DELAY = 0.5            # seconds: after a failed pipe write, framing and writing pause this long
PROBE_INTERVAL = 1.0         # seconds: while degraded, an empty commit tests the way to the disk
IDLE_TRIM_BYTES = 32 << 20   # bytes framed since the last trim that make a burst worth trimming after
IDLE_TRIM_DELAY = 2.0        # seconds without a hand-over: the burst is over


class WriterChannel:
    """LmdbStore's side of the writer process protocol (store/writer.py)."""

    _writer: subprocess.Popen | None
    _faults: Any
    loop: Any

    def _handoff(self) -> None:
        """Loop callback (end of a turn): hand this turn's batch over."""
        try:
            self._hand_over()
        except Exception as exc:   # a loop callback must not raise ("Exception in callback")
            self._unexpected("handing a batch over", exc)
            if self._local.ops and not self._handoff_scheduled:   # not taken: again shortly
                self._handoff_scheduled = True
                self.loop.call_later(RETRY_DELAY, self._handoff)

    def _unexpected(self, what: str, exc: BaseException) -> None:
        """A failure no step above expected.  Memory and I/O errors are the fault
        itself (one line, via _degrade); anything else is a bug worth a traceback
        (once per episode)."""
        if not isinstance(exc, (MemoryError, OSError)) and self.degraded is None:
            log.error("store at %s: %s failed", self.path, what, exc_info=exc)
        self._degrade(f"{what} failed: {type(exc).__name__}: {exc}")

    def _on_writable(self) -> None:
        """Loop callback: the writer's pipe has room again."""
        try:
            self._pump()
        except Exception as exc:
            self._unexpected("writing to the store writer process", exc)

    def _hand_over(self) -> None:
        self._handoff_scheduled = False
        batch = self._local
        if not batch.ops:
            return
        self._local = Batch()
        number = self.batch
        self.batch += 1
        if TRACE is not None:
            TRACE.mark("handoff", batch.ops, number)
        try:
            if self._faults is not None:
                self._faults.check("seal")
            batch.seal()
        except Exception as exc:   # MemoryError above all: this batch is not stored
            self._fail(batch, "sealing a batch", exc)
        if self._writer is None and batch.error is None:
            self._fail(batch, "handing a batch over", StoreFault(f"the store writer process is down ({self.degraded})"))
        entry = (number, batch)
        self._inflight.append(entry)
        self._unsent.append(entry)
        self._waiting.append(entry)
        self._last_handoff = time.monotonic()
        if batch.error is not None:
            self._settle_ready()
        self._pump()
        if TRACE is not None:
            TRACE.mark("piped", len(self._outbox), number)

    def _fail(self, batch: Batch, what: str, exc: BaseException) -> None:
        error = exc if isinstance(exc, StoreFault) else StoreFault(f"{what} failed: {type(exc).__name__}: {exc}")
        try:
            batch.fail(error)
        except Exception:   # even that could not allocate
            batch.abandon(error)
        self._degrade(str(error))

    def _pump(self) -> None:
        """Frame handed-over batches while the outbox has room and write what the pipe
        takes; again when the pipe is writable.  Paused while a failed write waits."""
        if self._writer is None or "retry" in self._timers:
            return
        while True:
            self._frame_some()
            if self._write_out() is not True or not self._unsent:
                break
        if self._burst_bytes >= IDLE_TRIM_BYTES and "idle" not in self._timers:
            self._timers["idle"] = self.loop.call_later(IDLE_TRIM_DELAY, self._idle_check)

    def _frame_some(self) -> None:
        unsent, box = self._unsent, self._outbox
        while unsent and box.has_room():
            number, batch = unsent[0]
            try:
                if self._faults is not None:
                    self._faults.check("encode")
                data = writer_proc.frame(("batch", number, writer_proc.batch_fields(batch)))
            except Exception as exc:
                if batch.error is None:
                    self._fail(batch, "encoding a batch", exc)   # smaller now: framed again
                    self._settle_ready()
                    continue
                unsent.popleft()   # not even what is left of it: its removals are lost
                self._inflight = deque(e for e in self._inflight if e[0] != number)
                log.error("store at %s: batch %d dropped, it cannot be encoded: %s", self.path, number, exc)
                continue
            unsent.popleft()
            box.push(number, data)
            if self.replica is not None:   # HA: the same frame goes to the backup (amqpbroker/ha)
                self.replica.framed(number, data)
            self._burst_bytes += len(data)

    def _write_out(self) -> bool | None:
        """True: the outbox is empty; False: the pipe is full; None: failed."""
        fd = self._writer.stdin.fileno()
        try:
            done = self._outbox.write(fd)
        except (BrokenPipeError, ConnectionError) as exc:   # the writer is gone
            self._lost(exc)
            return None
        except Exception as exc:   # MemoryError, an OSError that is not the writer's end
            self._write_failed(exc)
            return None
        if done == self._writing:
            if done:
                self.loop.remove_writer(fd)
            else:
                self.loop.add_writer(fd, self._on_writable)
            self._writing = not done
        return done

    def _write_failed(self, exc: BaseException) -> None:
        """Frames the pipe did not take: their batches fail, what is left of them is
        framed again after RETRY_DELAY.  Part of a frame in the pipe cannot be taken
        back: then the writer is replaced and gets every uncommitted batch again."""
        box = self._outbox
        if box.mid_frame:
            self._lost(exc)
            return
        numbers = set(box.take_unwritten())
        requeue = [e for e in self._inflight if e[0] in numbers]
        for _, batch in requeue:
            if batch.error is None:
                self._fail(batch, "writing to the store writer process", exc)
        self._degrade(f"writing to the store writer process failed: {type(exc).__name__}: {exc}")
        self._unsent.extendleft(reversed(requeue))
        if self._writing:
            self.loop.remove_writer(self._writer.stdin.fileno())
            self._writing = False
        self._timers["retry"] = self.loop.call_later(RETRY_DELAY, self._retry)
        self._settle_ready()

    def _retry(self) -> None:
        self._timers.pop("retry", None)
        self._on_writable()

    def _send_all(self, writer: subprocess.Popen, extra: bytes = b"") -> None:
        """Frame and write everything handed over, then `extra`, blocking (flush, close)."""
        fd = writer.stdin.fileno()
        if self._writing:
            try:
                self.loop.remove_writer(fd)
            except (ValueError, OSError, RuntimeError):
                pass
            self._writing = False
        timer = self._timers.pop("retry", None)
        if timer is not None:
            timer.cancel()
        os.set_blocking(fd, True)
        try:
            while self._unsent or len(self._outbox):
                self._frame_some()
                self._outbox.write(fd)
            if extra:
                self._outbox.push(-1, extra)
                self._outbox.write(fd)
        finally:
            os.set_blocking(fd, False)

    # ------------------------------------------------------------------ commit results

    def _on_results(self) -> None:
        """The writer reported commits (loop thread, via add_reader)."""
        if self._writer is None:
            return
        try:
            if self._faults is not None:
                self._faults.check("results")
            chunk = os.read(self._writer.stdout.fileno(), 65536)
            if chunk:
                self._results += chunk
                results = writer_proc.take_frames(self._results)
        except BlockingIOError:
            return
        except Exception as exc:   # OSError, MemoryError, a torn frame: which commits happened is unknown
            self._lost(exc)        # a new writer replays every batch not reported committed
            return
        if not chunk:
            self._lost(EOFError("the store writer process exited"))
            return
        try:
            for result in results:
                self._apply_result(result)
        except Exception as exc:   # which results were applied is unclear: replay the rest
            self._unexpected("applying commit results", exc)
            self._lost(exc)

    def _apply_result(self, result: tuple, defer: bool = False) -> None:
        number, kind, text, elapsed, ops, full, map_size = result
        if TRACE is not None:
            TRACE.mark("commit", int(elapsed * 1e6), number)
        error = None
        if kind == "full":
            error = StoreFull(text)
            # Probed like any failure: with nothing else to write (its producers are
            # refused at the door), no later commit would ever tell that there is
            # room again, and durable messages would stay refused for good.
            self._degrade(f"a commit found the store full: {text}")
        elif kind is not None:
            error = StoreFault(f"commit failed in the store writer process: {text}")
            self._degrade(str(error))
        self._map_full = full
        self.full = full or self.degraded is not None
        whole = self._committed(number, error, defer)   # first: nothing below may keep callbacks back
        if whole and self.degraded is not None and not full:   # still full: the probes go on
            self._recover()
        self.commits += 1
        self.last_batch_ops = ops
        self.commit_seconds_total += elapsed
        self.commit_stats.observe(elapsed, ops)
        if map_size > self.map_size:
            self.map_size = map_size
            try:
                with self._read_lock:   # no read transaction is open outside it
                    self.env.set_mapsize(0)   # adopt the size the writer grew the map to
            except lmdb.Error as exc:
                log.error("store at %s: cannot adopt the map size %d: %s", self.path, map_size, exc)
        now = time.monotonic()
        if now >= self._release_at:   # pages this process read (page-in) leave its RSS too
            self._release_at = now + MAP_RELEASE_INTERVAL
            self.release_map()

    def _committed(self, number: int, error: BaseException | None, defer: bool = False) -> bool:
        """The writer committed (or failed with `error`) every batch up to `number`.
        True when one of them was handed over whole after the store degraded: the
        way to the disk works again (a failed batch's leftovers prove nothing)."""
        inflight = self._inflight
        whole = False
        if error is None:   # their leftovers are on the disk now (first in this commit, if carried)
            self._carried = [e for e in self._carried if e[0] > number]
        while inflight and inflight[0][0] <= number:
            n, batch = inflight.popleft()
            whole = whole or (batch.error is None and n >= self._degraded_at)
            if error is not None:
                self._carry((n, batch), error)
        self.committed_upto = max(self.committed_upto, number)
        if self.replica is not None and error is None:   # HA: callbacks wait for the backup's commit too
            number = self.replica.gate(number)
        self._settle_ready(number, error, defer)
        return whole and error is None

    def _carry(self, entry: tuple[int, Batch], error: BaseException) -> None:
        """A batch the writer failed: what it must still write (its removals, its
        entity records) may now live in that writer's memory only, until its next
        commit (store/writer.py `carry`).  Kept here, as fail() leaves it, until a
        commit after it succeeds: a writer lost before that takes the carry with it,
        and the new one must get it first, or what the broker stores next under an
        entity made in that batch would be on disk without the entity's record."""
        batch = entry[1]
        if batch.error is None:
            try:
                batch.fail(error)
            except Exception:
                batch.abandon(error)
        self._carried.append(entry)

    def _replay(self) -> None:
        """A new writer: every batch not reported committed, after what failed
        commits must still write (`_carried`), in hand-over order."""
        self._unsent = deque(self._carried + list(self._inflight))

    def replica_committed(self) -> None:
        """HA: the backup acknowledged batches (or the live broker stopped waiting for
        it): run the callbacks both commits allow now."""
        if self.replica is not None:
            self._settle_ready(self.replica.gate(self.committed_upto))

    def detach_replica(self) -> None:
        """HA: commits stop waiting for a backup (closing, fenced)."""
        self.replica = None
        self._settle_ready(self.committed_upto)

    def _settle_ready(self, number: int = -1, error: BaseException | None = None, defer: bool = False) -> None:
        """Run the callbacks of settled batches in hand-over order: those up to `number`
        (told `error`), and failed ones (told their own error) once every batch
        before them is settled.  Deferred (flush): from the loop, as they would
        have run without it."""
        done: list[tuple[Batch, BaseException | None]] = []
        waiting = self._waiting
        while waiting:
            n, b = waiting[0]
            if b.error is not None:
                done.append((b, b.error))
            elif n <= number:
                done.append((b, error))
            else:
                break
            waiting.popleft()
        if not done:
            return
        if defer and not self.loop.is_closed():
            self.loop.call_soon(self._finish, done)
        else:
            self._finish(done)

    def _finish(self, done: list[tuple[Batch, BaseException | None]]) -> None:
        failed = [b for b, err in done if err is not None]
        if failed:
            self.failed_batches += len(failed)
            if self.on_lost_entries is not None:
                # Before the callbacks: the broker drops these entries from its queues
                # before producers are told their messages were rejected.
                try:
                    lost = [ENTRY_KEY.unpack(key) for b in failed for key in b.new_keys]
                    if lost:
                        self.on_lost_entries(lost)
                except Exception:
                    log.exception("store at %s: dropping entries that were not stored failed", self.path)
        for b, err in done:
            _run_callbacks(b.callbacks, err)

    # ------------------------------------------------------------------ writer loss, health

    def _lost(self, exc: BaseException) -> None:
        """The writer process died (killed, out of memory) or its result stream cannot
        be trusted.  A new one takes over and gets every batch not yet reported
        committed, in order: their writes are blind puts and deletes, so applying
        again what the dead one may have committed ends in the same state.  When
        writers keep dying, the store is degraded and a new one is tried later."""
        old, self._writer = self._writer, None
        if old is None:
            return
        for fd, remove in ((old.stdout.fileno(), self.loop.remove_reader),
                           (old.stdin.fileno(), self.loop.remove_writer)):
            try:
                remove(fd)
            except (ValueError, OSError, RuntimeError):
                pass
        self._writing = False
        for pipe in (old.stdin, old.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        old.kill()
        old.wait()
        self._outbox.clear()
        self._results = bytearray()
        timer = self._timers.pop("retry", None)
        if timer is not None:
            timer.cancel()
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW] + [now]
        if len(self._restarts) <= MAX_RESTARTS:
            try:
                self._start_writer()
            except Exception as start_error:
                exc = start_error
            else:
                log.error("store writer process lost (%s); a new one replays %d uncommitted batch(es)",
                          exc, len(self._inflight))
                self._replay()
                self._pump()
                return
        self._writer_down(exc)

    def _writer_down(self, exc: BaseException) -> None:
        delay, self._backoff = self._backoff, min(self._backoff * 2, RESTART_BACKOFF[1])
        log.error("store writer process lost (%s): durable messages are refused; a new writer in %.0f s",
                  exc, delay)
        self._degrade(f"the store writer process keeps failing: {exc}", quiet=True)
        error = StoreFault(f"the store writer process is gone: {exc}")
        for _, batch in self._inflight:   # their content waits for the next writer
            if batch.error is None:
                try:
                    batch.fail(error)
                except Exception:
                    batch.abandon(error)
        self._unsent.clear()
        self._timers["restart"] = self.loop.call_later(delay, self._restart_writer)
        self._settle_ready()

    def _restart_writer(self) -> None:
        self._timers.pop("restart", None)
        if self._writer is not None or self.env is None:
            return
        try:
            self._start_writer()
        except Exception as exc:
            try:
                self._writer_down(exc)
            except Exception as again:
                self._unexpected("starting a store writer process", again)
            return
        log.warning("store at %s: a new store writer process started (%d batch(es) to write)",
                    self.path, len(self._inflight))
        self._replay()
        self._pump()

    def _degrade(self, reason: str, quiet: bool = False) -> None:
        """Durable acceptance pauses (`full`) until a batch handed over from now on is
        committed.  One log line per episode, not one per failed batch."""
        if self.degraded is not None:
            return
        self.degraded = reason
        self.full = True
        self.degraded_since = time.time()
        self._degraded_at = self.batch
        self._episode_failed = self.failed_batches
        if not quiet:
            log.error("store at %s degraded: %s; durable messages are refused until it recovers",
                      self.path, reason)
        self._schedule_probe()

    def _recover(self) -> None:
        log.warning("store at %s recovered after %.1f s (%d batch(es) failed meanwhile): durable messages "
                    "are accepted again", self.path, time.time() - (self.degraded_since or time.time()),
                    self.failed_batches - self._episode_failed)
        self.degraded = self.degraded_since = None
        self.full = self._map_full
        self._backoff = RESTART_BACKOFF[0]

    def _schedule_probe(self) -> None:
        if "probe" not in self._timers and self.loop is not None and not self.loop.is_closed():
            self._timers["probe"] = self.loop.call_later(PROBE_INTERVAL, self._probe)

    def _probe(self) -> None:
        """Every PROBE_INTERVAL while degraded: push on what waits to be written, or,
        when nothing is on its way, an empty batch that tests the way to the disk;
        a commit of either ends the episode (_apply_result)."""
        self._timers.pop("probe", None)
        if self.degraded is None:
            return
        self._schedule_probe()
        if self._writer is None or "retry" in self._timers:
            return   # a restart or a retry is due: it pushes on itself
        try:
            if self._unsent or len(self._outbox):
                self._pump()
            elif not self._waiting:
                self.after_commit(lambda err: None)
        except Exception as exc:
            self._unexpected("probing the store", exc)

    def _idle_check(self) -> None:
        """After a burst: once no batch was handed over for IDLE_TRIM_DELAY, give the
        memory it freed back to the kernel (store/maps.py; the writer process does the
        same on its side).  Once per burst, never while the store is busy."""
        self._timers.pop("idle", None)
        quiet = time.monotonic() - self._last_handoff
        if quiet < IDLE_TRIM_DELAY:
            self._timers["idle"] = self.loop.call_later(IDLE_TRIM_DELAY - quiet, self._idle_check)
            return
        self._burst_bytes = 0
        try:
            _, seconds = give_back_memory()
        except Exception as exc:   # nothing to give back then
            log.debug("store at %s: giving memory back failed: %s", self.path, exc)
            return
        log.debug("store at %s idle after a burst: heap trimmed in %.3f s", self.path, seconds)

    def _flush_with(self, writer: subprocess.Popen, timeout: float = 30.0) -> None:
        self._handoff()
        if not self._waiting or self._writer is not writer:
            return
        target = self._waiting[-1][0]
        self._send_all(writer)
        fd = writer.stdout.fileno()
        deadline = time.monotonic() + timeout
        while self._waiting and self._waiting[0][0] <= target and self._writer is writer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise StoreError("store flush timed out")
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self._lost(EOFError("the store writer process exited"))
                return
            self._results += chunk
            for result in writer_proc.take_frames(self._results):
                self._apply_result(result, defer=True)


def _run_callbacks(callbacks: list, error: BaseException | None) -> None:
    failures = 0
    for cb in callbacks:
        try:
            cb(error)
        except Exception:  # one bad callback must not starve the others
            failures += 1
            if failures == 1:
                log.exception("store callback failed")
    if failures > 1:   # one traceback, not one per callback (they fail alike under memory pressure)
        log.error("store callbacks failed: %d of %d", failures, len(callbacks))
