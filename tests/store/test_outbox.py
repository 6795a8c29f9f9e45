"""The broker's frames to its writer process (store/outbox.py) over a real pipe,
and the writer's side of the framing (store/writer.py): bounded buffers."""

from __future__ import annotations

import fcntl
import os

import pytest

from amqpbroker.store.faults import Faults
from amqpbroker.store.outbox import Outbox
from amqpbroker.store.writer import frame, has_frame, take_frames


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(w, False)
    fcntl.fcntl(w, 1031, 65536)   # F_SETPIPE_SZ: a known, small pipe
    yield r, w
    os.close(r)
    os.close(w)


def drain(r: int) -> bytes:
    os.set_blocking(r, False)
    out = b""
    while True:
        try:
            chunk = os.read(r, 1 << 20)
        except BlockingIOError:
            return out
        out += chunk


def test_frames_go_out_whole_and_in_order_across_a_full_pipe(pipe):
    r, w = pipe
    box = Outbox(limit=1 << 20)
    frames = [frame(("batch", n, b"x" * 30_000)) for n in range(5)]   # 150 kB > the 64 kB pipe
    for n, f in enumerate(frames):
        box.push(n, f)
    assert box.write(w) is False and box.mid_frame, "the pipe took part of a frame"
    got = drain(r)
    while not box.write(w):
        got += drain(r)
    got += drain(r)
    assert got == b"".join(frames)
    assert box.nbytes == 0 and len(box) == 0 and not box.mid_frame


def test_room_and_the_frames_nothing_of_which_was_written(pipe):
    r, w = pipe
    box = Outbox(limit=100_000)
    for n in range(3):
        box.push(n, b"y" * 40_000)
    assert not box.has_room() and box.peak == 120_000
    box.write(w)                       # 64 kB: frame 0 whole, part of frame 1
    assert box.mid_frame
    assert box.take_unwritten() == [2], "a frame partly in the pipe stays"
    assert box.nbytes == 120_000 - 65536 - 40_000
    box.clear()
    assert box.nbytes == 0 and not box.mid_frame


def test_an_injected_pipe_error_writes_nothing(pipe):
    r, w = pipe
    box = Outbox(faults=Faults.parse("pipe-write:ENOSPC@1*1"))
    box.push(0, b"a" * 10)
    assert box.write(w) is True
    box.push(1, b"b" * 10)
    with pytest.raises(OSError, match="No space left"):
        box.write(w)
    assert drain(r) == b"a" * 10 and box.take_unwritten() == [1]


def test_the_writer_takes_frames_up_to_a_size():
    buf = bytearray()
    for n in range(10):
        buf += frame(("batch", n, b"z" * 1000))
    size = len(frame(("batch", 0, b"z" * 1000)))
    first = take_frames(buf, 3 * size)
    assert [m[1] for m in first] == [0, 1, 2]
    assert [m[1] for m in take_frames(buf, 1)] == [3], "at least one frame"
    assert has_frame(buf) and [m[1] for m in take_frames(buf)] == list(range(4, 10))
    assert not has_frame(buf) and buf == bytearray()
    buf += frame(("stop",))[:-1]
    assert not has_frame(buf) and take_frames(buf) == [], "a partial frame waits for its rest"
