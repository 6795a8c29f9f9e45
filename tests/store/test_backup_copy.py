"""A hot backup of a running broker's store (store/tool.py `backup`) whose map the
writer grows during the copy: LMDB fails the copy's read with MDB_MAP_RESIZED
(seen in the e2e backup-under-load test once commits grew the map faster), and the
backup starts again on a reopened environment instead of failing."""

from __future__ import annotations

import io

import lmdb
import pytest
from proton import Message

from amqpbroker.store import tool
from tests.store.helpers import commit, put


class _Resizing:
    """Environments whose first `resizes` copies fail as when the map grew under them."""

    def __init__(self, env, copies: list, resizes: int):
        self._env, self._copies, self._resizes = env, copies, resizes

    def copy(self, *args, **kw):
        self._copies.append(args[0])
        if len(self._copies) <= self._resizes:
            with open(f"{args[0]}/data.mdb", "wb") as f:
                f.write(b"partial")     # what a copy cut short leaves behind
            raise lmdb.MapResizedError("mdb_env_copy3: MDB_MAP_RESIZED (injected)")
        return self._env.copy(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


@pytest.mark.parametrize("resizes, ok", [(1, True), (tool.COPY_ATTEMPTS - 1, True), (tool.COPY_ATTEMPTS, False)])
def test_a_copy_cut_short_by_a_grown_map_starts_again(opened, loop, tmp_path, monkeypatch, resizes, ok):
    store = opened()
    for seq in range(1, 51):
        put(store, 1, seq, Message(body=f"m{seq}", durable=True).encode())
    assert commit(loop, store) is None
    store.close()   # (py-lmdb opens an environment once per process: the copy reads a closed store)
    real_open = lmdb.open
    copies: list = []

    def open_env(*args, **kw):
        return _Resizing(real_open(*args, **kw), copies, resizes)

    monkeypatch.setattr(lmdb, "open", open_env)
    out = io.StringIO()
    dest = tmp_path / "backup"
    status = tool.backup(store.path, dest, out=out)
    if ok:
        assert status == 0, out.getvalue()
        assert len(copies) == resizes + 1, "a copy per attempt"
        assert "checking the copy" in out.getvalue()
        copy = real_open(str(dest), readonly=True, max_dbs=64, lock=False)
        try:
            assert copy.stat()["psize"] > 0
        finally:
            copy.close()
    else:
        assert status == 2
        assert len(copies) == tool.COPY_ATTEMPTS
        assert not (dest / "data.mdb").exists(), "no partial copy left behind"
