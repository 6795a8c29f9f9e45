"""Small pieces every forwarding room uses on raw proton deliveries (cffi pointers):
delivery tags, copying an outcome from one delivery to another, the null terminus."""

from __future__ import annotations

import struct
from typing import Any

from cproton import ffi, lib
from proton import Terminus

ACCEPTED = lib.PN_ACCEPTED
REJECTED = lib.PN_REJECTED
RELEASED = lib.PN_RELEASED
MODIFIED = lib.PN_MODIFIED
_OUTCOMES = (ACCEPTED, REJECTED, RELEASED, MODIFIED)
_pack_tag = struct.Struct(">Q").pack_into


class Tags:
    """Delivery tags from a counter, written into one buffer (pn_delivery copies it)."""

    __slots__ = ("n", "buf", "tag")

    def __init__(self) -> None:
        self.n = 0
        self.buf = bytearray(8)
        self.tag = ffi.new("pn_delivery_tag_t*", (8, ffi.from_buffer(self.buf)))

    def next(self) -> Any:
        self.n += 1
        _pack_tag(self.buf, 0, self.n)
        return self.tag[0]


def copy_outcome(src: Any, dst: Any) -> int:
    """Give delivery `dst` the state its peer set on `src` (raw pn_delivery_t*s):
    the outcome with its fields (rejected's error, modified's flags and annotations,
    a non-terminal state's data such as transactional-state).  Returns the state."""
    state = lib.pn_delivery_remote_state(src)
    if state == 0:
        return 0
    if state != ACCEPTED:
        remote = lib.pn_delivery_remote(src)
        local = lib.pn_delivery_local(dst)
        if state == MODIFIED:
            lib.pn_disposition_set_failed(local, lib.pn_disposition_is_failed(remote))
            lib.pn_disposition_set_undeliverable(local, lib.pn_disposition_is_undeliverable(remote))
            lib.pn_data_copy(lib.pn_disposition_annotations(local), lib.pn_disposition_annotations(remote))
        elif state == REJECTED:
            _copy_condition(lib.pn_disposition_condition(remote), lib.pn_disposition_condition(local))
        elif state not in _OUTCOMES:
            lib.pn_data_copy(lib.pn_disposition_data(local), lib.pn_disposition_data(remote))
    lib.pn_delivery_update(dst, state)
    return state


def _copy_condition(src: Any, dst: Any) -> None:
    if not lib.pn_condition_is_set(src):
        return
    lib.pn_condition_set_name(dst, lib.pn_condition_get_name(src))
    desc = lib.pn_condition_get_description(src)
    if desc != ffi.NULL:
        lib.pn_condition_set_description(dst, desc)
    lib.pn_data_copy(lib.pn_condition_info(dst), lib.pn_condition_info(src))


def is_null(terminus: Terminus) -> bool:
    """A null terminus in an attach reply: the refusal shape (AMQP 1.0 §2.6.3)."""
    return terminus.type == Terminus.UNSPECIFIED
