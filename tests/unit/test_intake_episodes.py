"""What the trainer admits of episodes (1.4): versions and staleness over policy tokens only, the
row length over the whole episode; each rule's boundary admitted.

The structural rules (mask entries, a policy token, -1 exactly on observation tokens,
turn_ends) are the codec's: `tests/unit/test_codec_episodes.py`. Here: a record the codec
accepts, against one trainer.
"""

import numpy as np

from miles.protocol import Sample, decode, encode
from miles.rl.algorithm import AlgorithmConfig
from miles.trainer.intake import DEFAULT_MAX_ABS_REWARD, TrainerLimits, check_group
from tests.factories import make_episode, make_group

VOCAB = 78
LIMITS = TrainerLimits(vocab_size=VOCAB, max_row_tokens=32,
                       max_abs_reward=DEFAULT_MAX_ABS_REWARD, algorithm=AlgorithmConfig())
TURNS = [(2, 6), (1, 4), (2, 0)]  # 5 policy tokens, 10 observation tokens, T = 15


def episode_group(turns=TURNS, *, policy_version=3, prompt_tokens=4, **sample):
    """One group of two episodes whose policy tokens were sampled under versions
    policy_version .. policy_version + len(turns) - 1."""
    samples = [make_episode(turns, vocab_size=VOCAB, policy_version=policy_version, seed=i,
                            **sample) for i in range(2)]
    group = make_group(prompt_tokens=prompt_tokens, vocab_size=VOCAB, samples=samples)
    return decode(encode(group))  # as the trainer sees it: checked by the codec


def test_an_episode_is_admitted():
    assert check_group(episode_group(), LIMITS, policy_version=5) is None


def test_versions_above_the_trainers_are_rejected_over_policy_tokens():
    group = episode_group()  # the last turn's tokens have version 5
    rejection = check_group(group, LIMITS, policy_version=4)
    assert (rejection.rule, str(rejection)) == (
        "versions", "samples[0].versions: policy version 5 at index 13 is above the trainer's 4")
    assert check_group(group, LIMITS, policy_version=5) is None  # the boundary


def test_min_version_and_lag_leave_observation_tokens_out():
    group = episode_group(policy_version=3)
    assert int(group.samples[0].versions.min()) == -1  # on the wire
    assert group.min_version == 3  # the oldest policy token
    assert group.lag(7) == 4  # not 8: an observation token is no policy's


def test_staleness_over_policy_tokens_decides_admission():
    """The loop drops a group with lag > max_staleness (`TrainerLoop`), replay under
    staleness="recorded" too (`Replay._admit`): both read `group.lag`."""
    from miles.trainer.loop import LoopConfig

    bound = LoopConfig().max_staleness
    group = episode_group(policy_version=2)
    assert group.lag(2 + bound) == bound  # admitted: lag == max_staleness
    assert group.lag(3 + bound) == bound + 1  # dropped
    # with the -1s counted the lag would be 3 + bound + 1: dropped at a lag the bound admits


def test_the_row_length_counts_the_whole_episode():
    """prompt 4 + T 15 = 19 tokens of forward, observations included."""
    tight = TrainerLimits(vocab_size=VOCAB, max_row_tokens=19, max_abs_reward=1e4,
                          algorithm=AlgorithmConfig())
    assert check_group(episode_group(), tight, policy_version=5) is None
    tighter = TrainerLimits(vocab_size=VOCAB, max_row_tokens=18, max_abs_reward=1e4,
                            algorithm=AlgorithmConfig())
    rejection = check_group(episode_group(), tighter, policy_version=5)
    assert str(rejection) == ("samples[0].response_token_ids: prompt + response = 19 tokens, "
                              "above learner.max_tokens_per_micro_batch = 18")


def test_per_turn_rewards_are_bounded_like_token_rewards():
    rewards = np.zeros(15, np.float32)
    rewards[[1, 8, 14]] = [0.5, 0.0, 1e4]  # each turn's last policy token; 1e4: the bound
    assert check_group(episode_group(token_rewards=rewards), LIMITS, policy_version=5) is None
    rewards[14] = 1.5e4
    rejection = check_group(episode_group(token_rewards=rewards), LIMITS, policy_version=5)
    assert (rejection.rule, rejection.field) == ("rewards", "samples[0].token_rewards")


def test_a_token_reward_on_an_observation_token_is_refused():
    """GAE credits a reward to the policy token whose action earned it; on an observation token
    (index 7: turn 1's observation, after policy tokens 0, 1) there is none to credit."""
    rewards = np.zeros(15, np.float32)
    rewards[1] = 0.5  # turn 1's last policy token: admitted
    assert check_group(episode_group(token_rewards=rewards), LIMITS, policy_version=5) is None
    rewards[7] = -0.25
    rejection = check_group(episode_group(token_rewards=rewards), LIMITS, policy_version=5)
    assert (rejection.rule, str(rejection)) == (
        "reward_positions", "samples[0].token_rewards: -0.25 at index 7 is on an observation token "
        "(loss_mask 0); a turn's reward goes on its last policy token")


def test_a_single_turn_sample_beside_an_episode_keeps_its_rules():
    group = episode_group()
    single = Sample(response_token_ids=np.array([5, 6], np.int32),
                    logprobs=np.array([-1.0, -1.0], np.float32),
                    versions=np.array([6, 6], np.int32), reward=0.0, finish_reason="stop")
    mixed = make_group(prompt_tokens=4, vocab_size=VOCAB, samples=[*group.samples, single])
    rejection = check_group(mixed, LIMITS, policy_version=5)
    assert str(rejection).startswith("samples[2].versions: policy version 6 at index 0")
    assert mixed.min_version == 3
