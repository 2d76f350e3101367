"""Groups -> micro-batches: budget, padding, masks, positions, alignment, advantages."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from miles.errors import MilesError
from miles.rl.advantages import grpo_advantages
from miles.trainer.batching import SamplingSetting, idle_micro_batch, make_micro_batches
from tests.factories import make_group, make_sample

PAD = 0


def ragged_group(seed: int, lengths: list[int], prompt_tokens: int = 3, **overrides):
    samples = [make_sample(n, vocab_size=50, seed=seed * 100 + i, reward=float(i))
               for i, n in enumerate(lengths)]
    return make_group(prompt_tokens=prompt_tokens, vocab_size=50, seed=seed, samples=samples,
                      **overrides)


def test_every_sample_exactly_once_and_budget_respected():
    groups = [ragged_group(s, [1 + (s * 7 + i) % 9 for i in range(5)], prompt_tokens=2 + s % 4)
              for s in range(6)]
    batches = make_micro_batches(groups, max_tokens=40, pad_id=PAD)
    ids = [sid for b in batches for sid in b.sample_ids]
    assert sorted(ids) == sorted((g.group_id, i) for g in groups for i in range(5))
    assert len(batches) > 1
    for b in batches:
        rows, width = b.input_ids.shape
        assert rows * width <= 40
        assert len(b.sample_ids) == rows
    total = sum(len(s.response_token_ids) for g in groups for s in g.samples)
    assert sum(b.num_tokens for b in batches) == total


def test_right_padding_masks_positions_and_alignment():
    prompt = np.array([7, 8, 9], dtype=np.int32)
    long = make_sample(3, seed=1, reward=1.0, response_token_ids=np.array([11, 12, 13], np.int32),
                       logprobs=np.array([-0.1, -0.2, -0.3], np.float32))
    short = make_sample(1, seed=2, reward=0.0, response_token_ids=np.array([21], np.int32),
                        logprobs=np.array([-0.5], np.float32))
    group = make_group(prompt_token_ids=prompt, samples=[short, long], vocab_size=50)
    (b,) = make_micro_batches([group], max_tokens=100, pad_id=PAD)
    assert b.sample_ids == ((group.group_id, 1), (group.group_id, 0))  # longest first
    assert b.input_ids.tolist() == [[7, 8, 9, 11, 12, 13], [7, 8, 9, 21, PAD, PAD]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 0]]
    # targets = input_ids[:, 1:]; response targets start at index P - 1 = 2
    assert b.targets.tolist() == [[8, 9, 11, 12, 13], [8, 9, 21, PAD, PAD]]
    assert b.response_mask.tolist() == [[False, False, True, True, True],
                                        [False, False, True, False, False]]
    assert_close(b.behaviour_logprobs, torch.tensor([[0, 0, -0.1, -0.2, -0.3],
                                                     [0, 0, -0.5, 0, 0]]))
    assert_close(b.rewards, torch.tensor([1.0, 0.0]))
    assert_close(b.advantages, torch.tensor([0.5, -0.5]) / (0.5 + 1e-6))  # rewards 1, 0


def test_advantages_are_per_group_even_when_split_across_micro_batches():
    groups = [ragged_group(s, [4, 4, 4, 4]) for s in range(3)]
    batches = make_micro_batches(groups, max_tokens=14, pad_id=PAD)  # 7 tokens/row: 2 rows each
    assert len(batches) == 6
    got = {sid: float(a) for b in batches for sid, a in zip(b.sample_ids, b.advantages)}
    for g in groups:
        rewards = torch.tensor([[s.reward for s in g.samples]])
        expected = grpo_advantages(rewards)[0]
        assert_close(torch.tensor([got[(g.group_id, i)] for i in range(4)]), expected)


def test_sampling_settings_are_never_mixed_in_a_micro_batch():
    hot = {"temperature": 0.7, "top_p": 0.9, "top_k": -1}
    groups = [ragged_group(0, [3, 3]), ragged_group(1, [3, 3], sampling=hot),
              ragged_group(2, [3, 3])]
    batches = make_micro_batches(groups, max_tokens=1000, pad_id=PAD)
    assert len(batches) == 2
    assert batches[0].sampling == SamplingSetting(temperature=1.0, top_k=0, top_p=1.0)
    assert {g for g, _ in batches[0].sample_ids} == {"g-0", "g-2"}
    assert batches[1].sampling == SamplingSetting(temperature=0.7, top_k=0, top_p=0.9)
    assert {g for g, _ in batches[1].sample_ids} == {"g-1"}


def test_a_row_longer_than_the_budget_gets_its_own_micro_batch():
    batches = make_micro_batches([ragged_group(0, [20, 2, 2])], max_tokens=10, pad_id=PAD)
    assert [b.input_ids.shape for b in batches] == [(1, 23), (2, 5)]


def test_bad_inputs_raise():
    with pytest.raises(MilesError, match="temperature"):
        make_micro_batches([ragged_group(0, [2], sampling={"temperature": 0.0})], max_tokens=10)
    with pytest.raises(MilesError, match="max_tokens"):
        make_micro_batches([ragged_group(0, [2])], max_tokens=0)
    assert make_micro_batches([], max_tokens=10) == []


def test_idle_micro_batch_has_no_response_tokens():
    idle = idle_micro_batch(pad_id=PAD)
    assert idle.num_tokens == 0 and idle.sample_ids == ()
    assert idle.attention_mask.all()  # no fully masked row, so no nan in attention


def test_overlong_shaping_ramps_the_penalty_over_the_buffer():
    from miles.rl.algorithm import AlgorithmConfig
    from miles.trainer.batching import shaped_rewards

    group = ragged_group(0, [4, 6, 7, 8], sampling={"temperature": 1.0, "top_p": 1.0,
                                                    "top_k": -1, "max_new_tokens": 8})
    plain = shaped_rewards(group, AlgorithmConfig())
    assert plain.tolist() == [0.0, 1.0, 2.0, 3.0]  # ragged_group's rewards are the indices
    shaped = shaped_rewards(group, AlgorithmConfig(overlong_buffer=4, overlong_penalty=2.0))
    # free up to 8 - 4 = 4 tokens, then -2 * (excess / 4): 6 -> -1, 7 -> -1.5, 8 -> -2
    assert_close(shaped, torch.tensor([0.0, 0.0, 0.5, 1.0], dtype=torch.float64))


def test_mask_truncated_keeps_the_row_but_trains_none_of_its_tokens():
    from miles.rl.algorithm import AlgorithmConfig

    samples = [make_sample(5, vocab_size=50, seed=i, reward=float(i), finish_reason=reason)
               for i, reason in enumerate(["stop", "length", "stop"])]
    group = make_group(prompt_tokens=3, vocab_size=50, samples=samples)
    for masked in (False, True):
        [batch] = make_micro_batches([group], max_tokens=1000, pad_id=PAD,
                                     algorithm=AlgorithmConfig(mask_truncated=masked))
        trained = batch.response_mask.sum(dim=1).tolist()  # rows keep the group's order
        assert trained == ([5, 0, 5] if masked else [5, 5, 5])
        # the truncated sample still counts in its group's baseline
        assert_close(batch.advantages, grpo_advantages(torch.tensor([[0.0, 1.0, 2.0]]))[0].float())


def test_packed_layout_shares_lines_and_maps_targets_back_to_samples():
    prompt = np.array([7, 8], dtype=np.int32)
    long = make_sample(4, seed=1, response_token_ids=np.array([11, 12, 13, 14], np.int32),
                       logprobs=np.array([-0.1, -0.2, -0.3, -0.4], np.float32))
    short = make_sample(1, seed=2, response_token_ids=np.array([21], np.int32),
                        logprobs=np.array([-0.5], np.float32))
    tiny = make_sample(1, seed=3, response_token_ids=np.array([31], np.int32),
                       logprobs=np.array([-0.7], np.float32))
    group = make_group(prompt_token_ids=prompt, samples=[short, long, tiny], vocab_size=50)
    (padded,) = make_micro_batches([group], max_tokens=100, pad_id=PAD)
    (packed,) = make_micro_batches([group], max_tokens=100, pad_id=PAD, packed=True)
    # samples of 6, 3 and 3 tokens: lines as long as the longest, the two short ones share one
    assert packed.input_ids.tolist() == [[7, 8, 11, 12, 13, 14], [7, 8, 21, 7, 8, 31]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]]
    assert packed.attention_mask is None and padded.layout is None
    # the per-sample tensors are the padded ones; unpack maps model predictions onto them
    for name in ("response_mask", "behaviour_logprobs", "advantages", "rewards"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
    assert packed.sample_ids == padded.sample_ids
    unpacked = packed.unpack(packed.targets)  # [B, L-1] targets of each sample
    real = padded.attention_mask[:, 1:].bool()  # real targets
    assert torch.equal(unpacked[real], padded.targets[real])
    targets = padded.targets
    assert padded.unpack(targets) is targets  # padded: already one row per sample


def test_packed_padding_is_a_sequence_of_its_own_and_the_budget_counts_lines():
    group = ragged_group(0, [7, 3, 1, 1], prompt_tokens=3)  # samples of 10, 6, 4 and 4 tokens
    packed = make_micro_batches([group], max_tokens=20, pad_id=PAD, packed=True)
    assert [b.input_ids.shape for b in packed] == [(2, 10), (1, 4)]  # [10], [6 + 4]; [4]
    padded = make_micro_batches([group], max_tokens=20, pad_id=PAD)
    assert [b.input_ids.shape for b in padded] == [(2, 10), (2, 4)]
    lonely = make_micro_batches([ragged_group(1, [7, 1], prompt_tokens=3)], max_tokens=100,
                                pad_id=PAD, packed=True)[0]  # lines of 10 and 4 tokens
    assert lonely.position_ids[1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]  # padding restarts
    many = [ragged_group(s, [1 + (s * 7 + i) % 9 for i in range(5)]) for s in range(6)]
    longest = max(3 + 1 + (s * 7 + i) % 9 for s in range(6) for i in range(5))
    batches = make_micro_batches(many, max_tokens=40, pad_id=PAD, packed=True)
    assert sum(len(b.sample_ids) for b in batches) == 30
    for b in batches:
        rows, width = b.input_ids.shape
        assert width <= longest and rows * width <= 40


def test_token_rewards_align_with_the_response_mask_padded_and_packed():
    """Prompt [7, 8]; an episode of T = 5 (turn 1: policy 0, 1, observation 2; turn 2: policy 3,
    4) with turn rewards 0.5 on token 1 and 2.0 on token 4, and a single-turn sample without
    token rewards. Response token t is target p - 1 + t = 1 + t of the row."""
    from tests.factories import make_episode

    rewards = np.array([0.0, 0.5, 0.0, 0.0, 2.0], np.float32)
    episode = make_episode([(2, 1), (2, 0)], vocab_size=50, token_rewards=rewards, reward=3.0)
    single = make_sample(2, vocab_size=50, seed=4)
    group = make_group(prompt_token_ids=np.array([7, 8], np.int32), samples=[episode, single],
                       vocab_size=50)
    (padded,) = make_micro_batches([group], max_tokens=100, pad_id=PAD)
    (packed,) = make_micro_batches([group], max_tokens=100, pad_id=PAD, packed=True)
    assert padded.sample_ids == (("g-0", 0), ("g-0", 1))  # longest first
    expected = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, 2.0],
                             [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # [B, L-1]
    assert padded.response_mask.tolist() == [[False, True, True, False, True, True],
                                             [False, True, True, False, False, False]]
    assert torch.equal(padded.token_rewards, expected)
    assert torch.equal(packed.token_rewards, expected)
    group.samples[:] = [single]  # no sample with token rewards: none to carry
    assert make_micro_batches([group], max_tokens=100, pad_id=PAD)[0].token_rewards is None
    assert idle_micro_batch().token_rewards is None


def naive_first_fit(lengths: list[int], width: int) -> list[list[int]]:
    """First fit as defined: each row into the first line with room, searching every line."""
    lines: list[list[int]] = []
    for n in lengths:
        into = next((line for line in lines if sum(line) + n <= width), None)
        if into is None:
            lines.append(into := [])
        into.append(n)
    return lines


@pytest.mark.parametrize("seed", range(20))
def test_first_fit_places_rows_as_first_fit_does(seed):
    from types import SimpleNamespace

    from miles.trainer.batching import first_fit

    rng = np.random.default_rng(seed)
    lengths = sorted(rng.integers(1, 40, size=int(rng.integers(1, 120))).tolist(), reverse=True)
    rows = [SimpleNamespace(length=n) for n in lengths]
    lines = first_fit(rows, lengths[0])
    assert [[row.length for row in line] for line in lines] == \
        naive_first_fit(lengths, lengths[0])
