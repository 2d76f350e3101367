"""The codec bounds the work of any record: the object count, container lengths, tombstones.

Hostile records here are valid by the size limit and, but for their ignored fields, by the
schema: before `MAX_OBJECTS_PER_RECORD`, 8 MiB of empty containers in an unknown field took
~1.7 s to decode (and was accepted), a 1.4M-entry ignored map ~1 s; now each is rejected in
~30 ms. The tests check that the bound that stops the work early is the one that fires (its name
in the reason), not the time: the loop-stall measurement on the real broker is
`tests/kafka/test_hostile_wire.py`.
"""

import struct

import msgpack
import numpy as np
import pytest

from miles.errors import CodecError
from miles.protocol import (MAX_MAP_ENTRIES, MAX_RECORD_BYTES, MAX_SAMPLES_PER_GROUP,
                            TrajectoryGroup, decode, encode)
from miles.protocol.codec import unpack
from tests.factories import make_group, make_sample, pack_map, wire_map

def with_ignored_field(value: bytes, room: int = 0) -> bytes:
    """A valid group's encoding with one more (unknown, ignored) top-level field of raw msgpack
    `value`: the map header counts one more entry."""
    good = encode(make_group())
    assert good[0] & 0xF0 == 0x80  # a fixmap: its entry count is in the low nibble
    return bytes([good[0] + 1]) + good[1:] + msgpack.packb("junk") + value


def empty_arrays(total_bytes: int) -> bytes:
    """An array of arrays of empty arrays filling `total_bytes`: ~1 object per byte."""
    inner = msgpack.packb([[]] * (MAX_SAMPLES_PER_GROUP - 1))
    n = total_bytes // len(inner)
    return b"\xdc" + struct.pack(">H", n) + inner * n


def rejected_fast(data: bytes) -> CodecError:
    """The error decoding `data` raises (the callers check which bound raised it)."""
    with pytest.raises(CodecError) as info:
        decode(data)
    return info.value


def test_eight_mib_of_empty_containers_in_an_ignored_field_is_rejected_fast():
    data = with_ignored_field(empty_arrays(MAX_RECORD_BYTES - 4096))
    assert len(data) <= MAX_RECORD_BYTES
    error = rejected_fast(data)
    assert error.field == "record" and "MAX_OBJECTS_PER_RECORD" in error.reason, error


def test_empty_maps_count_as_objects():
    inner = msgpack.packb([{}] * (MAX_SAMPLES_PER_GROUP - 1))
    data = with_ignored_field(b"\xdc" + struct.pack(">H", 100) + inner * 100)
    assert "MAX_OBJECTS_PER_RECORD" in rejected_fast(data).reason


def test_a_huge_ignored_map_is_rejected_before_it_is_built():
    keys = (bytes([0xA3, a, b, c]) for a in range(128) for b in range(128) for c in range(128))
    n = 1_400_000
    body = b"".join(key + b"\x00" for _, key in zip(range(n), keys))
    data = with_ignored_field(b"\xdf" + struct.pack(">I", n) + body)
    assert len(data) <= MAX_RECORD_BYTES
    error = rejected_fast(data)
    assert error.field == "record" and error.reason.startswith(
        f"{n} exceeds max_map_len({MAX_MAP_ENTRIES}): no map of a record"), error


def test_too_many_objects_in_a_known_field_too():
    raw = wire_map(make_group())
    raw["metadata_like"] = [[None] * 4000 for _ in range(70)]  # 280k objects, all nil
    assert "MAX_OBJECTS_PER_RECORD" in rejected_fast(pack_map(raw)).reason


def test_the_largest_valid_group_is_within_the_object_bound():
    samples = [make_sample(1, seed=i, token_rewards=np.zeros(1, np.float32), error="e")
               for i in range(MAX_SAMPLES_PER_GROUP)]
    full = {f"k{i}": i for i in range(MAX_MAP_ENTRIES)}
    group = make_group(samples=samples, sampling=full,
                       timings={k: 1.0 for k in full})
    assert decode(encode(group), TrajectoryGroup) == group


def test_a_tombstone_is_a_codec_error_not_a_type_error():
    with pytest.raises(CodecError) as info:
        decode(None, TrajectoryGroup)
    assert info.value.field == "record" and "tombstone" in info.value.reason
    with pytest.raises(CodecError):
        unpack(None)


@pytest.mark.parametrize("value", [0, 7, -(1 << 63), (1 << 64) - 1])
def test_float_fields_accept_every_msgpack_int(value):
    raw = wire_map(make_group())
    raw["samples"][0]["reward"] = value
    assert decode(pack_map(raw)).samples[0].reward == float(value)
