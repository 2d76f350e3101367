"""What the trainer admits: each rule rejects the bad value and admits the good one at its limit."""

import math

import numpy as np
import pytest

from miles.errors import ConfigError
from miles.protocol.limits import MAX_POLICY_VERSION, MAX_TOKENS_PER_SEQUENCE
from miles.rl.algorithm import AlgorithmConfig
from miles.trainer.intake import (DEFAULT_MAX_ABS_REWARD, MIN_TEMPERATURE, IntakeConfig,
                                  TrainerLimits, check_group)
from miles.trainer.learner import LearnerConfig
from tests.factories import make_group, make_sample

VOCAB = 78
BUDGET = 16  # tokens per micro-batch in these limits
VERSION = 4  # the trainer's policy version; make_group's tokens have versions 3 and 4
LIMITS = TrainerLimits(vocab_size=VOCAB, max_row_tokens=BUDGET,
                       max_abs_reward=DEFAULT_MAX_ABS_REWARD, algorithm=AlgorithmConfig())


def group(**overrides):
    return make_group(4, 8, prompt_tokens=6, vocab_size=VOCAB, **overrides)


def sampled(**sampling):
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}
    return group(sampling=base | sampling)


def with_samples(*samples, prompt_tokens=6, **overrides):
    return make_group(prompt_tokens=prompt_tokens, samples=list(samples),
                      **({"vocab_size": VOCAB} | overrides))


def check(g, limits=LIMITS, version=VERSION):
    return check_group(g, limits, policy_version=version)


def test_a_valid_group_is_admitted():
    assert check(group()) is None
    assert check(group(sampling={})) is None  # every sampling entry is optional


@pytest.mark.parametrize("name, bad", [
    ("temperature", 0), ("temperature", 0.0), ("temperature", -1.0), ("temperature", 1e-300),
    ("temperature", "0.7"), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.0000001), ("top_p", "abc"),
    ("top_k", "abc"), ("top_k", 1.5), ("top_k", True),
    ("max_new_tokens", "abc"), ("max_new_tokens", -1), ("max_new_tokens", 1.0),
    ("max_new_tokens", MAX_TOKENS_PER_SEQUENCE + 1),
])
def test_sampling_parameters_the_trainer_cannot_rescore_with_are_rejected(name, bad):
    rejection = check(sampled(**{name: bad}))
    assert (rejection.rule, rejection.field) == ("sampling", f"sampling.{name}")
    assert str(rejection).startswith(f"sampling.{name}: must be")


@pytest.mark.parametrize("name, good", [
    ("temperature", MIN_TEMPERATURE), ("temperature", 1), ("temperature", 1e300),
    ("top_p", 1.0), ("top_p", 1e-9), ("top_p", 1),
    ("top_k", -1), ("top_k", 0), ("top_k", 1), ("top_k", 2**62),
    ("max_new_tokens", 0), ("max_new_tokens", MAX_TOKENS_PER_SEQUENCE),
])
def test_sampling_parameters_at_their_limits_are_admitted(name, good):
    assert check(sampled(**{name: good})) is None


def test_the_vocabulary_must_be_the_models():
    big = with_samples(make_sample(4, vocab_size=1000, seed=1), vocab_size=1000,
                       prompt_token_ids=np.array([900, 950, 999], dtype=np.int32))
    rejection = check(big)
    assert (rejection.rule, rejection.field) == ("vocab_size", "vocab_size")
    assert "1000 is not the trainer's model's 78" in rejection.reason
    smaller = make_group(4, 8, vocab_size=VOCAB - 1)  # ids all < 77: still not the model's
    assert check(smaller).field == "vocab_size"
    top = with_samples(make_sample(4, response_token_ids=np.full(4, VOCAB - 1, np.int32)))
    assert check(top) is None  # the largest id the model has


def test_a_row_longer_than_one_micro_batch_is_rejected():
    fits = with_samples(make_sample(4), make_sample(BUDGET - 6))  # prompt 6 + 10 = the budget
    assert check(fits) is None
    long = with_samples(make_sample(4), make_sample(BUDGET - 5))
    rejection = check(long)
    assert (rejection.rule, rejection.field) == ("length", "samples[1].response_token_ids")
    assert f"prompt + response = {BUDGET + 1} tokens" in rejection.reason
    assert f"learner.max_tokens_per_micro_batch = {BUDGET}" in rejection.reason
    assert check(with_samples(make_sample(1), prompt_tokens=BUDGET)).field == "prompt_token_ids"
    assert check(with_samples(make_sample(1), prompt_tokens=BUDGET - 1)) is None


def test_the_default_budget_rejects_a_60k_token_response():
    limits = TrainerLimits(vocab_size=VOCAB,
                           max_row_tokens=LearnerConfig().max_tokens_per_micro_batch,
                           max_abs_reward=DEFAULT_MAX_ABS_REWARD, algorithm=AlgorithmConfig())
    assert check(with_samples(make_sample(60_000)), limits).field == \
        "samples[0].response_token_ids"
    assert check(with_samples(make_sample(8192 - 6)), limits) is None


@pytest.mark.parametrize("claimed", [VERSION + 1, 1000, MAX_POLICY_VERSION])
def test_versions_above_the_trainers_are_rejected(claimed):
    versions = np.array([VERSION, VERSION, claimed], dtype=np.int32)
    g = with_samples(make_sample(3), make_sample(3, versions=versions))
    rejection = check(g)
    assert (rejection.rule, rejection.field) == ("versions", "samples[1].versions")
    assert f"policy version {claimed} at index 2 is above the trainer's {VERSION}" \
        in rejection.reason


def test_versions_up_to_the_trainers_are_admitted():
    at = with_samples(make_sample(3, versions=np.full(3, VERSION, np.int32)))
    assert check(at) is None
    assert check(with_samples(make_sample(3, versions=np.zeros(3, np.int32))), version=0) is None


@pytest.mark.parametrize("reward", [1e308, -1e308, DEFAULT_MAX_ABS_REWARD * 1.0001])
def test_rewards_beyond_the_bound_are_rejected(reward):
    rejection = check(with_samples(make_sample(3), make_sample(3, reward=reward)))
    assert (rejection.rule, rejection.field) == ("rewards", "samples[1].reward")
    assert "loop.intake.max_abs_reward = 10000" in rejection.reason


@pytest.mark.parametrize("value", [3e38, -3e38, DEFAULT_MAX_ABS_REWARD * 2])
def test_token_rewards_beyond_the_bound_are_rejected(value):
    token_rewards = np.array([0.0, value, 1.0], dtype=np.float32)
    rejection = check(with_samples(make_sample(3, token_rewards=token_rewards)))
    assert (rejection.rule, rejection.field) == ("rewards", "samples[0].token_rewards")
    assert "at index 1" in rejection.reason


def test_rewards_at_the_bound_are_admitted():
    bound = DEFAULT_MAX_ABS_REWARD
    g = with_samples(make_sample(3, reward=bound), make_sample(3, reward=-bound),
                     make_sample(3, token_rewards=np.array([bound, -bound, 0], np.float32)))
    assert check(g) is None


def test_the_reward_bound_is_a_knob():
    g = with_samples(make_sample(3, reward=0.0), make_sample(3, reward=1e5))
    assert check(g).rule == "rewards"
    wider = TrainerLimits(vocab_size=VOCAB, max_row_tokens=BUDGET, algorithm=AlgorithmConfig(),
                          max_abs_reward=IntakeConfig(max_abs_reward=1e6).max_abs_reward)
    assert check(g, wider) is None
    narrower = TrainerLimits(vocab_size=VOCAB, max_row_tokens=BUDGET, algorithm=AlgorithmConfig(),
                             max_abs_reward=IntakeConfig(max_abs_reward=0.5).max_abs_reward)
    assert check(group(), narrower).rule == "rewards"  # make_sample's rewards are in [0, 1)


def test_rewards_whose_advantages_overflow_are_rejected():
    """A bound too wide to protect the estimator: Dr. GRPO's centred rewards are float32."""
    limits = TrainerLimits(vocab_size=VOCAB, max_row_tokens=BUDGET, max_abs_reward=1e300,
                           algorithm=AlgorithmConfig(estimator="dr_grpo"))
    huge = with_samples(make_sample(3, reward=0.0), make_sample(3, reward=1e39))
    rejection = check(huge, limits)
    assert (rejection.rule, rejection.field) == ("advantages", "samples.reward")
    assert "dr_grpo advantages" in rejection.reason
    assert check(with_samples(make_sample(3, reward=0.0), make_sample(3, reward=1e38)),
                 limits) is None


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_the_reward_bound_must_be_finite_and_positive(bad):
    with pytest.raises(ConfigError, match="loop.intake.max_abs_reward"):
        IntakeConfig(max_abs_reward=bad)


def test_the_trainer_settings_reach_the_intake():
    from consumers.trainer import parse_args

    settings = parse_args(["--set", "loop.intake.max_abs_reward=5"])
    assert settings.loop.intake.max_abs_reward == 5
    assert parse_args([]).loop.intake.max_abs_reward == DEFAULT_MAX_ABS_REWARD
