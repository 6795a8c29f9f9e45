"""Fixtures of the store tests: an asyncio loop, and LmdbStores opened on it."""

from __future__ import annotations

import asyncio

import pytest

from amqpbroker.store.lmdb_store import LmdbStore
from tests.store.helpers import close


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def opened(tmp_path, loop):
    """open(path=..., **kw) → an open LmdbStore; all closed after the test."""
    stores: list[LmdbStore] = []

    def open_store(path=None, **kw):
        store = LmdbStore(path or tmp_path / "store", **kw)
        store.open(loop)
        stores.append(store)
        return store

    yield open_store
    for store in stores:
        close(loop, store)
