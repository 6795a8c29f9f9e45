"""server/reload.py's reading: the file read once, validated whole, read again a
moment later; a file that changed meanwhile (being written) is not taken."""

from __future__ import annotations

import asyncio

import pytest

from amqpbroker.security.reload import ReloadError
from amqpbroker.server.reload import ConfigReloader

FULL = """
[users.alice]
password = "a"
[[acl]]
user = "alice"
permissions = ["all"]
"""


def reader(path, during_settle=None) -> ConfigReloader:
    async def sleep(seconds: float) -> None:
        if during_settle is not None:
            path.write_text(during_settle)
    return ConfigReloader(None, path, {}, sleep=sleep)   # reading needs no server


def test_a_settled_file_is_read_validated_and_taken(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(FULL)
    new, users, policy = asyncio.run(reader(path).read_settled())
    assert list(new.users) == ["alice"] and users.has_account("alice") and policy.enabled


def test_a_file_that_changes_between_the_two_reads_is_not_taken(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(FULL[:FULL.index("[[acl]]")])     # the first part of a copy in progress
    with pytest.raises(ReloadError, match="changed while it was read"):
        asyncio.run(reader(path, during_settle=FULL).read_settled())


def test_what_is_validated_is_what_was_read(tmp_path):
    """The bytes read first are the ones parsed: a bad first read is refused even if
    the file is good by the time of the second."""
    path = tmp_path / "b.toml"
    path.write_text('[[acl]]\nuser = "alice"\n')        # a rule cut before its permissions
    with pytest.raises(ReloadError, match="acl.0.permissions"):
        asyncio.run(reader(path, during_settle=FULL).read_settled())


def test_a_config_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    """The file replaced by a FIFO (or a device): reading it waited for a writer on
    the broker's loop, and the whole broker stopped (no connection, no API answer)
    until one came.  It is refused at once, and reading happens off the loop."""
    import os
    path = tmp_path / "b.toml"
    os.mkfifo(path)

    async def reload_alongside_the_loop() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)
        tick = asyncio.ensure_future(ticker())
        try:
            with pytest.raises(ReloadError, match="not a regular file"):
                await asyncio.wait_for(reader(path).read_settled(), 5)
        finally:
            tick.cancel()
        return ticks
    assert asyncio.run(reload_alongside_the_loop()) >= 1
