"""AMQP 1.0 type system codec (AMQP 1.0 Part 1 §1.6), pure Python.

The broker moves messages as the raw bytes the producer sent and only decodes the
sections a decision needs (header for durability/priority/TTL, properties for
routing, application-properties for selectors).  This module gives:

* `decode(buf, offset)` → (value, next offset) for every primitive and compound type,
  with AMQP-typed results from proton's type classes (ulong, symbol, timestamp …) so
  values keep their AMQP type when re-encoded;
* `skip(buf, offset)` → next offset, without building objects (section scanning);
* `encode(value)` for the types the broker writes itself (headers, annotations).
"""

from __future__ import annotations

import struct
import uuid
from typing import Any, Callable

from proton import (
    Array,
    Described,
    byte,
    char,
    decimal32,
    decimal64,
    decimal128,
    float32,
    int32,
    short,
    symbol,
    timestamp,
    ubyte,
    uint,
    ulong,
    ushort,
)


class DecodeError(ValueError):
    """The bytes are not valid AMQP encoded data."""


class TextError(DecodeError):
    """Well-formed encoding whose text does not decode (invalid UTF-8, a symbol that
    is not ASCII, a char beyond U+10FFFF): the structure is sound, so a reader may
    answer for the one field (a link refused) rather than the whole frame."""


# Nesting of lists, maps, arrays and described values a decode goes through at most:
# deeper data is refused (DecodeError) instead of exhausting Python's stack.  No AMQP
# message or performative a client sends comes near it.
MAX_DEPTH = 64
# Zero-width elements an array may declare beyond its byte count (see _array).
ZERO_WIDTH_ALLOWANCE = 64
_depth = 0   # current nesting (decoding runs on one thread at a time: the event loop)


_u8 = struct.Struct(">B").unpack_from
_u16 = struct.Struct(">H").unpack_from
_u32 = struct.Struct(">I").unpack_from
_u64 = struct.Struct(">Q").unpack_from
_i8 = struct.Struct(">b").unpack_from
_i16 = struct.Struct(">h").unpack_from
_i32 = struct.Struct(">i").unpack_from
_i64 = struct.Struct(">q").unpack_from
_f32 = struct.Struct(">f").unpack_from
_f64 = struct.Struct(">d").unpack_from
_2u8 = struct.Struct(">BB").unpack_from
_2u32 = struct.Struct(">II").unpack_from

# Width of the fixed part following a constructor (AMQP 1.0 §1.6 "subcategories"):
# 0x4X empty, 0x5X one byte, 0x6X two, 0x7X four, 0x8X eight, 0x9X sixteen;
# 0xAX/0xCX/0xEX have a one-byte size, 0xBX/0xDX/0xFX a four-byte size.
_FIXED = {0x4: 0, 0x5: 1, 0x6: 2, 0x7: 4, 0x8: 8, 0x9: 16}


def skip(buf: bytes, off: int) -> int:
    """Offset just past the encoded value starting at `off` (iterative: a chain of
    described values cannot exhaust the stack)."""
    values = 1   # values still to step over: a described one is a descriptor and a value
    try:
        while values:
            code = buf[off]
            off += 1
            if code == 0x00:
                values += 1
                continue
            sub = code >> 4
            width = _FIXED.get(sub)
            if width is not None:
                off += width
            elif sub in (0xA, 0xC, 0xE):
                off += 1 + buf[off]
            elif sub in (0xB, 0xD, 0xF):
                off += 4 + _u32(buf, off)[0]
            else:
                raise DecodeError(f"invalid constructor 0x{code:02x} at offset {off - 1}")
            values -= 1
    except (IndexError, struct.error) as exc:
        raise DecodeError(f"truncated value at offset {off}") from exc
    if off > len(buf):
        raise DecodeError(f"truncated value at offset {off}")
    return off


def decode(buf: bytes, off: int = 0) -> tuple[Any, int]:
    """Decode one value at `off`; return it and the offset just past it.  Whatever is
    wrong with the bytes (truncation, invalid UTF-8, a symbol that is not ASCII, a
    char beyond U+10FFFF, nesting deeper than MAX_DEPTH, counts the bytes cannot
    hold) is a DecodeError: nothing else escapes."""
    try:
        code = buf[off]
        reader = _READERS.get(code)
        if reader is None:
            raise DecodeError(f"invalid constructor 0x{code:02x} at offset {off}")
        return reader(buf, off + 1)
    except DecodeError:
        raise
    except (IndexError, struct.error) as exc:
        raise DecodeError(f"truncated value at offset {off}") from exc
    except UnicodeDecodeError as exc:
        raise TextError(f"invalid {exc.encoding} text at offset {off}") from exc
    except (ValueError, OverflowError, TypeError) as exc:
        raise DecodeError(f"invalid value at offset {off}: {exc}") from exc


def _const(value: Any) -> Callable[[bytes, int], tuple[Any, int]]:
    return lambda buf, off: (value, off)


def _fixed(unpack: Callable, width: int, wrap: Callable | None = None):
    if wrap is None:
        return lambda buf, off: (unpack(buf, off)[0], off + width)
    return lambda buf, off: (wrap(unpack(buf, off)[0]), off + width)


def _bytes(wrap: Callable | None, wide: bool):
    def read(buf: bytes, off: int) -> tuple[Any, int]:
        if wide:
            n = _u32(buf, off)[0]
            off += 4
        else:
            n = buf[off]
            off += 1
        end = off + n
        if end > len(buf):
            raise DecodeError(f"truncated value at offset {off}")
        raw = bytes(buf[off:end])
        return (wrap(raw) if wrap else raw), end

    return read


def _str(raw: bytes) -> str:
    return raw.decode("utf-8")


def _sym(raw: bytes) -> symbol:
    return symbol(raw.decode("ascii"))


def _sized_head(buf: bytes, off: int, wide: bool) -> tuple[int, int, int]:
    """A list, map or array's (count, offset of its first element, end): size and
    count are four bytes each when wide, one byte otherwise (the size counts
    the count field too)."""
    if wide:
        size, count = _2u32(buf, off)
        first, end = off + 8, off + 4 + size
    else:
        size, count = _2u8(buf, off)
        first, end = off + 2, off + 1 + size
    # A size beyond the bytes present is a truncated value, refused before the count
    # is believed (an array of zero-width elements would otherwise be as long as the
    # size claims: 16M nulls from ten bytes).
    if end > len(buf):
        raise DecodeError(f"compound value of {size} bytes at offset {off} runs past the end ({len(buf)})")
    return count, first, end


def _nested(read: Callable[[bytes, int], tuple[Any, int]]) -> Callable[[bytes, int], tuple[Any, int]]:
    """Count a compound reader's nesting: deeper than MAX_DEPTH is a DecodeError."""
    def nested(buf: bytes, off: int) -> tuple[Any, int]:
        global _depth
        if _depth >= MAX_DEPTH:
            raise DecodeError(f"values nested deeper than {MAX_DEPTH} at offset {off}")
        _depth += 1
        try:
            return read(buf, off)
        finally:
            _depth -= 1

    return nested


# Values a bounded decode (`decode_bounded`) may still produce; None: no bound.
_values_left: int | None = None


def decode_bounded(buf: bytes, off: int, max_values: int) -> tuple[Any, int]:
    """`decode`, refusing (DecodeError) a value whose lists, maps and arrays hold
    more than `max_values` elements in all: decoding costs about a microsecond a
    value, and a section the broker decodes on its loop must not cost seconds."""
    global _values_left
    _values_left = max_values
    try:
        return decode(buf, off)
    finally:
        _values_left = None


def _spend(count: int, off: int) -> None:
    global _values_left
    if _values_left is not None:
        _values_left -= count
        if _values_left < 0:
            raise DecodeError(f"more values than a bounded decode takes at offset {off}")


def _compound(wide: bool, as_map: bool):
    @_nested
    def read(buf: bytes, off: int) -> tuple[Any, int]:
        count, off, end = _sized_head(buf, off, wide)
        if _values_left is not None:
            _spend(count, off)
        if count > end - off:   # every element takes a byte at least
            raise DecodeError(f"{count} elements cannot fit in {end - off} bytes at offset {off}")
        items = []
        for _ in range(count):
            value, off = decode(buf, off)
            items.append(value)
        if off != end:
            raise DecodeError(f"compound size mismatch at offset {off}")
        if as_map:
            if count % 2:
                raise DecodeError("map with an odd number of elements")
            it = iter(items)
            try:
                return dict(zip(it, it)), end
            except TypeError as exc:
                # AMQP allows any key, but no map the broker reads (annotations,
                # application-properties, fields) has a list, map or described key.
                raise DecodeError(f"map key of an unsupported type at offset {off}: {exc}") from exc
        return items, end

    return read


def _array(wide: bool):
    @_nested
    def read(buf: bytes, off: int) -> tuple[Any, int]:
        count, off, end = _sized_head(buf, off, wide)
        if _values_left is not None:
            _spend(count, off)
        descriptor = None
        if buf[off] == 0x00:
            descriptor, off = decode(buf, off + 1)
        code = buf[off]
        reader = _READERS.get(code)
        if reader is None:
            raise DecodeError(f"invalid array element constructor 0x{code:02x}")
        off += 1
        # Elements of a zero-width constructor (null, true, false, 0) take no bytes:
        # a few bytes could declare billions of them (amplification), and arrays of
        # such arrays multiply.  No more elements than the array has bytes (plus a
        # small allowance for zero-width ones), so a decode costs at most a few
        # values per byte of input, however it nests.
        room = max(end - off, 0)
        if count > room and (count > room + ZERO_WIDTH_ALLOWANCE or _FIXED.get(code >> 4) != 0):
            raise DecodeError(f"array of {count} elements in {end - off} bytes at offset {off}")
        items = []
        for _ in range(count):
            value, off = reader(buf, off)
            items.append(value)
        if off != end:
            raise DecodeError(f"array size mismatch at offset {off}")
        return items if descriptor is None else Described(descriptor, items), end

    return read


@_nested
def _described(buf: bytes, off: int) -> tuple[Any, int]:
    descriptor, off = decode(buf, off)
    value, off = decode(buf, off)
    return Described(descriptor, value), off


def _exactly(buf: bytes, off: int, n: int) -> bytes:
    """`n` bytes at `off`: a DecodeError when the buffer ends before them."""
    if off + n > len(buf):
        raise DecodeError(f"truncated value at offset {off}")
    return bytes(buf[off:off + n])


def _char(point: int) -> char:
    if point > 0x10FFFF:
        raise TextError(f"char U+{point:X} is beyond U+10FFFF")
    return char(chr(point))


def _uuid(buf: bytes, off: int) -> tuple[uuid.UUID, int]:
    return uuid.UUID(bytes=_exactly(buf, off, 16)), off + 16


_READERS: dict[int, Callable[[bytes, int], tuple[Any, int]]] = {
    0x00: _described,
    0x40: _const(None),
    0x41: _const(True),
    0x42: _const(False),
    0x56: lambda buf, off: (buf[off] != 0, off + 1),
    0x50: _fixed(_u8, 1, ubyte),
    0x60: _fixed(_u16, 2, ushort),
    0x70: _fixed(_u32, 4, uint),
    0x52: _fixed(_u8, 1, uint),
    0x43: _const(uint(0)),
    0x80: _fixed(_u64, 8, ulong),
    0x53: _fixed(_u8, 1, ulong),
    0x44: _const(ulong(0)),
    0x51: _fixed(_i8, 1, byte),
    0x61: _fixed(_i16, 2, short),
    0x71: _fixed(_i32, 4, int32),
    0x54: _fixed(_i8, 1, int32),
    0x81: _fixed(_i64, 8),
    0x55: _fixed(_i8, 1),
    0x72: _fixed(_f32, 4, float32),
    0x82: _fixed(_f64, 8),
    0x74: lambda buf, off: (decimal32(_u32(buf, off)[0]), off + 4),
    0x84: lambda buf, off: (decimal64(_u64(buf, off)[0]), off + 8),
    0x94: lambda buf, off: (decimal128(_exactly(buf, off, 16)), off + 16),
    0x73: lambda buf, off: (_char(_u32(buf, off)[0]), off + 4),
    0x83: _fixed(_i64, 8, timestamp),
    0x98: _uuid,
    0xA0: _bytes(None, False),
    0xB0: _bytes(None, True),
    0xA1: _bytes(_str, False),
    0xB1: _bytes(_str, True),
    0xA3: _bytes(_sym, False),
    0xB3: _bytes(_sym, True),
    0x45: _const([]),
    0xC0: _compound(False, False),
    0xD0: _compound(True, False),
    0xC1: _compound(False, True),
    0xD1: _compound(True, True),
    0xE0: _array(False),
    0xF0: _array(True),
}
# A fresh empty list per decode, not one shared mutable object.
_READERS[0x45] = lambda buf, off: ([], off)


# --------------------------------------------------------------------------- encoding

_p8 = struct.Struct(">B").pack
_p32 = struct.Struct(">I").pack
_pq = struct.Struct(">q").pack
_pQ = struct.Struct(">Q").pack


def encode(value: Any) -> bytes:
    """Encode a value with the smallest AMQP constructor for its type."""
    enc = _ENCODERS.get(type(value))
    if enc is not None:
        return enc(value)
    for base, enc in _BASE_ENCODERS:
        if isinstance(value, base):
            return enc(value)
    raise TypeError(f"cannot encode {type(value).__name__} as AMQP")


def _enc_var(small: int, large: int, raw: bytes) -> bytes:
    if len(raw) < 256:
        return bytes((small, len(raw))) + raw
    return bytes((large,)) + _p32(len(raw)) + raw


def _enc_items(small: int, large: int, empty: bytes | None, items: list) -> bytes:
    if not items and empty is not None:
        return empty
    body = b"".join(encode(i) for i in items)
    if len(body) + 1 < 256 and len(items) < 256:
        return bytes((small, len(body) + 1, len(items))) + body
    return bytes((large,)) + _p32(len(body) + 4) + _p32(len(items)) + body


def _enc_uint_like(v: int, zero: int | None, small: int | None, wide: int, fmt: str) -> bytes:
    if v == 0 and zero is not None:
        return bytes((zero,))
    if small is not None and v < 256:
        return bytes((small, v))
    return bytes((wide,)) + struct.pack(fmt, v)


def _enc_long(v: int) -> bytes:
    if -128 <= v <= 127:
        return bytes((0x55,)) + struct.pack(">b", v)
    return b"\x81" + _pq(v)


def _enc_described(d: Described) -> bytes:
    return b"\x00" + encode(d.descriptor) + encode(d.value)


def _enc_array(a: Array) -> bytes:
    # Arrays are rare on the broker's write path (capabilities are sent by proton);
    # encode symbol/string arrays only.
    elems = list(a.elements)
    if all(isinstance(e, symbol) for e in elems):
        raws = [e.encode("ascii") for e in elems]
        code = 0xB3
    else:
        raws = [str(e).encode("utf-8") for e in elems]
        code = 0xB1
    body = bytes((code,)) + b"".join(_p32(len(r)) + r for r in raws)
    return b"\xf0" + _p32(len(body) + 4) + _p32(len(elems)) + body


_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    type(None): lambda v: b"\x40",
    bool: lambda v: b"\x41" if v else b"\x42",
    ubyte: lambda v: bytes((0x50, v)),
    ushort: lambda v: b"\x60" + struct.pack(">H", v),
    uint: lambda v: _enc_uint_like(v, 0x43, 0x52, 0x70, ">I"),
    ulong: lambda v: _enc_uint_like(v, 0x44, 0x53, 0x80, ">Q"),
    byte: lambda v: b"\x51" + struct.pack(">b", v),
    short: lambda v: b"\x61" + struct.pack(">h", v),
    int32: lambda v: (b"\x54" + struct.pack(">b", v)) if -128 <= v <= 127 else b"\x71" + struct.pack(">i", v),
    int: _enc_long,
    float32: lambda v: b"\x72" + struct.pack(">f", v),
    float: lambda v: b"\x82" + struct.pack(">d", v),
    char: lambda v: b"\x73" + _p32(ord(v)),
    timestamp: lambda v: b"\x83" + _pq(v),
    uuid.UUID: lambda v: b"\x98" + v.bytes,
    bytes: lambda v: _enc_var(0xA0, 0xB0, v),
    memoryview: lambda v: _enc_var(0xA0, 0xB0, bytes(v)),
    str: lambda v: _enc_var(0xA1, 0xB1, v.encode("utf-8")),
    symbol: lambda v: _enc_var(0xA3, 0xB3, v.encode("ascii")),
    list: lambda v: _enc_items(0xC0, 0xD0, b"\x45", v),
    tuple: lambda v: _enc_items(0xC0, 0xD0, b"\x45", list(v)),
    dict: lambda v: _enc_items(0xC1, 0xD1, None, [x for kv in v.items() for x in kv]),
    Described: _enc_described,
    Array: _enc_array,
    decimal32: lambda v: b"\x74" + _p32(v),
    decimal64: lambda v: b"\x84" + _pQ(v),
    decimal128: lambda v: b"\x94" + bytes(v),
}
_BASE_ENCODERS: list[tuple[type, Callable[[Any], bytes]]] = [
    (bool, _ENCODERS[bool]),
    (symbol, _ENCODERS[symbol]),
    (str, _ENCODERS[str]),
    (int, _enc_long),
    (float, _ENCODERS[float]),
    (bytes, _ENCODERS[bytes]),
    (dict, _ENCODERS[dict]),
    (list, _ENCODERS[list]),
]
