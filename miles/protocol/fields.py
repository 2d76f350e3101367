"""Typed, path-aware reading of one decoded msgpack map: the codec's only way into wire data.

Each accessor checks presence, the exact msgpack type and the range of one field, and raises
`CodecError` naming its dotted path (`samples[3].logprobs`), so the per-record readers in
`schema` stay short lists of field reads. Keys nobody asks for are never looked at, which is what
makes unknown fields tolerated.

Choices: types are exact (`type(v) is int`), as msgpack produces them; a bool is not an int; an
int is accepted where a float is expected (other writers may pack 1.0 as 1); nil is the same as
an absent field; floats must be finite everywhere. Arrays are `{dtype, length, data}` maps whose
`data` is viewed in place with `numpy.frombuffer` (no copy, read-only).
"""

import math
from dataclasses import dataclass, field

import numpy as np

from miles.errors import CodecError
from miles.protocol.limits import INT64_MAX, INT64_MIN, MAX_MAP_ENTRIES

REQUIRED = object()
"""Default of a field that must be present (and not nil)."""

_WIRE_NAMES = {type(None): "nil", bool: "bool", int: "int", float: "float", str: "str",
               bytes: "bin", list: "array", dict: "map"}
_SCALAR_TYPES = (str, int, float, bool)
_BLOB_TYPES = (bytes, memoryview)  # memoryview: the encoder's own arrays, checked before packing
_PREVIEW_CHARS = 60  # wire strings echoed in error messages are cut to this many characters


def wire_type_name(value: object) -> str:
    """The msgpack name of a value's type ("map", "bin", ...), for error messages."""
    return _WIRE_NAMES.get(type(value), type(value).__name__)


def preview(value: object) -> str:
    """A short repr of a scalar, else its type name: errors never echo a whole hostile payload."""
    if isinstance(value, (str, bytes)) and len(value) > _PREVIEW_CHARS:
        return repr(value[:_PREVIEW_CHARS]) + "..."
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if value is None or isinstance(value, (str, bytes, int, float)):
        return repr(value)
    return wire_type_name(value)


def _entry_path(path: str, key: str) -> str:
    """Path of a free-form map entry; a long key is cut like any echoed value."""
    return f"{path}.{key if len(key) <= _PREVIEW_CHARS else key[:_PREVIEW_CHARS] + '...'}"


def _check_int(value: object, path: str, lo: int, hi: int) -> int:
    if type(value) is not int:
        raise CodecError(path, f"expected an int, got {wire_type_name(value)}")
    if not lo <= value <= hi:
        raise CodecError(path, f"must be in [{lo}, {hi}], got {preview(value)}")
    return value


def _check_float(value: object, path: str, lo: float, hi: float) -> float:
    if type(value) is not float and type(value) is not int:
        raise CodecError(path, f"expected a float, got {wire_type_name(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise CodecError(path, f"must be finite, got {value}")
    if not lo <= value <= hi:
        raise CodecError(path, f"must be in [{lo}, {hi}], got {value}")
    return value


def _check_scalar(value: object, path: str) -> str | int | float | bool:
    if type(value) is int:
        return _check_int(value, path, INT64_MIN, INT64_MAX)
    if type(value) is float:
        return _check_float(value, path, -math.inf, math.inf)
    if type(value) not in _SCALAR_TYPES:
        raise CodecError(path, f"expected a str, int, float or bool, got {wire_type_name(value)}")
    return value


@dataclass(frozen=True)
class ArraySpec:
    """What an array field may hold: one wire dtype and a length range."""

    dtype: np.dtype
    max_len: int
    min_len: int = 1
    wire_dtype: str = field(init=False)  # dtype.str, kept since numpy rebuilds it on each access
    itemsize: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire_dtype", self.dtype.str)
        object.__setattr__(self, "itemsize", self.dtype.itemsize)


def _array_parts_error(value: dict, path: str, spec: ArraySpec) -> CodecError:
    """The error of an array map whose dtype, length or data is absent, ill-typed or wrong."""
    parts = FieldReader(value, path)
    parts.string("dtype")  # each raises if its part is absent or of the wrong type
    parts.integer("length")
    parts.blob("data", max_len=INT64_MAX)
    return CodecError(path, f"dtype {preview(value['dtype'])} not allowed, "
                            f"expected {spec.wire_dtype!r}")


class FieldReader:
    """Checked access to the fields of one map found at `path` ("" for the record itself)."""

    __slots__ = ("_data", "_path")

    def __init__(self, data: object, path: str = "") -> None:
        if type(data) is not dict:
            raise CodecError(path or "record", f"expected a map, got {wire_type_name(data)}")
        self._data = data
        self._path = path

    def path(self, name: str) -> str:
        """Dotted path of field `name` of this map."""
        return f"{self._path}.{name}" if self._path else name

    def _absent(self, name: str, default: object):
        if default is REQUIRED:
            raise CodecError(self.path(name), "missing required field")
        return default

    def string(self, name: str, *, default: object = REQUIRED, nonempty: bool = False,
               choices: tuple[str, ...] | None = None):
        """A str; `choices` restricts it to a closed set."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, default)
        if type(value) is not str:
            raise CodecError(self.path(name), f"expected a str, got {wire_type_name(value)}")
        if nonempty and not value:
            raise CodecError(self.path(name), "must not be empty")
        if choices is not None and value not in choices:
            raise CodecError(self.path(name),
                             f"must be one of {', '.join(choices)}; got {preview(value)}")
        return value

    def integer(self, name: str, *, lo: int = INT64_MIN, hi: int = INT64_MAX,
                default: object = REQUIRED):
        """An int in [lo, hi]."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, default)
        return _check_int(value, self.path(name), lo, hi)

    def number(self, name: str, *, lo: float = -math.inf, hi: float = math.inf,
               default: object = REQUIRED):
        """A finite float in [lo, hi] (an int is widened)."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, default)
        return _check_float(value, self.path(name), lo, hi)

    def integers(self, name: str, *, count: int, lo: int = 0, hi: int = INT64_MAX) -> list[int]:
        """An array of exactly `count` ints in [lo, hi]."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, REQUIRED)
        path = self.path(name)
        if type(value) is not list or len(value) != count:
            raise CodecError(path, f"expected an array of {count} ints, got {preview(value)}"
                                   + (f" of {len(value)}" if type(value) is list else ""))
        return [_check_int(v, f"{path}[{i}]", lo, hi) for i, v in enumerate(value)]

    def blob(self, name: str, *, max_len: int) -> bytes:
        """A bin of at most `max_len` bytes."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, REQUIRED)
        if type(value) not in _BLOB_TYPES:
            raise CodecError(self.path(name), f"expected a bin, got {wire_type_name(value)}")
        if len(value) > max_len:
            raise CodecError(self.path(name), f"{len(value)} bytes exceed the cap of {max_len}")
        return bytes(value)

    def _map(self, name: str) -> dict:
        value = self._data.get(name)
        if value is None:
            return {}
        if type(value) is not dict:
            raise CodecError(self.path(name), f"expected a map, got {wire_type_name(value)}")
        if len(value) > MAX_MAP_ENTRIES:
            raise CodecError(self.path(name), f"{len(value)} entries exceed MAX_MAP_ENTRIES "
                                              f"({MAX_MAP_ENTRIES})")
        for key in value:
            if type(key) is not str:
                raise CodecError(self.path(name), f"key {preview(key)} is not a str")
        return value

    def scalar_map(self, name: str) -> dict[str, str | int | float | bool]:
        """A str -> scalar map (absent means empty)."""
        path = self.path(name)
        return {k: _check_scalar(v, _entry_path(path, k)) for k, v in self._map(name).items()}

    def float_map(self, name: str) -> dict[str, float]:
        """A str -> finite float map (absent means empty)."""
        path = self.path(name)
        return {k: _check_float(v, _entry_path(path, k), -math.inf, math.inf)
                for k, v in self._map(name).items()}

    def maps(self, name: str, *, min_len: int, max_len: int) -> list["FieldReader"]:
        """An array of maps, one reader per element (paths `name[i]`)."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, REQUIRED)
        path = self.path(name)
        if type(value) is not list:
            raise CodecError(path, f"expected an array, got {wire_type_name(value)}")
        if not min_len <= len(value) <= max_len:
            raise CodecError(path, f"must have {min_len} to {max_len} elements, got {len(value)}")
        return [FieldReader(item, f"{path}[{i}]") for i, item in enumerate(value)]

    def array(self, name: str, spec: ArraySpec, *, same_length_as: tuple[str, int] | None = None,
              default: object = REQUIRED):
        """A numeric array map `{dtype, length, data}`, viewed zero-copy (read-only).

        `same_length_as=(sibling, n)` requires the array to be as long as field `sibling`.
        Written flat rather than through a nested reader: it runs for every array of a group.
        """
        value = self._data.get(name)
        if value is None:
            return self._absent(name, default)
        if type(value) is not dict:
            raise CodecError(self.path(name), "expected an array map {dtype, length, data}, "
                                              f"got {wire_type_name(value)}")
        declared, length, data = value.get("dtype"), value.get("length"), value.get("data")
        if declared != spec.wire_dtype or type(length) is not int or type(data) not in _BLOB_TYPES:
            raise _array_parts_error(value, self.path(name), spec)
        if not spec.min_len <= length <= spec.max_len:
            raise CodecError(self.path(name), f"declared length {length} outside "
                                              f"[{spec.min_len}, {spec.max_len}]")
        if len(data) != length * spec.itemsize:
            raise CodecError(self.path(name), f"declared length {length} needs "
                                              f"{length * spec.itemsize} bytes of "
                                              f"{spec.wire_dtype}, data has {len(data)}")
        if same_length_as is not None and length != same_length_as[1]:
            raise CodecError(self.path(name), f"length {length} differs from {same_length_as[0]} "
                                              f"length {same_length_as[1]}")
        return np.frombuffer(data, spec.dtype)
