"""Property tests of the codec: nothing but `CodecError` escapes `decode`, and valid groups
round-trip. Whatever `decode` accepts, `encode` accepts too (one definition of valid)."""

import copy

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from miles.errors import CodecError
from miles.protocol import (FINISH_REASONS, MAX_POLICY_VERSION, MAX_VOCAB_SIZE, RECORD_TYPES,
                            Sample, TrajectoryGroup, decode, encode)
from tests.factories import make_episode, make_group, make_records, pack_map, wire_map

VOCAB = 32_000
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = [encode(r) for r in make_records()] + [encode(make_group(n_samples=3, n_tokens=5)),
                                               encode(make_group(samples=[make_episode(
                                                   [(2, 3), (1, 1)], vocab_size=VOCAB)],
                                                   vocab_size=VOCAB))]
TYPE_NAMES = [t.wire_type for t in RECORD_TYPES]
INT64 = (-(2 ** 63), 2 ** 63 - 1)


def decodes_or_rejects(data: bytes) -> None:
    """`decode` either returns a record that `encode` accepts again, or raises `CodecError`."""
    try:
        record = decode(data)
    except CodecError:
        return
    encode(record)


# --- (a) arbitrary bytes ------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_only_raise_codec_error(data):
    decodes_or_rejects(data)


# --- (b) mutated and truncated valid encodings --------------------------------------------------

@st.composite
def mutated_encodings(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if action == "flip":
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif action == "set":
            data[position] = draw(st.integers(0, 255))
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del data[position:position + draw(st.integers(1, 8))]
        else:
            del data[position:]
        if not data:
            break
    return bytes(data)


@FUZZ
@given(mutated_encodings())
def test_mutated_encodings_only_raise_codec_error(data):
    decodes_or_rejects(data)


# --- (c) generated valid groups round-trip ------------------------------------------------------

finite_floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.one_of(st.text(max_size=8), st.integers(*INT64), finite_floats, st.booleans())
scalar_maps = st.dictionaries(st.text(max_size=8), scalars, max_size=4)


@st.composite
def samples(draw, vocab_size: int) -> Sample:
    n = draw(st.integers(1, 16))
    f32 = dict(width=32, allow_nan=False, allow_infinity=False)
    return Sample(
        response_token_ids=draw(arrays(np.int32, n, elements=st.integers(0, vocab_size - 1))),
        logprobs=draw(arrays(np.float32, n, elements=st.floats(max_value=0.0, **f32))),
        versions=draw(arrays(np.int32, n, elements=st.integers(0, MAX_POLICY_VERSION))),
        reward=draw(finite_floats),
        token_rewards=draw(st.none() | arrays(np.float32, n, elements=st.floats(**f32))),
        finish_reason=draw(st.sampled_from(FINISH_REASONS)),
        error=draw(st.none() | st.text(max_size=20)),
    )


@st.composite
def episodes(draw, vocab_size: int) -> Sample:
    """A multi-turn sample (1.4): turns of >= 1 policy token then >= 0 observation tokens."""
    turns = draw(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1,
                          max_size=4))
    single = draw(samples(vocab_size))
    n = sum(p + o for p, o in turns)
    episode = make_episode(turns, vocab_size=vocab_size, seed=draw(st.integers(0, 99)),
                           episode=draw(scalar_maps), reward=single.reward,
                           finish_reason=single.finish_reason)
    if draw(st.booleans()):
        episode = Sample(**{**vars(episode), "turn_ends": None})
    return Sample(**{**vars(episode), "response_token_ids": draw(arrays(
        np.int32, n, elements=st.integers(0, vocab_size - 1)))})


@st.composite
def groups(draw) -> TrajectoryGroup:
    vocab_size = draw(st.integers(1, MAX_VOCAB_SIZE))
    ids = st.integers(0, vocab_size - 1)
    return TrajectoryGroup(
        group_id=draw(st.text(min_size=1, max_size=12)),
        task_id=draw(st.text(min_size=1, max_size=12)),
        prompt_token_ids=draw(arrays(np.int32, st.integers(1, 16), elements=ids)),
        samples=draw(st.lists(samples(vocab_size) | episodes(vocab_size), min_size=1,
                              max_size=4)),
        producer_id=draw(st.text(min_size=1, max_size=12)),
        engine=draw(st.sampled_from(["hf", "vllm"])),
        vocab_size=vocab_size,
        sampling=draw(scalar_maps),
        reference=draw(st.none() | st.text(max_size=20)),
        timings=draw(st.dictionaries(st.text(max_size=8), finite_floats, max_size=3)),
        created_at=draw(st.floats(0.0, 4e9)),
    )


@settings(FUZZ, max_examples=150)
@given(groups())
def test_generated_groups_round_trip(group):
    decoded = decode(encode(group), expected=TrajectoryGroup)
    assert decoded == group
    assert decoded.min_version == min(int(v) for s in group.samples
                                      for v, m in zip(s.versions, s.policy_mask) if m)


# --- (d) arbitrary msgpack maps that claim a record type ----------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
    | st.floats() | st.text(max_size=10) | st.binary(max_size=10),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=10,
)
field_names = st.sampled_from(sorted({name for raw in map(wire_map, make_records())
                                      for name in raw} | {"samples", "logprobs", "data"}))


@FUZZ
@given(st.sampled_from(TYPE_NAMES), st.sampled_from([[1, 0], [1, 5], [2, 0], [1], None]),
       st.dictionaries(field_names | st.text(max_size=8), msgpack_values, max_size=10))
def test_arbitrary_maps_with_a_type_only_raise_codec_error(type_name, schema, fields):
    decodes_or_rejects(pack_map({**fields, "type": type_name, "schema": schema}))


# --- (e) one field of a valid record replaced by anything ---------------------------------------

def _paths(value, prefix=()):
    """The key path of every value nested in a raw map, through maps and arrays alike."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


RAW = [wire_map(r) for r in make_records()]


@FUZZ
@given(st.data(), msgpack_values)
def test_any_field_replaced_by_anything_only_raises_codec_error(data, replacement):
    raw = copy.deepcopy(data.draw(st.sampled_from(RAW)))
    path = data.draw(st.sampled_from(list(_paths(raw))))
    container = raw
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = replacement
    decodes_or_rejects(pack_map(raw))

