"""The msgpack codec: round trips, the array encoding, zero-copy decode, and every rejection."""

import enum
import math
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest

from miles.errors import CodecError
from miles.protocol import (MAX_DEAD_LETTER_PAYLOAD_BYTES, MAX_RECORD_BYTES, MAX_SAMPLES_PER_GROUP,
                            MAX_TOKENS_PER_SEQUENCE, SCHEMA_VERSION, Command, DeadLetter,
                            PromptTask, TrajectoryGroup, WeightVersion, decode, encode)
from miles.protocol.fields import FieldReader
from miles.protocol.records import dead_letter_key, failed_episode_kind, failed_episode_reason
from miles.protocol.schema import read_plain_sample, read_sample
from tests.factories import (VOCAB_SIZE, array_map, make_command, make_dead_letter, make_group,
                             make_heartbeat, make_prompt_task, make_records, make_sample,
                             make_weight_version, pack_map, wire_map)


def rejected(data: bytes, **kwargs) -> CodecError:
    with pytest.raises(CodecError) as info:
        decode(data, **kwargs)
    return info.value


def tampered(record, change) -> bytes:
    """The encoding of `record` after `change(wire_map)` edited its raw map in place."""
    raw = wire_map(record)
    change(raw)
    return pack_map(raw)


# --- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("record", make_records(), ids=lambda r: type(r).__name__)
def test_every_record_type_round_trips(record):
    decoded = decode(encode(record))
    assert type(decoded) is type(record)
    assert decoded == record


def test_group_arrays_round_trip_with_wire_dtypes():
    group = make_group(n_samples=3, n_tokens=50, prompt_tokens=7)
    group = TrajectoryGroup(**{**vars(group), "samples": [
        make_sample(50, seed=1, token_rewards=np.linspace(-1, 1, 50, dtype=np.float32),
                    error="reward timed out"),
        *group.samples[1:]]})
    decoded = decode(encode(group))
    np.testing.assert_array_equal(decoded.prompt_token_ids, group.prompt_token_ids)
    for got, want in zip(decoded.samples, group.samples, strict=True):
        for name in ("response_token_ids", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        assert got.response_token_ids.dtype == np.dtype("<i4")
        assert got.logprobs.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(decoded.samples[0].token_rewards, group.samples[0].token_rewards)
    assert decoded.samples[0].error == "reward timed out"
    assert decoded.samples[1].token_rewards is None


def test_decoded_arrays_are_read_only_views_over_the_received_bytes():
    data = encode(make_group(n_samples=2, n_tokens=64))
    logprobs = decode(data).samples[1].logprobs
    assert not logprobs.flags.owndata and not logprobs.flags.writeable
    assert isinstance(logprobs.base, bytes)  # the bin msgpack unpacked, viewed without a copy
    assert logprobs.base in data


def test_envelope_and_array_maps_on_the_wire():
    raw = wire_map(make_group(n_samples=1, n_tokens=5))
    assert raw["type"] == "trajectory_group" and raw["schema"] == list(SCHEMA_VERSION)
    ids = raw["samples"][0]["response_token_ids"]
    assert ids["dtype"] == "<i4" and ids["length"] == 5 and type(ids["data"]) is bytes
    assert len(ids["data"]) == 20
    assert raw["samples"][0]["logprobs"]["dtype"] == "<f4"


def test_unset_optional_fields_are_left_off_the_wire():
    raw = wire_map(make_group(n_samples=1, n_tokens=3, reference=None))
    assert "reference" not in raw and not {"token_rewards", "error"} & raw["samples"][0].keys()


def test_defaults_may_be_absent_or_nil_on_the_wire():
    raw = wire_map(make_prompt_task())
    for name in ("prompt_token_ids", "reference", "epoch", "metadata"):
        del raw[name]
    task = decode(pack_map(raw))
    assert (task.prompt_token_ids, task.reference, task.epoch, task.metadata) == (None, None, 0, {})
    raw = wire_map(make_command())
    raw["target"] = None
    assert decode(pack_map(raw)).target == "*"


def test_group_min_version_and_lag():
    group = make_group(n_samples=3, n_tokens=8, policy_version=5)
    assert group.min_version == 5
    assert group.lag(9) == 4


def test_records_compare_arrays_by_value():
    assert make_group(seed=1) == make_group(seed=1)
    assert make_group(seed=1) != make_group(seed=2)
    assert make_command() != make_command(command="stop")


def test_dead_letter_for_payload_truncates_and_keeps_the_size():
    payload = b"x" * (MAX_DEAD_LETTER_PAYLOAD_BYTES + 10)
    letter = DeadLetter.for_payload(reason="bad", source_topic="t", source_partition=0,
                                    source_offset=1, payload=payload, created_at=1.0)
    assert len(letter.payload) == MAX_DEAD_LETTER_PAYLOAD_BYTES
    assert letter.payload_size == len(payload)
    assert decode(encode(letter)) == letter


def test_failed_episode_letters_have_a_kind_and_a_key_each():
    reason = failed_episode_reason("env_timeout: step took longer than 5 s")
    assert reason == "episode failed: env_timeout: step took longer than 5 s"
    assert failed_episode_kind(reason) == "env_timeout"
    assert failed_episode_kind("samples[0].logprobs: not finite") is None
    assert dead_letter_key("g", "t", 1, 7) == b"g/t/1/7"
    assert dead_letter_key("g", "t", 1, 7, "episode-2") == b"g/t/1/7/episode-2"


# --- encode: friendly conversions and the same checks as decode ---------------------------------

class Reason(enum.StrEnum):
    STOP = "stop"


def test_encode_casts_arrays_and_unwraps_numpy_and_enum_scalars():
    sample = make_sample(4, response_token_ids=np.array([1, 2, 3, 4], dtype=np.int64),
                         logprobs=np.array([-1.0, -0.5, 0.0, -2.0]), reward=np.float32(0.5),
                         finish_reason=Reason.STOP)
    group = make_group(samples=[sample], vocab_size=np.int64(100),
                       prompt_token_ids=np.array([1, 2], dtype=np.int64))
    decoded = decode(encode(group))
    assert decoded.samples[0].response_token_ids.dtype == np.dtype("<i4")
    assert decoded.samples[0].logprobs.tolist() == [-1.0, -0.5, 0.0, -2.0]
    assert type(decoded.samples[0].reward) is float and decoded.samples[0].finish_reason == "stop"
    assert type(decoded.vocab_size) is int


@pytest.mark.parametrize("change, field, reason", [
    (dict(response_token_ids=np.array([1, 2 ** 40, 3, 4], dtype=np.int64)),
     "samples[0].response_token_ids", "outside the <i4 range"),
    (dict(response_token_ids=np.array([1.0, 2.0, 3.0, 4.0])),
     "samples[0].response_token_ids", "cannot be cast"),
    (dict(response_token_ids=np.ones((2, 2), dtype=np.int32)),
     "samples[0].response_token_ids", "1-D"),
    (dict(logprobs=[-1.0, -1.0, -1.0, -1.0]), "samples[0].logprobs", "expected a numpy array"),
    (dict(logprobs=np.array([-1.0, np.nan, -1.0, -1.0], dtype=np.float32)),
     "samples[0].logprobs", "not finite"),
    (dict(versions=np.array([1, 1], dtype=np.int32)), "samples[0].versions", "differs"),
    (dict(finish_reason="eos"), "samples[0].finish_reason", "must be one of"),
    (dict(reward=math.inf), "samples[0].reward", "finite"),
])
def test_encode_rejects_what_decode_would(change, field, reason):
    group = make_group(samples=[make_sample(4, **change)])
    with pytest.raises(CodecError) as info:
        encode(group)
    assert info.value.field == field and reason in info.value.reason
    assert decode(encode(make_group())) == make_group()  # the encoder is still usable


def test_encode_rejects_records_over_the_size_limit():
    with pytest.raises(CodecError) as info:
        encode(make_prompt_task(prompt="x" * MAX_RECORD_BYTES))
    assert info.value.field == "record" and "MAX_RECORD_BYTES" in info.value.reason


def test_encode_rejects_ints_beyond_int64():
    with pytest.raises(CodecError) as info:
        encode(make_prompt_task(metadata={"big": 10 ** 5000}))
    assert info.value.field == "metadata.big"


def test_wrong_argument_types_are_programming_errors():
    with pytest.raises(TypeError):
        encode({"type": "command"})
    with pytest.raises(TypeError):
        decode("not bytes")


# --- decode rejections --------------------------------------------------------------------------

GROUP = make_group(n_samples=4, n_tokens=6)


def _locate(raw, path: str):
    """(container, key) of a dotted `samples[3].logprobs` style path inside a raw map."""
    *parents, last = path.replace("[", ".").replace("]", "").split(".")
    for key in parents:
        raw = raw[int(key)] if isinstance(raw, list) else raw[key]
    return raw, int(last) if isinstance(raw, list) else last


def _set(path: str, value):
    """A change that sets the field at `path` to `value`."""
    def change(raw):
        container, key = _locate(raw, path)
        container[key] = value
    return change


def _delete(path: str):
    def change(raw):
        container, key = _locate(raw, path)
        del container[key]
    return change


NAN, INF = float("nan"), float("inf")
TOO_LONG = MAX_TOKENS_PER_SEQUENCE + 1

DECODE_REJECTIONS = [
    # wrong types
    (_set("group_id", 5), "group_id", "expected a str, got int"),
    (_set("vocab_size", True), "vocab_size", "expected an int, got bool"),
    (_set("samples", {}), "samples", "expected an array, got map"),
    (_set("samples[1]", [1]), "samples[1]", "expected a map, got array"),
    (_set("samples[0].reward", "1.0"), "samples[0].reward", "expected a float, got str"),
    (_set("samples[2].logprobs", [-1.0] * 6), "samples[2].logprobs", "expected an array map"),
    (_set("samples[2].logprobs.data", "abc"), "samples[2].logprobs.data", "expected a bin"),
    (_set("samples[2].logprobs.length", 6.0), "samples[2].logprobs.length", "expected an int"),
    (_set("sampling", {"temperature": [1.0]}), "sampling.temperature", "expected a str, int"),
    (_set("sampling", {b"k": 1}), "sampling", "is not a str"),
    (_set("timings", {"generate_s": "fast"}), "timings.generate_s", "expected a float"),
    # missing required fields (nil counts as missing)
    (_delete("samples[0].reward"), "samples[0].reward", "missing required field"),
    (_delete("samples[3].versions"), "samples[3].versions", "missing required field"),
    (_set("created_at", None), "created_at", "missing required field"),
    (_delete("samples[1].logprobs.dtype"), "samples[1].logprobs.dtype", "missing required field"),
    # dtypes and lengths
    (_set("samples[3].logprobs", array_map([-1.0] * 6, "<f8")), "samples[3].logprobs",
     "dtype '<f8' not allowed, expected '<f4'"),
    (_set("samples[0].response_token_ids", array_map([1] * 6, ">i4")),
     "samples[0].response_token_ids", "dtype '>i4' not allowed"),
    (_set("samples[1].versions.length", 7), "samples[1].versions",
     "declared length 7 needs 28 bytes of <i4, data has 24"),
    (_set("samples[1].versions", array_map([1] * 5, "<i4")), "samples[1].versions",
     "length 5 differs from response_token_ids length 6"),
    (_set("samples[2].token_rewards", array_map([0.0] * 7, "<f4")), "samples[2].token_rewards",
     "length 7 differs from response_token_ids length 6"),
    (_set("samples[0].response_token_ids", {"dtype": "<i4", "length": TOO_LONG, "data": b""}),
     "samples[0].response_token_ids", f"declared length {TOO_LONG} outside [1, {TOO_LONG - 1}]"),
    (_set("samples[0].response_token_ids", array_map([], "<i4")),
     "samples[0].response_token_ids", "declared length 0 outside"),
    (_set("samples", []), "samples", f"must have 1 to {MAX_SAMPLES_PER_GROUP} elements, got 0"),
    # values
    (_set("samples[3].logprobs", array_map([-1, -1, NAN, -1, -1, -1], "<f4")),
     "samples[3].logprobs", "logprob nan at index 2 is not finite"),
    (_set("samples[1].logprobs", array_map([-1, -1, -1, -1, -1, -INF], "<f4")),
     "samples[1].logprobs", "logprob -inf at index 5 is not finite"),
    (_set("samples[2].logprobs", array_map([-1, 0.5, -1, -1, -1, -1], "<f4")),
     "samples[2].logprobs", "logprob 0.5 at index 1 is positive"),
    (_set("samples[0].token_rewards", array_map([0, 0, 0, INF, 0, 0], "<f4")),
     "samples[0].token_rewards", "value inf at index 3 is not finite"),
    (_set("samples[2].response_token_ids", array_map([1, 2, VOCAB_SIZE, 4, 5, 6], "<i4")),
     "samples[2].response_token_ids",
     f"token id {VOCAB_SIZE} at index 2 outside [0, {VOCAB_SIZE})"),
    (_set("samples[1].response_token_ids", array_map([1, -3, 1, 1, 1, 1], "<i4")),
     "samples[1].response_token_ids", "token id -3 at index 1 outside"),
    (_set("prompt_token_ids", array_map([0, VOCAB_SIZE + 5], "<i4")), "prompt_token_ids",
     "outside [0, "),
    (_set("samples[3].versions", array_map([2, 2, 2, -1, 3, 3], "<i4")), "samples[3].versions",
     "negative policy version -1 at index 3"),
    (_set("samples[0].reward", NAN), "samples[0].reward", "must be finite"),
    (_set("samples[0].finish_reason", "eos"), "samples[0].finish_reason",
     "must be one of stop, length, abort; got 'eos'"),
    (_set("vocab_size", 0), "vocab_size", "must be in [1, "),
    (_set("group_id", ""), "group_id", "must not be empty"),
    (_set("created_at", -1.0), "created_at", "must be in [0.0, inf]"),
    # envelope
    (_set("type", "trajectory"), "type", "unknown record type 'trajectory'; known: prompt_task"),
    (_delete("type"), "type", "missing required field"),
    (_set("schema", [2, 0]), "schema",
     "record has schema 2.0, this reader reads major version 1 (schema 1.4); upgrade"),
    (_set("schema", [0, 9]), "schema", "record has schema 0.9"),
    (_set("schema", "1.0"), "schema", "expected an array of 2 ints"),
    (_delete("schema"), "schema", "missing required field"),
]


@pytest.mark.parametrize("change, field, reason", DECODE_REJECTIONS,
                         ids=[f"{i}-{case[1]}" for i, case in enumerate(DECODE_REJECTIONS)])
def test_decode_rejects(change, field, reason):
    error = rejected(tampered(GROUP, change))
    assert error.field == field
    assert reason in error.reason, error.reason


def test_decode_rejects_more_samples_than_the_limit():
    raw = wire_map(make_group(n_samples=1, n_tokens=1))
    raw["samples"] = raw["samples"] * (MAX_SAMPLES_PER_GROUP + 1)
    error = rejected(pack_map(raw))  # by the unpacker, before any sample is built
    assert error.field == "record" and error.reason.startswith(
        f"{MAX_SAMPLES_PER_GROUP + 1} exceeds max_array_len({MAX_SAMPLES_PER_GROUP}): no array")


@pytest.mark.parametrize("record, change, field, reason", [
    (make_weight_version(), _set("sha256", "AB" * 32), "sha256", "64 lowercase hex digits"),
    (make_weight_version(), _set("format", "gguf"), "format", "must be one of lora, full"),
    (make_weight_version(), _set("policy_version", -1), "policy_version", "must be in [0, "),
    (make_weight_version(), _set("trainer_generation", -2), "trainer_generation",
     "must be in [0, "),
    (make_heartbeat(), _set("trainer_generation", 1 << 31), "trainer_generation",
     "must be in [0, "),
    (make_command(), _set("command", "reboot"), "command", "must be one of pause, resume"),
    (make_heartbeat(), _set("tokens_per_s", -1.0), "tokens_per_s", "must be in [0.0, inf]"),
    (make_heartbeat(), _set("extra", {"x": None}), "extra.x", "got nil"),
    (make_dead_letter(), _set("payload", b"x" * (MAX_DEAD_LETTER_PAYLOAD_BYTES + 1)), "payload",
     "exceed the cap"),
    (make_dead_letter(), _set("payload_size", 1), "payload_size", "must be in [6, "),
    (make_prompt_task(), _set("epoch", -1), "epoch", "must be in [0, "),
    (make_prompt_task(), _set("prompt_token_ids", array_map([1, -1], "<i4")), "prompt_token_ids",
     "token id -1 at index 1"),
])
def test_decode_rejects_control_and_status_records(record, change, field, reason):
    error = rejected(tampered(record, change))
    assert (error.field, reason in error.reason) == (field, True), error


@pytest.mark.parametrize("data, reason", [
    (b"", "incomplete input"),
    (encode(GROUP)[:-7], "incomplete input"),
    (encode(GROUP) + b"\x00", "extra data"),
    (b"\xc1", "FormatError"),
    (b"\x81\xa4type\xa2\xff\xfe", "UnicodeDecodeError"),
    (b"\x81\xa4type\xd4\x05\x00", "exceeds max_ext_len"),
    (b"\x81\xa4type\xc7\x00\x05", "ext type 5 is not allowed"),
    (b"\x81\x01\x01", "not allowed for map key"),
])
def test_decode_wraps_msgpack_errors(data, reason):
    error = rejected(data)
    assert error.field == "record" and reason in error.reason, error


def test_decode_rejects_a_non_map_record():
    error = rejected(pack_map([1, 2, 3]))
    assert (error.field, error.reason) == ("record", "expected a map, got array")


def test_decode_rejects_input_over_the_size_limit_before_unpacking():
    error = rejected(b"\x00" * (MAX_RECORD_BYTES + 1))
    assert error.field == "record" and "MAX_RECORD_BYTES" in error.reason


def test_newer_minor_schema_and_unknown_fields_are_read():
    def change(raw):
        raw["schema"] = [SCHEMA_VERSION[0], SCHEMA_VERSION[1] + 3]
        raw["new_top_level"] = {"anything": [1, 2]}
        raw["samples"][0]["new_sample_field"] = b"\x00"
        raw["samples"][0]["logprobs"]["new_array_field"] = "x"
    assert decode(tampered(GROUP, change)) == GROUP


def test_fast_and_general_sample_readers_agree():
    group = make_group(samples=[
        make_sample(5, seed=1),
        make_sample(5, seed=2, token_rewards=np.linspace(-1, 1, 5, dtype=np.float32), error="e")])
    for i, item in enumerate(wire_map(group)["samples"]):
        fast = read_plain_sample(item)
        assert fast is not None and type(fast) is type(group.samples[i])
        assert fast == read_sample(FieldReader(item, f"samples[{i}]")) == group.samples[i]


def test_valid_samples_off_the_fast_path_are_read():
    decoded = decode(tampered(GROUP, _set("samples[1].reward", 1)))  # another writer's int
    assert type(decoded.samples[1].reward) is float and decoded.samples[1].reward == 1.0
    assert decoded.samples[0] == GROUP.samples[0]


def test_expected_type_is_enforced():
    data = encode(GROUP)
    assert decode(data, expected=TrajectoryGroup) == GROUP
    assert decode(data, expected=(Command, TrajectoryGroup)) == GROUP
    error = rejected(data, expected=(WeightVersion, Command))
    assert (error.field, error.reason) == (
        "type", "expected weight_version or command, got trajectory_group")
    error = rejected(encode(make_heartbeat()), expected=PromptTask)
    assert error.reason == "expected prompt_task, got heartbeat"


def test_error_messages_do_not_echo_huge_values():
    error = rejected(tampered(GROUP, _set("type", "x" * 100_000)))
    assert len(str(error)) < 300


def test_decode_accepts_any_bytes_like_input():
    data = encode(GROUP)
    assert decode(bytearray(data)) == GROUP
    assert decode(memoryview(data)) == GROUP


def test_encode_is_safe_across_threads():
    groups = [make_group(n_samples=2, n_tokens=300, seed=i) for i in range(32)]
    expected = [encode(g) for g in groups]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(5):
            assert list(pool.map(encode, groups)) == expected


def test_schema_1_0_groups_without_epoch_still_read_as_epoch_0():
    body = msgpack.unpackb(encode(make_group(epoch=3)), raw=False)
    assert decode(encode(make_group(epoch=3)), TrajectoryGroup).epoch == 3
    del body["epoch"]
    body["schema"] = [1, 0]
    assert decode(msgpack.packb(body, use_bin_type=True), TrajectoryGroup).epoch == 0


def test_schema_1_1_control_records_read_as_generation_0():
    version = make_weight_version(trainer_generation=4)
    assert decode(encode(version), WeightVersion).trainer_generation == 4
    body = msgpack.unpackb(encode(version), raw=False)
    del body["trainer_generation"]
    body["schema"] = [1, 1]
    assert decode(msgpack.packb(body, use_bin_type=True), WeightVersion).trainer_generation == 0
