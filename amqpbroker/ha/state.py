"""What a broker of a pair keeps beside its store: its node id, whether its store is
a complete copy, and which live broker's run of batches it follows up to which
batch (`ha.json` in the data dir); and the activation sequence its store holds (the
meta db's `ha-activation`, written through the store's batches so that it travels
to the backup with everything else).

The position is written only after the store committed that far (a backup's
writer reports it), so it never claims more than the store holds: a backup that
comes back is sent from the batch after it (core/ha.py catch_up_plan), and a few
batches it already has are applied again, harmlessly."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

ACTIVATION_KEY = b"ha-activation"
STATE_FILE = "ha.json"


@dataclass
class NodeState:
    path: Path
    node_id: str
    complete: bool = True   # False from before a backup attaches until the live broker says "in sync"
    lineage: str | None = None   # the live run whose batches the store holds, up to `position`
    position: int = -1

    @classmethod
    def load(cls, data_dir: Path, node_id: str | None) -> "NodeState":
        path = Path(data_dir) / STATE_FILE
        saved: dict = {}
        if path.exists():
            saved = json.loads(path.read_text())
        state = cls(path, node_id or saved.get("node_id") or uuid.uuid4().hex[:12],
                    bool(saved.get("complete", True)), saved.get("lineage"), int(saved.get("position", -1)))
        state.save()
        return state

    def set_complete(self, complete: bool) -> None:
        if complete != self.complete:
            self.complete = complete
            self.save()

    def set_position(self, lineage: str | None, position: int) -> None:
        if (lineage, position) != (self.lineage, self.position):
            self.lineage, self.position = lineage, position
            self.save()

    def save(self) -> None:
        """Written whole and synced: a torn file must not make an unfinished copy complete."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"node_id": self.node_id, "complete": self.complete, "lineage": self.lineage,
                       "position": self.position}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def stored_activation(store_dir: Path) -> int:
    """The activation sequence in a store (0: none, or no store).  Opened read-only for
    the moment of reading: call it only while this process has no other handle on it."""
    import lmdb
    if not (Path(store_dir) / "data.mdb").exists():
        return 0
    env = lmdb.open(str(store_dir), readonly=True, max_dbs=16, lock=True, readahead=False)
    try:
        try:
            db = env.open_db(b"meta", create=False)
        except lmdb.NotFoundError:
            return 0
        with env.begin() as txn:
            raw = txn.get(ACTIVATION_KEY, db=db)
        return int(raw) if raw else 0
    finally:
        env.close()
