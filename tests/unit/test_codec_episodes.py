"""Episodes on the wire (schema 1.4): `loss_mask`, `turn_ends`, `episode`, -1 versions.

Each rule has its rejection and the boundary that is admitted; old (1.3) samples still decode
and mean what they did; an episode round-trips through the fast and the general reader alike.
"""

import msgpack
import numpy as np
import pytest

from miles.errors import CodecError
from miles.protocol import (MAX_SAMPLES_PER_GROUP, SCHEMA_VERSION, Sample, TrajectoryGroup,
                            decode, encode)
from miles.protocol.fields import FieldReader
from miles.protocol.limits import MAX_EPISODE_ENTRIES
from miles.protocol.schema import read_plain_sample, read_sample
from tests.factories import array_map, make_episode, make_group, make_sample, pack_map, wire_map

TURNS = [(2, 3), (1, 2), (2, 0)]  # T = 10: mask 1 1 0 0 0 1 0 0 1 1, turn_ends 5 8 10
EPISODE = make_episode(TURNS, policy_version=4)
GROUP = make_group(samples=[EPISODE, make_sample(6, seed=1)])


def test_the_schema_is_1_4():
    assert SCHEMA_VERSION == (1, 4)


def test_an_episode_round_trips():
    decoded = decode(encode(GROUP), TrajectoryGroup)
    assert decoded == GROUP
    got = decoded.samples[0]
    assert got.loss_mask.dtype == np.dtype("|u1") and got.loss_mask.tolist() == \
        [1, 1, 0, 0, 0, 1, 0, 0, 1, 1]
    assert got.turn_ends.tolist() == [5, 8, 10] and got.turn_ends.dtype == np.dtype("<i4")
    assert got.versions.tolist() == [4, 4, -1, -1, -1, 5, -1, -1, 6, 6]
    assert got.episode == {"turns": 3, "tool_calls": 2, "tool_errors": 0, "env_s": 0.25}
    assert got.policy_tokens == 5 and got.policy_versions.tolist() == [4, 4, 5, 6, 6]
    assert decoded.min_version == 3  # the single-turn sample's; the episode's -1 is left out


def test_the_episode_fields_on_the_wire():
    raw = wire_map(GROUP)["samples"][0]
    assert raw["loss_mask"]["dtype"] == "|u1" and len(raw["loss_mask"]["data"]) == 10
    assert raw["turn_ends"] == {"dtype": "<i4", "length": 3,
                                "data": np.array([5, 8, 10], "<i4").tobytes()}
    assert raw["episode"]["turns"] == 3


def test_fast_and_general_readers_agree_on_an_episode():
    item = wire_map(GROUP)["samples"][0]
    fast = read_plain_sample(item)
    assert fast is not None  # episodes take the fast path too
    assert fast == read_sample(FieldReader(item, "samples[0]")) == EPISODE


def test_an_episode_of_only_policy_tokens_with_a_min_version_of_its_own():
    group = make_group(samples=[make_episode([(3, 0)], policy_version=7)])
    assert decode(encode(group)).min_version == 7


def test_single_turn_samples_carry_no_episode_fields():
    raw = wire_map(make_group(n_samples=1))["samples"][0]
    assert not {"loss_mask", "turn_ends", "episode"} & raw.keys()
    sample = decode(encode(make_group(n_samples=1))).samples[0]
    assert (sample.loss_mask, sample.turn_ends, sample.episode) == (None, None, {})
    assert sample.policy_mask.all() and sample.policy_tokens == 8


def test_a_schema_1_3_group_still_reads_as_single_turn():
    body = msgpack.unpackb(encode(make_group(n_samples=2)), raw=False)
    body["schema"] = [1, 3]
    group = decode(msgpack.packb(body, use_bin_type=True), TrajectoryGroup)
    assert group == make_group(n_samples=2)
    assert all(s.loss_mask is None and s.episode == {} for s in group.samples)


def test_encode_takes_a_bool_or_int64_mask():
    for mask in (EPISODE.loss_mask.astype(bool), EPISODE.loss_mask.astype(np.int64)):
        sample = Sample(**{**vars(EPISODE), "loss_mask": mask})
        decoded = decode(encode(make_group(samples=[sample]))).samples[0]
        assert decoded.loss_mask.dtype == np.dtype("|u1") and decoded == EPISODE
    bad = Sample(**{**vars(EPISODE), "loss_mask": EPISODE.loss_mask.astype(np.int64) * 300})
    with pytest.raises(CodecError, match="outside the |u1 range"):
        encode(make_group(samples=[bad]))


def _episode_with(**changes) -> bytes:
    raw = wire_map(make_group(samples=[EPISODE]))
    raw["samples"][0].update(changes)
    return pack_map(raw)


def _mask(values):
    return array_map(values, "|u1")


def _versions(values):
    return array_map(values, "<i4")


def _ends(values):
    return array_map(values, "<i4")


MASK = [1, 1, 0, 0, 0, 1, 0, 0, 1, 1]
VERSIONS = [4, 4, -1, -1, -1, 5, -1, -1, 6, 6]
ONE_POLICY_TOKEN = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]

# (changes, field, reason) rejected, and the admitted boundary next to each
REJECTED = [
    (dict(loss_mask=_mask([1, 1, 0, 0, 0, 2, 0, 0, 1, 1])), "samples[0].loss_mask",
     "value 2 at index 5 is not 0 or 1"),
    (dict(loss_mask=_mask([0] * 10), versions=_versions([-1] * 10), turn_ends=None),
     "samples[0].loss_mask", "no policy token (every entry is 0)"),
    (dict(loss_mask=_mask(MASK[:9])), "samples[0].loss_mask",
     "length 9 differs from response_token_ids length 10"),
    (dict(loss_mask=array_map(MASK, "<i4")), "samples[0].loss_mask",
     "dtype '<i4' not allowed, expected '|u1'"),
    (dict(versions=_versions([4, 4, -1, 0, -1, 5, -1, -1, 6, 6])), "samples[0].versions",
     "version 0 at index 3 must be -1 (an observation token, loss_mask 0)"),
    (dict(versions=_versions([4, -1, -1, -1, -1, 5, -1, -1, 6, 6])), "samples[0].versions",
     "negative policy version -1 at index 1 (a policy token, loss_mask 1)"),
    (dict(versions=_versions([4, 4, -2, -1, -1, 5, -1, -1, 6, 6])), "samples[0].versions",
     "version -2 at index 2 must be -1"),
    (dict(turn_ends=_ends([0, 5, 8, 10])), "samples[0].turn_ends", "first turn end 0 must be >= 1"),
    (dict(turn_ends=_ends([5, 5, 10])), "samples[0].turn_ends",
     "not strictly increasing: 5 at index 1 after 5"),
    (dict(turn_ends=_ends([5, 8, 9])), "samples[0].turn_ends",
     "last turn end 9 must equal the response length 10"),
    (dict(turn_ends=_ends([5, 8, 11])), "samples[0].turn_ends",
     "last turn end 11 must equal the response length 10"),
    (dict(turn_ends=_ends([3, 8, 10])), "samples[0].turn_ends",
     "turn 1 (tokens 3..8) starts with an observation token"),
    (dict(turn_ends=_ends([8, 10])), "samples[0].turn_ends",
     "policy token at index 5 follows an observation token inside turn 0"),
    (dict(episode={f"k{i}": i for i in range(MAX_EPISODE_ENTRIES + 1)}), "samples[0].episode",
     f"{MAX_EPISODE_ENTRIES + 1} entries exceed MAX_EPISODE_ENTRIES ({MAX_EPISODE_ENTRIES})"),
    (dict(episode={"turns": [1]}), "samples[0].episode.turns", "expected a str, int"),
]


@pytest.mark.parametrize("changes, field, reason", REJECTED,
                         ids=[f"{i}-{case[1]}" for i, case in enumerate(REJECTED)])
def test_decode_rejects(changes, field, reason):
    with pytest.raises(CodecError) as info:
        decode(_episode_with(**changes))
    assert (info.value.field, reason in info.value.reason) == (field, True), info.value


ADMITTED = [
    dict(loss_mask=_mask(ONE_POLICY_TOKEN), turn_ends=_ends([10]),
         versions=_versions([0] + [-1] * 9)),  # one policy token, version 0, one turn
    dict(turn_ends=_ends([5, 8, 10])),  # the last end == T
    dict(turn_ends=None),  # a mask without turn boundaries
    dict(loss_mask=None, versions=_versions([1] * 10), turn_ends=_ends([1, 10])),  # turns, no mask
    dict(episode={f"k{i}": i for i in range(MAX_EPISODE_ENTRIES)}),
]


@pytest.mark.parametrize("changes", ADMITTED)
def test_decode_admits_the_boundaries(changes):
    decoded = decode(_episode_with(**changes))
    assert len(decoded.samples[0].response_token_ids) == 10


def test_a_turn_whose_policy_tokens_resume_after_an_observation_is_refused():
    # turn_ends [5, 10]: turn 1 is tokens 5..10 = 1 0 0 1 1, a policy token after an observation
    with pytest.raises(CodecError, match="policy token at index 8 follows an observation"):
        decode(_episode_with(turn_ends=_ends([5, 10])))


def test_single_turn_samples_keep_refusing_negative_versions():
    raw = wire_map(make_group(n_samples=1, n_tokens=3))
    raw["samples"][0]["versions"] = _versions([1, -1, 1])
    with pytest.raises(CodecError, match="negative policy version -1 at index 1"):
        decode(pack_map(raw))


def test_the_largest_valid_group_of_episodes_is_within_the_object_bound():
    full = {f"k{i}": i for i in range(MAX_EPISODE_ENTRIES)}
    samples = [make_episode([(1, 0)], seed=i, token_rewards=np.zeros(1, np.float32), error="e",
                            episode=full) for i in range(MAX_SAMPLES_PER_GROUP)]
    maps = {f"k{i}": i for i in range(1024)}
    group = make_group(samples=samples, sampling=maps, timings={k: 1.0 for k in maps})
    assert decode(encode(group), TrajectoryGroup) == group
