"""`encode` records to msgpack bytes and `decode` them back, checking everything both ways.

The envelope is the record's own msgpack map with two more keys: `"type"` (the record's
`wire_type`, e.g. "trajectory_group") and `"schema"` ([major, minor]). Numeric arrays are maps
`{"dtype": "<i4" | "<f4", "length": n, "data": bin}` of raw little-endian bytes: encoding is one
`memoryview` handed to msgpack, decoding a `numpy.frombuffer` view (see docs/wire-format.md).

Choices:
- One definition of valid: `encode` builds the map it is about to pack and runs the consumer's
  reader (`schema.READERS`) over it, so a producer cannot publish what a consumer would reject.
  Invalid data raises `CodecError` on both sides; a non-record passed to `encode` is a
  programming error (`TypeError`).
- Zero-copy decode: msgpack copies each bin out of the input once (a memcpy); the arrays are
  read-only numpy views over those bytes, never Python lists.
- Fields whose value is None or an empty map are left out rather than written as nil or {}
  (the format reads both as absent, and an absent map as empty): decode time goes with the
  number of msgpack objects, and a sample's unset `token_rewards` and `error` were ~10% of them.
- Bounded work per record, whatever its bytes: every container's length prefix is checked
  against `UNPACK_LIMITS` before msgpack builds it, and a count of all maps and arrays with
  their entries, at any depth, stops decoding past `MAX_OBJECTS_PER_RECORD` (msgpack calls a
  counting hook as it completes each container). Ignored unknown fields count too: msgpack
  builds them before a reader can skip them. The hooks cost ~5 us of a 16-sample group's
  ~75 us; worst case a record is rejected after ~50 ms (empty arrays, the costliest object).
- A Kafka tombstone (a record whose value is null, which Miles never writes) is a `CodecError`
  like any undecodable record.
- msgpack is imported here only, and its exceptions become `CodecError("record", ...)`. Each
  thread reuses one `msgpack.Packer`, whose buffer grows to the largest record it packed (at most
  MAX_RECORD_BYTES) and stays: packing is then ~4x faster than `msgpack.packb`.
- Schema versions: another major is rejected (naming both versions), any minor is read, unknown
  fields are ignored.
- Signatures (1.3): `signed_message` is the canonical msgpack form of a control record's signed
  fields, the bytes its Ed25519 `signature` covers (docs/wire-format.md, "Signatures"). It is
  built from the record as a reader sees it (decoded, defaults applied), so how a sender wrote
  its map (key order, an int for a float) does not matter, and a foreign client can rebuild it.
"""

import threading
from dataclasses import fields, replace
from functools import cache

import msgpack
import numpy as np

from miles.errors import CodecError
from miles.protocol.fields import FieldReader, preview
from miles.protocol.limits import (FLOAT_DTYPE, MASK_DTYPE, MAX_OBJECTS_PER_RECORD,
                                   SCHEMA_VERSION, TOKEN_DTYPE, UNPACK_LIMITS)
from miles.protocol.records import Command, Heartbeat, WeightVersion, WireRecord
from miles.protocol.schema import READERS, TYPES_BY_NAME
from miles.protocol.topics import MAX_RECORD_BYTES

Expected = type[WireRecord] | tuple[type[WireRecord], ...] | None
"""Record types `decode` accepts: one, several, or None for any."""

_ENCODE_EXACT = frozenset((str, int, float, bool, bytes, type(None)))
# dtype.str is rebuilt on every access; array maps are built for every array of a group
_WIRE_DTYPES = {TOKEN_DTYPE: TOKEN_DTYPE.str, FLOAT_DTYPE: FLOAT_DTYPE.str,
                MASK_DTYPE: MASK_DTYPE.str}
_PACKERS = threading.local()  # one Packer per thread (a Packer is not thread-safe)
TOMBSTONE_REASON = "a tombstone (null value): Miles topics carry no tombstones"


def encode(record: WireRecord) -> bytes:
    """The msgpack bytes of `record`; raises `CodecError` if a consumer would reject them."""
    read = READERS.get(type(record))
    if read is None:
        raise TypeError(f"not a wire record: {type(record).__name__}")
    body = _record_to_wire(record, "")
    read(FieldReader(body))  # the consumer's checks, run by the producer
    packed = _pack({"type": record.wire_type, "schema": list(SCHEMA_VERSION), **body})
    if len(packed) > MAX_RECORD_BYTES:
        raise CodecError("record", f"encoded size {len(packed)} bytes exceeds MAX_RECORD_BYTES "
                                   f"({MAX_RECORD_BYTES}); send large payloads by URI")
    return packed


SIGNATURE_CONTEXT = b"miles control signature v1\n"
"""Prefix of every signed message, so a key signs Miles control records and nothing else."""

SIGNED_FIELDS: dict[type[WireRecord], tuple[str, ...]] = {
    WeightVersion: ("policy_version", "step", "uri", "format", "sha256", "bytes", "base_model",
                    "trainer_generation", "created_at"),
    Command: ("command", "target", "reason", "created_at"),
    Heartbeat: ("producer_id", "role", "engine", "policy_version", "in_flight", "tokens_per_s",
                "trainer_generation", "extra", "created_at"),
}
"""The fields a signature covers, per record type: every field but `signature` as of 1.3 (a
later minor's new field is not covered unless a new `SIGNATURE_CONTEXT` says so)."""


def signed_message(record: WireRecord) -> bytes:
    """The bytes the `signature` of `record` covers: `SIGNATURE_CONTEXT`, then one msgpack map
    of `type` and the `SIGNED_FIELDS` as a reader decodes them (defaults applied), keys and
    nested keys sorted by their UTF-8 bytes, ints, str and map headers in their shortest form,
    floats as float64. Raises `CodecError` when `record` is not valid."""
    names = SIGNED_FIELDS.get(type(record))
    if names is None:
        raise TypeError(f"{type(record).__name__} records are not signed")
    seen = decode(encode(replace(record, signature=None)), type(record))
    canonical = {"type": record.wire_type, **{n: getattr(seen, n) for n in names}}
    return SIGNATURE_CONTEXT + msgpack.packb(_sorted(canonical), use_bin_type=True)


def _sorted(value: object) -> object:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value, key=lambda k: k.encode())}
    if isinstance(value, float):
        return float(value)
    return value


def decode(data: bytes | bytearray | memoryview | None,
           expected: Expected = None) -> WireRecord:
    """The record in `data`, fully checked; `expected` restricts which record types are accepted.

    Arrays of the result are read-only views (`arr.copy()` to write). None is a Kafka
    tombstone (a null value), rejected like any record that is not one.
    """
    if data is None:
        raise CodecError("record", TOMBSTONE_REASON)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode takes bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > MAX_RECORD_BYTES:
        raise CodecError("record", f"{size} bytes exceed MAX_RECORD_BYTES ({MAX_RECORD_BYTES})")
    root = FieldReader(_unpack(data))
    _check_schema(root)
    record_type = _record_type(root, expected)
    return READERS[record_type](root)


def unpack(data: bytes | bytearray | memoryview | None) -> object:
    """The msgpack value in `data` as plain data (maps, lists, str, bytes, numbers), checking
    nothing but msgpack itself and its size limits: for tools that show what is on the wire."""
    if data is None:
        raise CodecError("record", TOMBSTONE_REASON)
    return _unpack(data)


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack ext type {code} is not allowed")


class _TooManyObjects(Exception):
    """Raised by the counting hook; not a ValueError, so msgpack passes it through as is."""


def _unpack(data: bytes | bytearray | memoryview) -> object:
    left = MAX_OBJECTS_PER_RECORD

    def count(container: dict | list) -> dict | list:  # msgpack's object_hook and list_hook
        nonlocal left
        left -= len(container) + 1
        if left < 0:
            raise _TooManyObjects
        return container

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                               object_hook=count, list_hook=count, **UNPACK_LIMITS)
    except _TooManyObjects:
        raise CodecError("record", f"more than MAX_OBJECTS_PER_RECORD ({MAX_OBJECTS_PER_RECORD}) "
                                   "maps, arrays and their entries") from None
    except ValueError as e:
        if (limit := _CONTAINER_LIMITS.get(_exceeded_limit(e))) is not None:
            raise CodecError("record", f"{e}: {limit}") from e
        raise CodecError("record", f"not a valid msgpack record ({type(e).__name__}: {e})") from e
    except (TypeError, msgpack.UnpackException) as e:
        raise CodecError("record", f"not a valid msgpack record ({type(e).__name__}: {e})") from e


_CONTAINER_LIMITS = {
    "max_array_len": "no array of a record may be longer than MAX_SAMPLES_PER_GROUP "
                     f"({UNPACK_LIMITS['max_array_len']})",
    "max_map_len": f"no map of a record may have more than MAX_MAP_ENTRIES "
                   f"({UNPACK_LIMITS['max_map_len']}) entries",
}


def _exceeded_limit(error: ValueError) -> str:
    """The unpacker limit an error of msgpack's names ("4097 exceeds max_array_len(4096)")."""
    text = str(error)
    return text.partition(" exceeds ")[2].partition("(")[0]


def _pack(envelope: dict) -> bytes:
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    try:
        return packer.pack(envelope)
    except (ValueError, TypeError, OverflowError) as e:
        raise CodecError("record", f"cannot pack ({type(e).__name__}: {e})") from e


def _check_schema(root: FieldReader) -> None:
    major, minor = root.integers("schema", count=2)
    if major != SCHEMA_VERSION[0]:
        ours = f"{SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}"
        hint = "upgrade this reader" if major > SCHEMA_VERSION[0] else "it is no longer supported"
        raise CodecError("schema", f"record has schema {major}.{minor}, this reader reads major "
                                   f"version {SCHEMA_VERSION[0]} (schema {ours}); {hint}")


def _record_type(root: FieldReader, expected: Expected) -> type[WireRecord]:
    name = root.string("type")
    record_type = TYPES_BY_NAME.get(name)
    if record_type is None:
        raise CodecError("type", f"unknown record type {preview(name)}; "
                                 f"known: {', '.join(TYPES_BY_NAME)}")
    if expected is not None and not issubclass(record_type, expected):
        wanted = expected if isinstance(expected, tuple) else (expected,)
        raise CodecError("type", f"expected {' or '.join(t.wire_type for t in wanted)}, "
                                 f"got {name}")
    return record_type


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _record_to_wire(record: WireRecord, path: str) -> dict:
    """The field map of `record`; paths are only built for error messages and nested records."""
    wire = {}
    for name, dtype in _wire_fields(type(record)):
        value = getattr(record, name)
        if value is None or (type(value) is dict and not value):
            continue  # nil and {} read as absent: leaving them out spares every decoder a key
        if dtype is not None:
            wire[name] = _array_to_wire(value, dtype, path, name)
        elif type(value) in _ENCODE_EXACT:
            wire[name] = value
        else:
            wire[name] = _plain(value, _join(path, name))
    return wire


@cache
def _wire_fields(record_type: type) -> tuple[tuple[str, np.dtype | None], ...]:
    """(name, wire dtype of an array field or None) of each field of a record class."""
    return tuple((f.name, f.metadata.get("dtype")) for f in fields(record_type))


def _plain(value: object, path: str) -> object:
    """`value` as msgpack-ready builtins: nested records as maps, numpy/enum scalars unwrapped.

    Anything else is left as is for the reader to reject with its type name.
    """
    if type(value) in _ENCODE_EXACT:
        return value
    if isinstance(value, WireRecord):
        return _record_to_wire(value, path)
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _plain(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, str):  # subclasses such as StrEnum; str.__str__ gives the plain value
        return str.__str__(value)
    for builtin in (int, float, bytes):  # subclasses such as IntEnum
        if isinstance(value, builtin):
            return builtin(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return value


def _array_to_wire(value: object, dtype: np.dtype, path: str, name: str) -> dict:
    """The array map of a 1-D array, cast to the wire dtype; the data is a view, not a copy."""
    if not isinstance(value, np.ndarray):
        raise CodecError(_join(path, name), f"expected a numpy array, got {type(value).__name__}")
    if value.ndim != 1:
        raise CodecError(_join(path, name), f"expected a 1-D array, got shape {value.shape}")
    if value.dtype != dtype:
        value = _cast(value, dtype, _join(path, name))
    data = memoryview(np.ascontiguousarray(value)).cast("B")
    return {"dtype": _WIRE_DTYPES[dtype], "length": len(value), "data": data}


def _cast(value: np.ndarray, dtype: np.dtype, path: str) -> np.ndarray:
    """`value` as `dtype`: same-kind casts, and any integers or bools into the (unsigned) mask
    dtype, each integer checked against the target's range."""
    integers = dtype.kind == "u" and value.dtype.kind in "biu"  # the mask: 0/1 of any int
    if not (integers or np.can_cast(value.dtype, dtype, casting="same_kind")):
        raise CodecError(path, f"dtype {value.dtype} cannot be cast to {dtype.str}")
    if dtype.kind in "iu" and value.dtype.kind in "iu" and value.size:
        info = np.iinfo(dtype)
        if value.min() < info.min or value.max() > info.max:
            raise CodecError(path, f"values outside the {dtype.str} range")
    return value.astype(dtype)
