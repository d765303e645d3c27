"""Fuzz inputs and properties shared by tests/test_fuzz.py (hypothesis, ~200 inputs per
target) and bench/bench_fuzz.py (>= 1,000,000 inputs in all).

Targets: the five wire decoders of protocol/ (decode_update, UPDATE_ROWS.decode_rows,
decode_digests, decode_digest_request, UPDATE_ROWS.decode_fetch_request), RunConfig.from_json, the
TOML settings loader (core/flags.py, for the run commands and for `seedflood peer`) and
the identity key file loader (network/transport/identity.py).

A property gets one input and returns "accepted" or "rejected". It raises `Violation`
when the target accepted what it must refuse ("wrong_accept"), refused what it must
accept ("wrong_reject"), or refused with something other than one readable line
("bad_error"). Any other exception escaping a property is a traceback of the target.

The decoders are compared against independent references written here from the
protocol's statement (plain `msgpack.unpackb` and `struct`'s float16), so both a wrong
accept and a wrong reject are caught. The loaders have no second implementation: an
accepted manifest or settings file must satisfy every documented bound, and a manifest
must survive `to_json` / `from_json` unchanged.

Inputs are drawn from a `random.Random`: random bytes or text, random msgpack / JSON /
TOML structures full of edge values (bools, 64.0, NaN, infinities, 2^64 - 1, 10^400,
nesting past the recursion limit), valid inputs, and valid inputs mutated at the
structure level (a field replaced, dropped or added) or at the byte level (bit flips,
insertions, deletions, truncation, splices).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import random
import stat
import struct
from pathlib import Path

import msgpack

from seedflood_p2p.core.config import (
    INT_RANGES,
    MAX_EXTRA_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_ROUND,
    RunConfig,
)
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import (
    RUN_FIELDS,
    check_unknown,
    parse_toml,
    settings_values,
)
from seedflood_p2p.protocol.framing import (
    DROP_REASONS,
    MAX_PEER_ID_BYTES,
    MAX_SCALARS,
    PROTOCOL_VERSION,
    Rejected,
    run_tag,
)
from seedflood_p2p.protocol.message import UpdateMessage, pack_scalars
from seedflood_p2p.protocol.repair import (
    BUCKET_ROUNDS,
    FETCH_LIMIT,
    UPDATE_ROWS,
    decode_digest_request,
    decode_digests,
)
from seedflood_p2p.protocol.update import MAX_UPDATE_BYTES, decode_update

RUN = RunConfig(salt="fuzz").run_id
decode_rows = UPDATE_ROWS.decode_rows  # the update kind of the one row codec


def decode_fetch_request(data: bytes):
    """The update kind's fetch request, flattened: (run, round, peer, max_round, limit)."""
    got = UPDATE_ROWS.decode_fetch_request(data)
    return None if got is None else (got[0], *got[1], got[2], got[3])


TAG = run_tag(RUN)
SENDER = bytes.fromhex("002408011220") + bytes(range(32))


class Violation(AssertionError):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _is_int(x: object) -> bool:
    return type(x) is int


# -- edge values -----------------------------------------------------------------------------

EDGE_INTS = [
    0, 1, -1, 2, 3, 15, 16, 17, 63, 64, 65, 127, 128, 255, 256, 4095, 4096, 4097, 65535,
    65536, 2**31 - 1, 2**31, 2**32, MAX_ROUND // BUCKET_ROUNDS, MAX_ROUND // BUCKET_ROUNDS + 1,
    MAX_ROUND, MAX_ROUND + 1, 2**63 - 1, 2**64 - 1, -(2**63), -(2**31), PROTOCOL_VERSION,
    PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1,
]  # fmt: skip
EDGE_FLOATS = [
    0.0, -0.0, 1.0, 2.0, 64.0, 0.5, -1.5, 1e-300, 1e300, 1.7976931348623157e308, 3.5e38,
    65504.0, 65520.0, math.nan, math.inf, -math.inf, float(PROTOCOL_VERSION),
]  # fmt: skip
EDGE_BYTES_LENGTHS = [0, 1, 2, 3, 4, 8, 9, 30, 31, 32, 33, 34, 38, 63, 64, 65, 70]


def random_bytes(r: random.Random, max_len: int) -> bytes:
    return r.randbytes(r.randint(0, max_len))


def any_value(r: random.Random, depth: int = 0):
    """A random msgpack-able value, biased to the edges."""
    kind = r.random()
    if kind < 0.08:
        return r.choice([None, True, False])
    if kind < 0.30:
        return r.choice(EDGE_INTS) if r.random() < 0.7 else r.randint(-(2**63), 2**64 - 1)
    if kind < 0.40:
        return r.choice(EDGE_FLOATS) if r.random() < 0.7 else struct.unpack("<d", r.randbytes(8))[0]
    if kind < 0.58:
        n = r.choice(EDGE_BYTES_LENGTHS) if r.random() < 0.7 else r.randint(0, 200)
        return r.randbytes(n) if r.random() < 0.7 else (TAG * 20)[:n]
    if kind < 0.68:
        return r.choice(["", RUN, RUN[:16], "x" * 129, "\u00e9" * 70, "sf/" + RUN[:16]])
    if kind < 0.72:
        if r.random() < 0.3:  # ext type -1
            return msgpack.Timestamp(r.randint(-(2**40), 2**40), r.randint(0, 999_999_999))
        return msgpack.ExtType(r.randint(0, 127), r.randbytes(r.choice([0, 1, 4, 8, 12, 13])))
    if depth >= 3:
        return r.choice(EDGE_INTS)
    if kind < 0.92:
        return [any_value(r, depth + 1) for _ in range(r.choice([0, 1, 2, 3, 4, 5, 6, 7, 9]))]
    keys = [r.choice([0, 1, "a", "round", -1, b"k"]) for _ in range(r.randint(0, 3))]
    return {k: any_value(r, depth + 1) for k in keys}


def pack(r: random.Random, obj) -> bytes:
    try:
        return msgpack.packb(
            obj,
            use_bin_type=r.random() < 0.9,  # else bytes travel as (raw) str
            use_single_float=r.random() < 0.2,
            strict_types=False,
        )
    except (ValueError, OverflowError, TypeError):  # e.g. a map key msgpack refuses
        return b"\xc1"


def deep_nesting(r: random.Random) -> bytes:
    depth = r.choice([100, 1000, 5000, 100_000])
    return r.choice([b"\x91", b"\x81\x00", b"\xdc\x00\x01"]) * depth + b"\x00"


def mutate_structure(r: random.Random, obj):
    """`obj` (a list of lists) with one element replaced, dropped or added."""
    obj = copy.deepcopy(obj)
    holder = obj
    while isinstance(holder, list) and holder and r.random() < 0.5:
        child = r.choice(holder)
        if not isinstance(child, list):
            break
        holder = child
    if not isinstance(holder, list):
        return obj
    op = r.random()
    if op < 0.6 and holder:
        holder[r.randrange(len(holder))] = any_value(r)
    elif op < 0.8 and holder:
        del holder[r.randrange(len(holder))]
    else:
        holder.insert(r.randint(0, len(holder)), any_value(r))
    return obj


# Type bytes of msgpack: fixarray, nil, bools, bin, float, uints, ints, str, array, map, ...
MSGPACK_HEADERS = bytes.fromhex("909194 96c0c2c3c4c5cacbcccfd0d3d4d9dcdddedf80a0ff")


def mutate_bytes(r: random.Random, data: bytes, other: bytes = b"") -> bytes:
    out = bytearray(data)
    for _ in range(r.choice([1, 1, 1, 2, 3, 8])):
        op = r.random()
        at = r.randint(0, len(out))
        if op < 0.25 and out:
            i = r.randrange(len(out))
            out[i] ^= 1 << r.randrange(8)
        elif op < 0.45 and out:
            out[r.randrange(len(out))] = (
                r.choice(MSGPACK_HEADERS) if r.random() < 0.5 else r.randrange(256)
            )
        elif op < 0.6:
            out[at:at] = r.randbytes(r.randint(1, 4))
        elif op < 0.72 and out:
            del out[at : at + r.randint(1, 4)]
        elif op < 0.8:
            del out[at:]
        elif op < 0.9 and out:
            i = r.randrange(len(out))
            out[at:at] = out[i : i + r.randint(1, 8)]
        else:
            out[at:] = other[r.randint(0, len(other)) :]
    return bytes(out)


def mixed_input(r: random.Random, valid, max_random: int) -> bytes:
    """One input for a decoder whose valid structures come from `valid(r)`."""
    kind = r.random()
    if kind < 0.12:
        return random_bytes(r, max_random)
    if kind < 0.27:
        return pack(r, any_value(r))
    if kind < 0.29:
        return deep_nesting(r)
    if kind < 0.39:
        return pack(r, valid(r))
    if kind < 0.69:
        return pack(r, mutate_structure(r, valid(r)))
    return mutate_bytes(r, pack(r, valid(r)), pack(r, valid(r)))


# -- valid structures ---------------------------------------------------------------------------


def random_round(r: random.Random) -> int:
    return r.choice([0, 1, 63, 64, 127, 128, 65535, 2**32, MAX_ROUND, r.randint(0, 10**6)])


def finite_halves(r: random.Random, k: int) -> bytes:
    out = b""
    while len(out) < 2 * k:
        half = r.randrange(1 << 16)
        if (half & 0x7C00) != 0x7C00:  # exponent all ones: inf or NaN
            out += half.to_bytes(2, "little")
    return out


def valid_update(r: random.Random) -> list:
    body = [PROTOCOL_VERSION, TAG, random_round(r), finite_halves(r, r.randint(1, MAX_SCALARS))]
    return body if r.random() < 0.5 else [*body, r.getrandbits(64)]  # a held-state digest


def valid_row(r: random.Random) -> list:
    peer = r.randbytes(r.choice([1, 38, 38, 64]))
    data = r.randbytes(r.randint(0, MAX_UPDATE_BYTES))
    packed = finite_halves(r, r.randint(1, MAX_SCALARS))
    return [random_round(r), peer, packed, data, r.randbytes(8), r.randbytes(64)]


def valid_rows(r: random.Random) -> list:
    return [valid_row(r) for _ in range(r.choice([0, 1, 1, 2, 3, 5]))]


def valid_digests(r: random.Random) -> list:
    buckets = r.sample(range(0, 50), r.randint(0, 5))
    if r.random() < 0.2:
        buckets.append(MAX_ROUND // BUCKET_ROUNDS)
    return [[b, r.choice([0, 1, 4, 2**20, MAX_ROUND]), r.randbytes(32)] for b in set(buckets)]


def valid_digest_request(r: random.Random) -> list:
    return [r.choice([RUN, RUN[:7], ""]), BUCKET_ROUNDS]


def valid_fetch_request(r: random.Random) -> list:
    return [
        r.choice([RUN, RUN[:7]]),
        r.choice([-1, 0, 5, MAX_ROUND]),
        r.randbytes(r.choice([0, 38, 64])),
        random_round(r),
        r.choice([1, 7, FETCH_LIMIT]),
    ]


# -- decoder properties ---------------------------------------------------------------------------


def _plain(data: bytes):
    """The reference reading: msgpack's defaults, None if it is not one msgpack value."""
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception:
        return None


def _halves(packed: object, directions: int | None = None) -> tuple[float, ...] | None:
    """Finite float16 scalars, 1..16 of them (`directions` if given), or None."""
    if type(packed) is not bytes or len(packed) % 2 or not 2 <= len(packed) <= 2 * MAX_SCALARS:
        return None
    values = struct.unpack(f"<{len(packed) // 2}e", packed)
    if directions is not None and len(values) != directions:
        return None
    return values if all(math.isfinite(v) for v in values) else None


def reference_update(data: bytes, directions: int | None):
    if len(data) > MAX_UPDATE_BYTES:
        return None
    body = _plain(data)
    if type(body) is not list or len(body) not in (4, 5):
        return None
    version, tag, round_, packed, *held = body
    if held and not (_is_int(held[0]) and 0 <= held[0] < 2**64):  # the held-state digest
        return None
    if not _is_int(version) or version != PROTOCOL_VERSION or tag != TAG or type(tag) is not bytes:
        return None
    if not _is_int(round_) or not 0 <= round_ <= MAX_ROUND:
        return None
    if _halves(packed, directions) is None:
        return None
    return round_, packed


def _rejected(exc: Rejected, expected) -> str:
    if exc.reason not in DROP_REASONS:
        raise Violation("bad_error", f"reason {exc.reason!r} is not a drop reason")
    if expected is not None:
        raise Violation("wrong_reject", f"{exc} for a valid input {expected!r:.200}")
    return "rejected"


def check_update(data: bytes, directions: int | None = None) -> str:
    expected = reference_update(data, directions)
    try:
        m = decode_update(data, RUN, SENDER, directions)
    except Rejected as exc:
        return _rejected(exc, expected)
    if expected is None:
        raise Violation("wrong_accept", f"decode_update accepted {data.hex()}")
    ok = (
        type(m) is UpdateMessage
        and _is_int(m.round)
        and 0 <= m.round <= MAX_ROUND
        and 1 <= len(m.scalars) <= MAX_SCALARS
        and all(type(x) is float and math.isfinite(x) for x in m.scalars)
        and (directions is None or len(m.scalars) == directions)
        and m.peer == SENDER
        and (m.round, pack_scalars(m.scalars)) == expected
    )
    if not ok:
        raise Violation("wrong_accept", f"decode_update gave {m} for {data.hex()}")
    return "accepted"


def reference_rows(data: bytes, max_rows: int):
    rows = _plain(data)
    if type(rows) is not list or len(rows) > max_rows:
        return None
    out = []
    for row in rows:
        if type(row) is not list or len(row) != 6:
            return None
        round_, peer, packed, payload, seqno, signature = row
        if not _is_int(round_) or not 0 <= round_ <= MAX_ROUND:
            return None
        if not all(type(x) is bytes for x in row[1:]):
            return None
        if not 0 < len(peer) <= MAX_PEER_ID_BYTES or len(payload) > MAX_UPDATE_BYTES:
            return None
        if _halves(packed) is None:
            return None
        out.append((round_, peer, packed, payload, seqno, signature))
    return out


def check_rows(data: bytes, max_rows: int = 5) -> str:
    expected = reference_rows(data, max_rows)
    try:
        rows = decode_rows(data, max_rows)
    except Rejected as exc:
        return _rejected(exc, expected)
    if expected is None:
        raise Violation("wrong_accept", f"decode_rows accepted {data.hex()[:400]}")
    got = [
        (m.round, m.peer, pack_scalars(m.scalars), e.data, e.seqno, e.signature) for m, e in rows
    ]
    if got != expected or not all(
        _is_int(m.round) and all(math.isfinite(x) for x in m.scalars) for m, _ in rows
    ):
        raise Violation("wrong_accept", f"decode_rows gave {got!r:.300}")
    return "accepted"


def reference_digests(data: bytes):
    body = _plain(data)
    if type(body) is not list:
        return None
    out = {}
    for item in body:
        if type(item) is not list or len(item) != 3:
            return None
        bucket, count, digest = item
        if not (_is_int(bucket) and 0 <= bucket <= MAX_ROUND // BUCKET_ROUNDS):
            return None
        if not (_is_int(count) and 0 <= count <= MAX_ROUND):
            return None
        if type(digest) is not bytes or len(digest) != 32 or bucket in out:
            return None
        out[bucket] = (count, digest)
    return out


def check_digests(data: bytes) -> str:
    expected = reference_digests(data)
    try:
        got = decode_digests(data)
    except Rejected as exc:
        return _rejected(exc, expected)
    if expected is None or got != expected:
        raise Violation("wrong_accept", f"decode_digests accepted {data.hex()[:400]}")
    if not all(_is_int(b) and _is_int(c) for b, (c, _) in got.items()):
        raise Violation("wrong_accept", f"decode_digests gave non-integers {got!r:.300}")
    return "accepted"


def _run_id_ok(x: object) -> bool:
    return type(x) is str and len(x.encode()) <= 128


def reference_digest_request(data: bytes):
    body = _plain(data)
    if type(body) is not list or len(body) != 2:
        return None
    run_id, bucket_rounds = body
    if not _run_id_ok(run_id) or not _is_int(bucket_rounds) or bucket_rounds != BUCKET_ROUNDS:
        return None
    return run_id


def check_digest_request(data: bytes) -> str:
    expected = reference_digest_request(data)
    got = decode_digest_request(data)
    if got is None:
        if expected is not None:
            raise Violation("wrong_reject", f"decode_digest_request refused {data.hex()}")
        return "rejected"
    if got != expected or type(got) is not str:
        raise Violation("wrong_accept", f"decode_digest_request gave {got!r:.100}")
    return "accepted"


def reference_fetch_request(data: bytes):
    body = _plain(data)
    if type(body) is not list or len(body) != 5:
        return None
    run_id, round_, after_peer, max_round, limit = body
    ok = (
        _run_id_ok(run_id)
        and _is_int(round_)
        and -1 <= round_ <= MAX_ROUND
        and type(after_peer) is bytes
        and len(after_peer) <= MAX_PEER_ID_BYTES
        and _is_int(max_round)
        and 0 <= max_round <= MAX_ROUND
        and _is_int(limit)
        and 1 <= limit <= FETCH_LIMIT
    )
    return tuple(body) if ok else None


def check_fetch_request(data: bytes) -> str:
    expected = reference_fetch_request(data)
    got = decode_fetch_request(data)
    if got is None:
        if expected is not None:
            raise Violation("wrong_reject", f"decode_fetch_request refused {data.hex()}")
        return "rejected"
    if got != expected or not all(_is_int(x) for x in (got[1], got[3], got[4])):
        raise Violation("wrong_accept", f"decode_fetch_request gave {got!r:.200}")
    return "accepted"


# -- manifests -------------------------------------------------------------------------------------

RUN_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(RunConfig)}
DEFAULT_BODY = json.loads(RunConfig().to_json())
DEEP = "\0deep\0"  # placeholder for nesting json.dumps cannot write


def edge_json_value(r: random.Random, depth: int = 0):
    kind = r.random()
    if kind < 0.1:
        return r.choice([None, True, False])
    if kind < 0.35:
        return r.choice(EDGE_INTS + [10**30, -(10**30), 10**400, 1, 8, 20, 100])
    if kind < 0.5:
        return r.choice(EDGE_FLOATS + [1e-3, 3e-4, -1e-3, 1e400])
    if kind < 0.65:
        return r.choice(
            ["", "x", "tiny-llama", "cosine", "rms", "naive", "constant", "none", "0" * 64,
             "ab" * 32, "../etc", "\ud800", "\n", "x" * 1000]
        )  # fmt: skip
    if kind < 0.7:
        return DEEP
    if depth >= 4:
        return 0
    if kind < 0.85:
        return [edge_json_value(r, depth + 1) for _ in range(r.randint(0, 3))]
    return {str(r.randint(0, 9)): edge_json_value(r, depth + 1) for _ in range(r.randint(0, 3))}


def valid_manifest_body(r: random.Random) -> dict:
    body = dict(DEFAULT_BODY)
    directions = r.choice([1, 1, 2, 4, 8, 16])
    body.update(
        rank=r.randint(1, 64),
        directions=directions,
        batch_size=directions * r.randint(1, 4),
        lr=r.choice([0.0, 1e-4, 3e-4, 1]),
        eps=r.choice([1e-3, 1e-2, 5]),
        clip=r.choice([1.0, 100.0, 65504.0, 3]),
        total_rounds=r.choice([0, 60, MAX_ROUND]),
        normalize=r.choice(["none", "rms", "unit"]),
        base_sha256=r.choice(["", "0" * 64, "ab" * 32]),
        extra=r.choice([{}, {"note": "x", "n": [1, 2.5, None, True]}, {"a": {"b": {"c": []}}}]),
    )
    return body


def _dumps(body: object, r: random.Random) -> str:
    text = json.dumps(body, allow_nan=True, ensure_ascii=r.random() < 0.5)
    while f'"{DEEP}"' in text or json.dumps(DEEP) in text:
        depth = r.choice([9, 50, 900, 1100, 5000])
        nest = r.choice(["[", '{"a":'])
        close = "]" if nest == "[" else "}"
        text = text.replace(json.dumps(DEEP), nest * depth + "1" + close * depth, 1)
    return text


JSON_CHARS = '{}[],:" 0123456789-+.eEnulltrufaseNaNInfinity\\u00'


def mutate_text(r: random.Random, text: str, alphabet: str) -> str:
    out = list(text)
    for _ in range(r.choice([1, 1, 2, 3, 6])):
        op = r.random()
        at = r.randint(0, len(out))
        if op < 0.35 and out:
            out[r.randrange(len(out))] = r.choice(alphabet)
        elif op < 0.6:
            out[at:at] = [r.choice(alphabet) for _ in range(r.randint(1, 4))]
        elif op < 0.8 and out:
            del out[at : at + r.randint(1, 4)]
        elif op < 0.9:
            del out[at:]
        elif out:
            i = r.randrange(len(out))
            out[at:at] = out[i : i + r.randint(1, 16)]
    return "".join(out)


def manifest_input(r: random.Random) -> str:
    kind = r.random()
    if kind < 0.06:
        return "".join(chr(r.randrange(0x20, 0x7F)) for _ in range(r.randint(0, 80)))
    body = valid_manifest_body(r)
    if kind < 0.25:
        return _dumps(body, r)
    if kind < 0.6:
        for _ in range(r.choice([1, 1, 2, 4])):
            op = r.random()
            if op < 0.75:
                body[r.choice(list(RUN_FIELD_TYPES))] = edge_json_value(r)
            elif op < 0.85:
                body["manifest_version"] = edge_json_value(r)
            elif op < 0.92:
                body.pop(r.choice(list(body)), None)
            else:
                body[r.choice(["rnak", "extra_", ""])] = edge_json_value(r)
        return _dumps(body, r)
    return mutate_text(r, _dumps(body, r), JSON_CHARS)


def _one_line(exc: UserError) -> str:
    text = str(exc)
    if not text or "\n" in text or "\r" in text:
        raise Violation("bad_error", f"UserError is not one line: {text[:200]!r}")
    return "rejected"


def _b58_ed25519(text: object) -> bytes | None:
    """A base58 Ed25519 peer id's bytes, else None (restated from libp2p's format)."""
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    if not isinstance(text, str) or not text or len(text) > 64:
        return None
    if any(ch not in alphabet for ch in text):
        return None
    n = 0
    for ch in text:
        n = n * 58 + alphabet.index(ch)
    zeros = len(text) - len(text.lstrip("1"))
    raw = b"\0" * zeros + (n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b"")
    return raw if len(raw) == 38 and raw.startswith(bytes.fromhex("002408011220")) else None


def config_problems(c: RunConfig) -> list[str]:
    """Every documented bound an accepted RunConfig must satisfy (independent restatement)."""
    problems = []
    for name, annotation in RUN_FIELD_TYPES.items():
        value = getattr(c, name)
        expected = {
            "int": (int,),
            "float": (int, float),
            "str": (str,),
            "bool": (bool,),
            "list[str]": (list,),
        }.get(annotation, (dict,))
        if isinstance(value, bool) != (annotation == "bool") or not isinstance(value, expected):
            problems.append(f"{name} has type {type(value).__name__}")
    if problems:
        return problems
    for name, (low, high) in INT_RANGES.items():
        if not low <= getattr(c, name) <= high:
            problems.append(f"{name} out of range")
    for name in ("eps", "lr", "clip"):
        try:
            if not math.isfinite(getattr(c, name)):
                problems.append(f"{name} not finite")
        except OverflowError:
            problems.append(f"{name} beyond float")
    if not (c.eps > 0 and c.lr >= 0 and 0 < c.clip <= 65504):
        problems.append("eps, lr or clip out of range")
    if c.batch_size % c.directions:
        problems.append("batch_size not a multiple of directions")
    if c.lr_schedule not in ("constant", "cosine") or c.normalize not in ("none", "rms", "unit"):
        problems.append("bad enum")
    if c.estimator not in ("subcge", "naive") or (c.estimator == "naive" and c.directions != 1):
        problems.append("bad estimator")
    if c.lr_schedule == "cosine" and c.total_rounds < 1:
        problems.append("cosine without total_rounds")
    if len(c.allow_peers) > 1000 or len(set(c.allow_peers)) != len(c.allow_peers):
        problems.append("allow_peers too long or repeated")
    for peer in c.allow_peers:
        raw = _b58_ed25519(peer)
        if raw is None:
            problems.append("allow_peers entry not an Ed25519 peer id")
    if c.base_sha256 and not (
        len(c.base_sha256) == 64 and set(c.base_sha256) <= set("0123456789abcdef")
    ):
        problems.append("base_sha256 not hex")
    stack = [(c.extra, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_EXTRA_DEPTH or not all(type(k) is str for k in value):
                problems.append("extra too deep or bad keys")
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            if depth > MAX_EXTRA_DEPTH:
                problems.append("extra too deep")
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append("extra not finite")
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            problems.append("extra not JSON")
    if not problems:
        again = RunConfig.from_json(c.to_json())
        if again != c or again.run_id != c.run_id:
            problems.append("to_json / from_json changes it")
    return problems


def check_manifest(text: str) -> str:
    try:
        c = RunConfig.from_json(text)
    except UserError as exc:
        return _one_line(exc)
    if len(text) > MAX_MANIFEST_BYTES:
        raise Violation("wrong_accept", "manifest over the size limit accepted")
    body = json.loads(text)  # it parsed once, so it parses again
    version = body.get("manifest_version")
    if (
        type(version) is not int
        or version != 2
        or set(body) - set(RUN_FIELD_TYPES) - {"manifest_version"}
    ):
        raise Violation("wrong_accept", f"manifest with version {version!r} or unknown keys")
    problems = config_problems(c)
    if problems:
        raise Violation("wrong_accept", f"manifest accepted with {problems}: {text[:300]!r}")
    return "accepted"


# -- TOML settings files ------------------------------------------------------------------------


def _daemon_fields():
    from peer.command import NODE_FIELDS, PEER_FIELDS

    return PEER_FIELDS, NODE_FIELDS


TOML_VALUES = [
    "0", "1", "-1", "8", "20", "64", "65535", "65536", "70000", "3.5", "0.0", "-0.0", "1e-3",
    "nan", "+nan", "-nan", "inf", "+inf", "-inf", "1e999", "-1e999", "0x7fffffffffffffff",
    "0b101", "0o17", "1_000", "9" * 30, "9" * 5000, "true", "false", '"x"', "'lit'", '""',
    '"""multi\nline"""', '"tiny-llama"', '"cosine"', '"rms"', "[]", "[1, 2]", '["a", "b"]',
    '["/ip4/0.0.0.0/tcp/99999"]', '["/ip4/1.2.3.4/tcp/0/p2p/x"]', "{a = 1}", "1979-05-27",
    "07:32:00", "1979-05-27T07:32:00Z", "[[1], [2]]", "{}",
]  # fmt: skip
TOML_CHARS = "=[]{}.,\"' \n#0123456789-+_abcdefinxtrue"


def toml_input(r: random.Random, daemon: bool) -> str:
    peer_fields, node_fields = _daemon_fields()
    names = [f.name for f in (peer_fields + node_fields if daemon else RUN_FIELDS)]
    names += ["rnak", "extra", "model", "round_deadline"]
    lines = []
    for _ in range(r.randint(0, 6)):
        name = r.choice(names)
        if r.random() < 0.3:
            name = name.replace("_", "-")
        kind = r.random()
        if kind < 0.6:
            value = r.choice(TOML_VALUES)
        elif kind < 0.7:
            depth = r.choice([2, 50, 900, 3000])
            value = "[" * depth + "]" * depth
        elif kind < 0.75:
            depth = r.choice([2, 50, 900, 3000])
            value = "{a = " * depth + "1" + "}" * depth
        else:
            value = repr(r.choice([r.uniform(-1e6, 1e6), r.randint(-(10**20), 10**20)]))
        lines.append(f"{name} = {value}")
    if r.random() < 0.1:
        lines.insert(r.randint(0, len(lines)), r.choice(["[table]", "[[array]]", "[node]"]))
    text = "\n".join(lines) + "\n"
    return mutate_text(r, text, TOML_CHARS) if r.random() < 0.3 else text


def settings_problems(settings, fields) -> list[str]:
    problems = []
    for f in fields:
        value = getattr(settings, f.name)
        kind = str(f.field.type).replace(" | None", "")  # the annotation, read independently
        if value is None and "None" in str(f.field.type):
            continue
        if kind in ("int", "float"):
            if isinstance(value, bool) or not isinstance(
                value, (int, float) if kind == "float" else int
            ):
                problems.append(f"{f.name} has type {type(value).__name__}")
                continue
            b = f.field.metadata["bounds"]
            low, high, open_low = b.low, b.high, b.open_low
            if not (
                math.isfinite(value)
                and (value > low if open_low else value >= low)
                and value <= high
            ):
                problems.append(f"{f.name} = {value!r} out of range")
        elif kind == "bool" and type(value) is not bool:
            problems.append(f"{f.name} not bool")
        elif kind == "str" and type(value) is not str:
            problems.append(f"{f.name} not str")
        elif kind == "Path" and not isinstance(value, Path):
            problems.append(f"{f.name} not a Path")
        elif kind.startswith("list[") and not (
            type(value) is list and all(type(x) is str for x in value)
        ):
            problems.append(f"{f.name} not a list of str")
    return problems


def check_toml(text: str, daemon: bool) -> str:
    args = argparse.Namespace(config="fuzz.toml")
    try:
        table = parse_toml(text, args.config)
        if daemon:
            from peer.daemon import PeerSettings
            from seedflood_p2p.network.settings import NodeSettings

            peer_fields, node_fields = _daemon_fields()
            check_unknown(table, peer_fields + node_fields, args)
            node = NodeSettings(**settings_values(args, node_fields, table, {}))
            settings = PeerSettings(**settings_values(args, peer_fields, table, {}), node=node)
        else:
            check_unknown(table, RUN_FIELDS, args)
            config = RunConfig(**settings_values(args, RUN_FIELDS, table, {}))
    except UserError as exc:
        return _one_line(exc)
    if daemon:
        problems = settings_problems(settings, peer_fields) + settings_problems(node, node_fields)
    else:
        problems = config_problems(config)
    if problems:
        raise Violation("wrong_accept", f"settings accepted with {problems}: {text[:300]!r}")
    return "accepted"


# -- identity key files --------------------------------------------------------------------------


def _key_blobs():
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.proto import crypto_pb2

    out = []
    for _ in range(3):
        key = Ed25519PrivateKey.generate()
        seed = key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
        public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
        out.append((seed, public))
    return out, crypto_pb2


KEY_MODES = [0o600, 0o600, 0o600, 0o400, 0o644, 0o640, 0o604, 0o660, 0o700, 0o620, 0o602]


def identity_input(r: random.Random, keys) -> tuple[bytes, int]:
    (pairs, crypto_pb2) = keys
    seed, public = r.choice(pairs)
    other_public = r.choice(pairs)[1]
    kind = r.random()
    key_type = crypto_pb2.Ed25519
    if kind < 0.3:
        data = seed + public
    elif kind < 0.4:
        data = seed + public + public
    elif kind < 0.5:
        data = seed + other_public
    elif kind < 0.55:
        data = seed + public + other_public
    elif kind < 0.65:
        data = r.randbytes(r.choice([0, 32, 63, 64, 65, 96, 200]))
    else:
        data = seed + public
    if r.random() < 0.1:
        key_type = r.choice([crypto_pb2.RSA, crypto_pb2.Secp256k1, crypto_pb2.ECDSA, 7, 255])
    try:
        raw = crypto_pb2.PrivateKey(key_type=key_type, data=data).SerializeToString()
    except ValueError:  # an enum value protobuf refuses to write
        raw = b"\x08" + bytes([key_type & 0x7F]) + b"\x12\x40" + data[:64]
    if kind >= 0.65 and kind < 0.85:
        raw = mutate_bytes(r, raw)
    elif kind >= 0.85:
        raw = random_bytes(r, 80)
    return raw, r.choice(KEY_MODES)


def reference_identity(raw: bytes, mode: int):
    """(seed, public) of a key file that must be accepted, else None."""
    from hivemind.proto import crypto_pb2

    if mode & 0o077:
        return None
    try:
        blob = crypto_pb2.PrivateKey.FromString(raw)
    except Exception:
        return None
    if blob.key_type != crypto_pb2.Ed25519 or len(blob.data) not in (64, 96):
        return None
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    public = (
        Ed25519PrivateKey.from_private_bytes(blob.data[:32])
        .public_key()
        .public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    )
    if blob.data[32:64] != public or (len(blob.data) == 96 and blob.data[64:] != public):
        return None
    return public


def check_identity(path: Path, raw: bytes, mode: int) -> str:
    from seedflood_p2p.network.transport.identity import load_or_create_identity

    if path.exists():
        os.chmod(path, 0o600)
    path.write_bytes(raw)
    os.chmod(path, mode)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    expected = reference_identity(raw, mode)
    try:
        peer_id = load_or_create_identity(path)
    except UserError as exc:
        if expected is not None:
            raise Violation("wrong_reject", f"key file refused: {exc}") from None
        return _one_line(exc)
    if expected is None or peer_id.to_bytes() != bytes.fromhex("002408011220") + expected:
        raise Violation("wrong_accept", f"key file {raw.hex()} mode {mode:o} accepted")
    return "accepted"


# -- the targets, for the benchmark and the tests ------------------------------------------------


def targets():
    """name -> (make_input(r) -> input, check(input) -> outcome)."""
    return {
        "decode_update": (
            lambda r: (mixed_input(r, valid_update, 80), r.choice([None, None, 1, 4, 16])),
            lambda x: check_update(*x),
        ),
        "decode_rows": (
            lambda r: (mixed_input(r, valid_rows, 400), r.choice([1, 3, 5, 4096])),
            lambda x: check_rows(*x),
        ),
        "decode_digests": (lambda r: mixed_input(r, valid_digests, 200), check_digests),
        "decode_digest_request": (
            lambda r: mixed_input(r, valid_digest_request, 100),
            check_digest_request,
        ),
        "decode_fetch_request": (
            lambda r: mixed_input(r, valid_fetch_request, 150),
            check_fetch_request,
        ),
        "RunConfig.from_json": (manifest_input, check_manifest),
        "TOML run settings": (
            lambda r: toml_input(r, daemon=False),
            lambda t: check_toml(t, False),
        ),
        "TOML peer settings": (lambda r: toml_input(r, daemon=True), lambda t: check_toml(t, True)),
    }
