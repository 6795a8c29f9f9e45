"""Which stores a data dir holds, by the way `serve` lays them out: one broker (alone,
an HA pair's broker, a `[cluster]` node) keeps `DATA_DIR/store`; `serve --workers N`
keeps one per node, `DATA_DIR/node-K/store`.  A mode never opens the other's, so a
data dir started in one mode after the other would hide every message of the stores
it does not open: cli.py and cluster/workers.py refuse that at start instead
(docs/cluster.md, "Another N on the same data dir").  Files are only looked at here,
never opened.
"""

from __future__ import annotations

from pathlib import Path

from ..core.numbers import ascii_int
from .integrity import DATA_FILE


def single_store(data_dir: Path) -> Path | None:
    """The one broker's store in `data_dir`, if there is one."""
    path = Path(data_dir) / "store"
    return path if (path / DATA_FILE).exists() else None


def worker_stores(data_dir: Path) -> list[int]:
    """K of each `node-K/store` in `data_dir` holding a store, ascending."""
    found = []
    for path in Path(data_dir).glob("node-*"):
        index = ascii_int(path.name[len("node-"):])
        if index is not None and (path / "store" / DATA_FILE).exists():
            found.append(index)
    return sorted(found)
