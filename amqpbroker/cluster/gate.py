"""The start gate of `serve --workers N`: no node serves a client before every node
has recovered its store and moved what the slot map took from it (cluster/moves.py).

A directory the supervisor makes fresh for each of its starts (`DATA_DIR/start-gate`),
holding empty files: `recovered-<node>` (its store is open and checked),
`ready-<node>` (its misplaced subscriptions are on their topics' nodes), and `open`
(made by the supervisor once every node is ready: the client listeners may open).
Files, not pipes: a worker the supervisor starts again later finds the gate as it is.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

POLL = 0.05   # seconds between a waiting worker's looks


class StartGate:
    def __init__(self, path: Path | str):
        self.path = Path(path)

    def reset(self) -> "StartGate":
        """The supervisor's: a fresh, closed gate."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        return self

    def mark(self, node: str, state: str) -> None:
        (self.path / f"{state}-{node}").touch()

    def has(self, node: str, state: str) -> bool:
        return (self.path / f"{state}-{node}").exists()

    def open(self) -> None:
        (self.path / "open").touch()

    def is_open(self) -> bool:
        return (self.path / "open").exists()

    async def wait_open(self, stopped: asyncio.Event) -> bool:
        """True once the gate is open; False if a stop came first."""
        while not self.is_open():
            if stopped.is_set():
                return False
            await asyncio.sleep(POLL)
        return True
