"""A TCP relay the fault tests control: the links of an HA pair (replication,
each broker's ZooKeeper session) go through one, so a test can cut and heal them.

    relay = Relay(lambda: ("127.0.0.1", port)).start()   # clients connect to relay.port
    relay.cut("partition")   # bytes are held both ways (a partition: TCP retransmits, nothing arrives)
    relay.cut("reset")       # every connection reset, new ones refused (a peer that went away)
    relay.heal()             # forward again: held bytes are delivered, as TCP would after the partition
    relay.drop()             # every connection reset now; new ones are relayed as before
    relay.hold_after(48)     # new connections: the target's first 48 bytes pass, the rest waits for heal()

The target is asked for each new connection (a broker's replication port is known
only once it listens).  The relay runs its own asyncio loop in a daemon thread;
every method is safe to call from any thread.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Callable

FORWARD, PARTITION, RESET = "forward", "partition", "reset"
HELD_MAX = 256 << 20     # a partition holding more than this resets the connection instead


class _Pipe:
    """One relayed connection: client <-> target."""

    def __init__(self, relay: "Relay", client: socket.socket):
        self.relay = relay
        self.client = client
        self.target: socket.socket | None = None
        self.held: dict[str, bytearray] = {"up": bytearray(), "down": bytearray()}
        self.passed_down = 0
        self.hold_down_after = relay.hold_down_after
        self.writers: dict[str, asyncio.StreamWriter] = {}
        self.closed = False

    def blocked(self, direction: str) -> bool:
        if self.relay.mode == PARTITION:
            return True
        return direction == "down" and self.hold_down_after is not None and self.passed_down >= self.hold_down_after

    async def pump(self, reader: asyncio.StreamReader, direction: str) -> None:
        out = self.writers["down" if direction == "down" else "up"]
        try:
            while not self.closed:
                data = await reader.read(65536)
                if not data:
                    break
                if direction == "down" and self.hold_down_after is not None and not self.blocked("down"):
                    room = self.hold_down_after - self.passed_down
                    first, data = data[:room], data[room:]
                    self.passed_down += len(first)
                    out.write(first)
                if data and (self.blocked(direction) or self.held[direction]):
                    self.held[direction] += data
                    if len(self.held[direction]) > HELD_MAX:
                        break
                elif data:
                    if direction == "down":
                        self.passed_down += len(data)
                    out.write(data)
                await out.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        self.close()

    def release(self) -> None:
        """Deliver what was held (heal)."""
        self.hold_down_after = None
        for direction in ("up", "down"):
            data, self.held[direction] = bytes(self.held[direction]), bytearray()
            if data and not self.closed:
                self.writers[direction].write(data)

    def close(self, reset: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for w in self.writers.values():
            if reset:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    except OSError:
                        pass
                w.transport.abort()
            else:
                w.close()
        self.relay._pipes.discard(self)
        self.relay.ended += 1


class Relay:
    def __init__(self, target: Callable[[], tuple[str, int] | None], name: str = "relay"):
        self.target = target
        self.name = name
        self.mode = FORWARD
        self.hold_down_after: int | None = None
        self.port = 0
        self.connections = 0            # accepted so far (tests count reconnects with it)
        self.ended = 0                  # relayed connections closed or reset since (by either end or a cut)
        self._pipes: set[_Pipe] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)

    # ---- control (any thread)
    def start(self) -> "Relay":
        self._thread.start()
        self._call(self._start())
        return self

    def cut(self, how: str = PARTITION) -> None:
        self._call(self._cut(how))

    def heal(self) -> None:
        self._call(self._heal())

    def drop(self) -> None:
        """Reset every connection now; new ones are relayed as before."""
        self._call(self._drop())

    def hold_after(self, nbytes: int | None) -> None:
        """Connections made from now on: after `nbytes` from the target, hold the rest."""
        self.hold_down_after = nbytes

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # ---- loop side
    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self, how: str) -> None:
        self.mode = how
        if how == RESET:
            for pipe in list(self._pipes):
                pipe.close(reset=True)

    async def _drop(self) -> None:
        for pipe in list(self._pipes):
            pipe.close(reset=True)

    async def _heal(self) -> None:
        self.mode = FORWARD
        self.hold_down_after = None
        for pipe in list(self._pipes):
            pipe.release()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.close(reset=True)

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        target = self.target()
        if self.mode == RESET or target is None:
            sock = c_writer.get_extra_info("socket")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            c_writer.transport.abort()
            return
        pipe = _Pipe(self, c_writer.get_extra_info("socket"))
        try:
            t_reader, t_writer = await asyncio.open_connection(*target)
        except OSError:
            c_writer.transport.abort()
            return
        pipe.writers = {"up": t_writer, "down": c_writer}
        self._pipes.add(pipe)
        await asyncio.gather(pipe.pump(c_reader, "up"), pipe.pump(t_reader, "down"))
