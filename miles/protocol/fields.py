"""Typed, path-aware reading of one decoded msgpack map: the codec's only way into wire data.

Each accessor checks presence, the exact msgpack type and the range of one field, and raises
`CodecError` naming its dotted path (`samples[3].logprobs`), so the per-record readers in
`schema` stay short lists of field reads. Keys nobody asks for are never looked at, which is what
makes unknown fields tolerated.

Choices: types are exact (`type(v) is int`), as msgpack produces them; a bool is not an int; an
int is accepted where a float is expected (other writers may pack 1.0 as 1); nil is the same as
an absent field; floats must be finite everywhere. Arrays are `{dtype, length, data}` maps whose
`data` is viewed in place with `numpy.frombuffer` (no copy, read-only). A valid value costs a few
`type() is` tests; paths and messages are built only for an error (`ArraySpec.view` tests an array
map, `_array_error` explains a failure), since these checks run for every field of every record.
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


def _check_scalar(value: object, map_path: str, key: str) -> str | int | float | bool:
    """An entry of a scalar map; like the other map checks, builds the entry's path for errors
    only (maps come with every record)."""
    if (type(value) is str or type(value) is bool or (type(value) is float and math.isfinite(value))
            or (type(value) is int and INT64_MIN <= value <= INT64_MAX)):
        return value
    path = _entry_path(map_path, key)
    if type(value) is int:
        return _check_int(value, path, INT64_MIN, INT64_MAX)
    if type(value) is float:
        return _check_float(value, path, -math.inf, math.inf)
    raise CodecError(path, f"expected a str, int, float or bool, got {wire_type_name(value)}")


def _check_map_float(value: object, map_path: str, key: str) -> float:
    """An entry of a float map (see `_check_scalar`)."""
    if type(value) is float and math.isfinite(value):
        return value
    return _check_float(value, _entry_path(map_path, key), -math.inf, math.inf)


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

    def view(self, value: object, length: int | None = None) -> np.ndarray | None:
        """`value` viewed zero-copy (read-only) if it is a valid array map `{dtype, length, data}`
        of this spec (and of `length` elements when given), else None.

        Only says whether: `FieldReader.array` names what is wrong. It is the one test of an array
        map, flat and without paths or messages since it runs for every array of a group.
        """
        if type(value) is not dict:
            return None
        n, data = value.get("length"), value.get("data")
        if (value.get("dtype") != self.wire_dtype or type(n) is not int
                or type(data) not in _BLOB_TYPES or not self.min_len <= n <= self.max_len
                or len(data) != n * self.itemsize or (length is not None and n != length)):
            return None
        return np.frombuffer(data, self.dtype)


def _array_error(value: object, path: str, spec: ArraySpec,
                 same_length_as: tuple[str, int] | None) -> CodecError:
    """Why `value` is not a valid array map (`spec.view` returned None), in the order a reader
    would check: the map, its parts, the declared length, the data size, the sibling length."""
    if type(value) is not dict:
        return CodecError(path, f"expected an array map {{dtype, length, data}}, "
                                f"got {wire_type_name(value)}")
    declared, length, data = value.get("dtype"), value.get("length"), value.get("data")
    if declared != spec.wire_dtype or type(length) is not int or type(data) not in _BLOB_TYPES:
        parts = FieldReader(value, path)
        parts.string("dtype")  # each raises if its part is absent or of the wrong type
        parts.integer("length")
        parts.blob("data", max_len=INT64_MAX)
        return CodecError(path, f"dtype {preview(declared)} not allowed, "
                                f"expected {spec.wire_dtype!r}")
    if not spec.min_len <= length <= spec.max_len:
        return CodecError(path, f"declared length {length} outside "
                                f"[{spec.min_len}, {spec.max_len}]")
    if len(data) != length * spec.itemsize:
        return CodecError(path, f"declared length {length} needs {length * spec.itemsize} bytes "
                                f"of {spec.wire_dtype}, data has {len(data)}")
    if same_length_as is not None and length != same_length_as[1]:
        return CodecError(path, f"length {length} differs from {same_length_as[0]} "
                                f"length {same_length_as[1]}")
    raise AssertionError("ArraySpec.view() and _array_error() disagree")  # a bug here


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
        if type(value) is int and lo <= value <= hi:  # the common case, without building a path
            return value
        return _check_int(value, self.path(name), lo, hi)

    def number(self, name: str, *, lo: float = -math.inf, hi: float = math.inf,
               default: object = REQUIRED):
        """A finite float in [lo, hi] (an int is widened)."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, default)
        if type(value) is float and lo <= value <= hi and math.isfinite(value):  # as `integer`
            return value
        return _check_float(value, self.path(name), lo, hi)

    def integers(self, name: str, *, count: int, lo: int = 0, hi: int = INT64_MAX) -> list[int]:
        """An array of exactly `count` ints in [lo, hi]."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, REQUIRED)
        if type(value) is not list or len(value) != count:
            got = preview(value) + (f" of {len(value)}" if type(value) is list else "")
            raise CodecError(self.path(name), f"expected an array of {count} ints, got {got}")
        return [v if type(v) is int and lo <= v <= hi  # as `integer`
                else _check_int(v, f"{self.path(name)}[{i}]", lo, hi) for i, v in enumerate(value)]

    def absent(self, name: str) -> bool:
        """Whether field `name` is absent or nil (an optional field then takes its default)."""
        return self._data.get(name) is None

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

    def _map(self, name: str, max_entries: int = MAX_MAP_ENTRIES,
             bound: str = "MAX_MAP_ENTRIES") -> dict:
        value = self._data.get(name)
        if value is None:
            return {}
        if type(value) is not dict:
            raise CodecError(self.path(name), f"expected a map, got {wire_type_name(value)}")
        if len(value) > max_entries:
            raise CodecError(self.path(name), f"{len(value)} entries exceed {bound} "
                                              f"({max_entries})")
        for key in value:
            if type(key) is not str:
                raise CodecError(self.path(name), f"key {preview(key)} is not a str")
        return value

    def scalar_map(self, name: str, *, max_entries: int = MAX_MAP_ENTRIES,
                   bound: str = "MAX_MAP_ENTRIES") -> dict[str, str | int | float | bool]:
        """A str -> scalar map (absent means empty) of at most `max_entries` (named `bound`)."""
        path = self.path(name)
        return {k: _check_scalar(v, path, k)
                for k, v in self._map(name, max_entries, bound).items()}

    def float_map(self, name: str) -> dict[str, float]:
        """A str -> finite float map (absent means empty)."""
        path = self.path(name)
        return {k: _check_map_float(v, path, k) for k, v in self._map(name).items()}

    def elements(self, name: str, *, min_len: int, max_len: int) -> list:
        """An array of `min_len` to `max_len` elements, left unchecked for the caller to read
        (`element(name, i, item)` wraps a map element in a reader)."""
        value = self._data.get(name)
        if value is None:
            return self._absent(name, REQUIRED)
        if type(value) is not list:
            raise CodecError(self.path(name), f"expected an array, got {wire_type_name(value)}")
        if not min_len <= len(value) <= max_len:
            raise CodecError(self.path(name),
                             f"must have {min_len} to {max_len} elements, got {len(value)}")
        return value

    def element(self, name: str, index: int, item: object) -> "FieldReader":
        """A reader of map `item`, element `index` of array `name` (path `name[index]`)."""
        return FieldReader(item, f"{self.path(name)}[{index}]")

    def array(self, name: str, spec: ArraySpec, *, same_length_as: tuple[str, int] | None = None,
              default: object = REQUIRED):
        """A numeric array map `{dtype, length, data}`, viewed zero-copy (read-only).

        `same_length_as=(sibling, n)` requires the array to be as long as field `sibling`.
        """
        value = self._data.get(name)
        if value is None:
            return self._absent(name, default)
        array = spec.view(value, None if same_length_as is None else same_length_as[1])
        if array is None:
            raise _array_error(value, self.path(name), spec, same_length_as)
        return array
