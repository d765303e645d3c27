"""Read a Go CPU profile (pprof's profile.proto, gzipped) without Go's tools.

p2pd serves one at /debug/pprof/profile?seconds=N when started with -pprof. `top` gives
the functions with the most samples of their own (self) and on the stack (inclusive), as
shares of all samples: what `go tool pprof -top` prints, for a machine with no Go.
"""

from __future__ import annotations

import gzip
from collections import Counter


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message; value: int or bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not in profile.proto")
        yield number, wire, value


def _ints(wire: int, value) -> list[int]:
    """A repeated integer field: packed (bytes) or one value."""
    if wire == 0:
        return [value]
    out, i = [], 0
    while i < len(value):
        v, i = _varint(value, i)
        out.append(v)
    return out


def top(profile: bytes, n: int = 12) -> dict:
    """The profile's samples by function: {"samples", "self": [(name, share)], "inclusive"}."""
    data = gzip.decompress(profile) if profile[:2] == b"\x1f\x8b" else profile
    strings: list[str] = []
    samples: list[tuple[list[int], int]] = []
    locations: dict[int, list[int]] = {}  # location id -> function ids, innermost first
    functions: dict[int, int] = {}  # function id -> name's string index
    for number, _, value in _fields(data):
        if number == 6:
            strings.append(value.decode("utf-8", "replace"))
        elif number == 2:  # Sample: location_id (1), value (2)
            locs, values = [], []
            for f, w, v in _fields(value):
                if f == 1:
                    locs += _ints(w, v)
                elif f == 2:
                    values += _ints(w, v)
            samples.append((locs, values[0] if values else 1))
        elif number == 4:  # Location: id (1), line (4) {function_id (1)}
            loc_id, funcs = 0, []
            for f, _, v in _fields(value):
                if f == 1:
                    loc_id = v
                elif f == 4:
                    funcs += [fv for ff, _, fv in _fields(v) if ff == 1]
            locations[loc_id] = funcs
        elif number == 5:  # Function: id (1), name (2)
            fields = {f: v for f, _, v in _fields(value)}
            functions[fields.get(1, 0)] = fields.get(2, 0)
    name = lambda fid: strings[functions[fid]] if fid in functions else "?"  # noqa: E731
    own, inclusive = Counter(), Counter()
    total = 0
    for locs, count in samples:
        total += count
        stack = [name(fid) for loc in locs for fid in locations.get(loc, [])]
        if stack:
            own[stack[0]] += count
        for fn in set(stack):
            inclusive[fn] += count
    share = lambda c: [(fn, round(v / max(total, 1), 3)) for fn, v in c.most_common(n)]  # noqa: E731
    return {"samples": total, "self": share(own), "inclusive": share(inclusive)}
