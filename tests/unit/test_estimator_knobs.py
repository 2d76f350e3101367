"""Issue 15, estimator side: each finding reproduced, and each estimator knob shown to change
the outcome. Expected values are computed by hand in the comments, formulas and papers named."""

import math

import pytest
import torch
from torch.testing import assert_close

from miles.errors import ConfigError, MilesError
from miles.rl.advantages import AdvantageSettings, batch_advantages
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.rl.correction import behaviour_weights
from miles.rl.kl import adaptive_kl_coef
from miles.rl.losses import LossSettings
from miles.trainer.batching import outcome_advantages, shaped_rewards
from miles.trainer.intake import DEFAULT_MAX_ABS_REWARD, TrainerLimits, check_group
from tests.factories import make_group, make_sample


def groups_of(*rewards, lengths=None):
    """Groups with the given rewards (one list per group), responses of `lengths` tokens."""
    out = []
    for g, rs in enumerate(rewards):
        samples = [make_sample(lengths[g][i] if lengths else 4, vocab_size=50, seed=10 * g + i,
                               reward=float(r)) for i, r in enumerate(rs)]
        out.append(make_group(prompt_tokens=3, vocab_size=50, samples=samples, seed=g))
    return out


def algorithm(**fields) -> AlgorithmConfig:
    return AlgorithmConfig(**fields)


# --- finding 4: REINFORCE++ over a batch of groups of different sizes ------------------------


def test_reinforce_pp_normalises_over_the_batch_whatever_the_group_sizes():
    # groups [1, 1, 1, 1] and [0, 0, 0], equal lengths: batch mean 4/7, population std
    # sqrt(4/7 * 3/7) = 0.4949; (1 - 4/7) / std = +0.866, (0 - 4/7) / std = -1.155 (REINFORCE++,
    # Hu 2025, global normalisation). Before the fix: each group alone, all zeros.
    _, advantages = outcome_advantages(groups_of([1, 1, 1, 1], [0, 0, 0]),
                                       algorithm(estimator="reinforce_pp"))
    std = math.sqrt(4 / 7 * 3 / 7)
    assert_close(advantages[0], torch.full((4,), (3 / 7) / std), atol=1e-5, rtol=0)
    assert_close(advantages[1], torch.full((3,), -(4 / 7) / std), atol=1e-5, rtol=0)
    assert_close(advantages[0][0], torch.tensor(0.866), atol=1e-3, rtol=0)
    assert_close(advantages[1][0], torch.tensor(-1.155), atol=1e-3, rtol=0)


def test_reinforce_pp_counts_tokens_by_default_and_samples_on_request():
    # rewards [1, 0] with 3 and 1 response tokens. Tokens (the paper's, and the default): the
    # values 1, 1, 1, 0: mean 3/4, std sqrt(3/16) = 0.4330 -> (1 - 0.75) / 0.4330 = 0.5774 and
    # -0.75 / 0.4330 = -1.7321. Samples: values 1, 0: mean 1/2, std 1/2 -> +1, -1.
    groups = groups_of([1, 0], lengths=[[3, 1]])
    _, [tokens] = outcome_advantages(groups, algorithm(estimator="reinforce_pp"))
    assert_close(tokens, torch.tensor([1 / math.sqrt(3), -math.sqrt(3)]), atol=1e-5, rtol=0)
    _, [samples] = outcome_advantages(groups, algorithm(
        estimator="reinforce_pp", advantage=AdvantageSettings(normalise_over="samples")))
    assert_close(samples, torch.tensor([1.0, -1.0]), atol=1e-5, rtol=0)


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_whitening():
    # REINFORCE++-baseline (Hu 2025): x = r - group mean, then batch whitening. Groups [1, 0]
    # and [1, 1]: x = [0.5, -0.5], [0, 0]; mean 0, std sqrt(0.5 / 4) = 0.3536 -> +-1.4142, 0.
    # Without the baseline: r = 1, 0, 1, 1: mean 3/4, std 0.4330 -> 0.5774, -1.7321, 0.5774 x2.
    groups = groups_of([1, 0], [1, 1])
    _, with_baseline = outcome_advantages(groups, algorithm(
        estimator="reinforce_pp", advantage=AdvantageSettings(baseline=True)))
    assert_close(torch.cat(with_baseline), torch.tensor([math.sqrt(2), -math.sqrt(2), 0, 0]),
                 atol=1e-5, rtol=0)
    _, plain = outcome_advantages(groups, algorithm(estimator="reinforce_pp"))
    assert_close(plain[1], torch.full((2,), 1 / math.sqrt(3)), atol=1e-5, rtol=0)


# --- the std knobs: eps, scaling on/off, unbiased vs population -----------------------------


def test_eps_is_the_std_denominators_epsilon():
    # GRPO (Shao et al. 2024): (r - mean) / (std + eps); group [1, 0]: std 0.5 -> 0.5 / 0.6
    _, [out] = outcome_advantages(groups_of([1, 0]), algorithm(
        advantage=AdvantageSettings(eps=0.1)))
    assert_close(out, torch.tensor([0.5 / 0.6, -0.5 / 0.6]))
    with pytest.raises(ConfigError, match="advantage.eps must be > 0"):
        AdvantageSettings(eps=0.0)


def test_std_scaling_can_be_switched_off_and_on():
    # group [2, 0]: centred [1, -1], population std 1: grpo divides (1 / (1 + 1e-6)), dr_grpo
    # not (Liu et al. 2025); scale_by_std=false under grpo is dr_grpo, true under dr_grpo grpo.
    groups = groups_of([2, 0])
    _, [scaled] = outcome_advantages(groups, algorithm())
    _, [unscaled] = outcome_advantages(groups, algorithm(
        advantage=AdvantageSettings(scale_by_std=False)))
    _, [dr] = outcome_advantages(groups, algorithm(estimator="dr_grpo"))
    _, [dr_scaled] = outcome_advantages(groups, algorithm(
        estimator="dr_grpo", advantage=AdvantageSettings(scale_by_std=True)))
    assert_close(unscaled, torch.tensor([1.0, -1.0])) and assert_close(dr, unscaled)
    assert_close(scaled, dr_scaled)
    groups = groups_of([4, 0])  # std 2: scaling now changes the values
    assert_close(outcome_advantages(groups, algorithm())[1][0], torch.tensor([1.0, -1.0]))
    assert_close(outcome_advantages(groups, algorithm(estimator="dr_grpo"))[1][0],
                 torch.tensor([2.0, -2.0]))


def test_unbiased_std_divides_by_n_minus_one():
    # group [1, 0, 0, 1]: population std 0.5 -> +-1; unbiased sqrt(1 / 3) -> +-0.866
    groups = groups_of([1, 0, 0, 1])
    _, [population] = outcome_advantages(groups, algorithm(advantage=AdvantageSettings(eps=1e-9)))
    _, [unbiased] = outcome_advantages(groups, algorithm(
        advantage=AdvantageSettings(eps=1e-9, unbiased_std=True)))
    assert_close(population, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert_close(unbiased, torch.tensor([1.0, -1.0, -1.0, 1.0]) * math.sqrt(3) / 2)
    # a group of one: std 0 under both (no nan), advantage 0
    _, [single] = outcome_advantages(groups_of([1]), algorithm(
        advantage=AdvantageSettings(unbiased_std=True)))
    assert single.tolist() == [0.0]


@pytest.mark.parametrize("estimator, knob", [
    ("rloo", dict(scale_by_std=True)), ("rloo", dict(unbiased_std=True)),
    ("grpo", dict(baseline=True)), ("grpo", dict(normalise_over="samples")),
    ("gae", dict(scale_by_std=False)),
])
def test_a_knob_the_estimator_does_not_read_is_a_config_error(estimator, knob):
    with pytest.raises(ConfigError, match=f"advantage.{next(iter(knob))}: not read by"):
        AlgorithmConfig(estimator=estimator, advantage=AdvantageSettings(**knob))


def test_batch_advantages_handles_empty_and_all_masked_batches():
    assert batch_advantages([], estimator="reinforce_pp") == []
    out = batch_advantages([torch.tensor([1.0, 0.0])], estimator="reinforce_pp",
                           weights=[torch.zeros(2)])
    assert out[0].tolist() == [0.0, 0.0]  # no trained token: nothing to normalise over


# --- findings 2 and 3: KL in the reward or in the loss, never both, and never without a coef ---


def test_kl_in_reward_without_a_coefficient_is_a_config_error():
    # finding 3: before, this passed validation and train_step raised a TypeError
    with pytest.raises(ConfigError, match=r"kl_in_reward needs loss\.kl_coef > 0"):
        AlgorithmConfig(estimator="gae", kl_in_reward=True)


def test_the_kl_term_leaves_the_loss_when_it_is_in_the_reward():
    # finding 2: with kl_in_reward the policy loss has no KL term (the penalty is in the reward)
    loss = LossSettings(kl_coef=0.1)
    in_reward = AlgorithmConfig(estimator="gae", kl_in_reward=True, loss=loss)
    assert in_reward.policy_loss_settings().kl_coef == 0.0
    assert in_reward.policy_loss_settings(0.3).kl_coef == 0.0
    assert in_reward.uses_reference  # the reward penalty still needs the reference
    in_loss = AlgorithmConfig(loss=loss)
    assert in_loss.policy_loss_settings().kl_coef == 0.1
    assert in_loss.policy_loss_settings(0.3).kl_coef == 0.3  # the adaptive controller's value


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_kl_in_reward_is_offered_to_the_critic_free_estimators(estimator):
    config = AlgorithmConfig(estimator=estimator, kl_in_reward=True,
                             loss=LossSettings(kl_coef=0.05))
    assert config.uses_reference and not config.uses_critic


# --- the adaptive KL controller (Ziegler et al. 2019, Section 2.2) ---------------------------


def test_adaptive_kl_moves_the_coefficient_towards_the_target():
    # e = clip(kl / target - 1, -0.2, 0.2); coef * (1 + e * samples / horizon)
    assert adaptive_kl_coef(0.1, kl=7.0, target=6.0, samples=64, horizon=10000) == \
        pytest.approx(0.1 * (1 + (1 / 6) * 64 / 10000))
    assert adaptive_kl_coef(0.1, kl=60.0, target=6.0, samples=100, horizon=100) == \
        pytest.approx(0.1 * 1.2)  # error clipped at +0.2
    assert adaptive_kl_coef(0.1, kl=0.0, target=6.0, samples=100, horizon=100) == \
        pytest.approx(0.1 * 0.8)  # and at -0.2
    assert adaptive_kl_coef(0.1, kl=6.0, target=6.0, samples=100, horizon=100) == 0.1


# --- TIS lower bound -------------------------------------------------------------------------


def test_truncated_is_weights_take_a_lower_bound_too():
    # ratios e^-2 = 0.135, 1, e^1 = 2.718: truncate to [0.5, 2] -> 0.5, 1, 2 (before: no floor)
    proximal = torch.tensor([[-2.0, 0.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    floored = behaviour_weights(proximal, torch.zeros(1, 3), mask, upper=2.0, lower=0.5)
    assert_close(floored.weight, torch.tensor([[0.5, 1.0, 2.0]]))
    assert floored.truncated.tolist() == [[True, False, True]]
    plain = behaviour_weights(proximal, torch.zeros(1, 3), mask, upper=2.0)
    assert_close(plain.weight, torch.tensor([[math.exp(-2.0), 1.0, 2.0]]))
    LossSettings(is_mode="truncate", is_lower=0.5)  # reachable from config


# --- finding 6: GSPO's behaviour correction is sequence-level --------------------------------


def test_gspo_corrects_at_the_sequence_level_by_default():
    assert LossSettings(objective="gspo").behaviour_level == "geometric"
    assert LossSettings().behaviour_level == "token"
    assert LossSettings(objective="gspo", is_level="token").behaviour_level == "token"
    assert preset("gspo")["loss"]["is_level"] == "geometric"


# --- finding 10: the overlong penalty needs the recorded response limit ----------------------


def test_a_group_without_max_new_tokens_gets_no_guessed_overlong_penalty():
    # lengths 4 and 8, no max_new_tokens recorded: before, the limit was taken to be 8 (the
    # longest) and that response got the full penalty -1; now the group is refused
    [group] = groups_of([1, 1], lengths=[[4, 8]])
    group = make_group(prompt_tokens=3, vocab_size=50, samples=group.samples, sampling={})
    dapo = AlgorithmConfig(overlong_buffer=2, overlong_penalty=1.0)
    with pytest.raises(MilesError, match="max_new_tokens must be recorded"):
        shaped_rewards(group, dapo)
    limits = TrainerLimits(vocab_size=50, max_row_tokens=64,
                           max_abs_reward=DEFAULT_MAX_ABS_REWARD, algorithm=dapo)
    rejection = check_group(group, limits, policy_version=10)
    assert (rejection.rule, rejection.field) == ("overlong", "sampling.max_new_tokens")
    assert "full penalty" in rejection.reason
    plain = TrainerLimits(vocab_size=50, max_row_tokens=64,
                          max_abs_reward=DEFAULT_MAX_ABS_REWARD, algorithm=AlgorithmConfig())
    assert check_group(group, plain, policy_version=10) is None  # no penalty: admitted
    recorded = make_group(prompt_tokens=3, vocab_size=50, samples=group.samples,
                          sampling={"max_new_tokens": 8})
    assert check_group(recorded, limits, policy_version=10) is None
    assert shaped_rewards(recorded, dapo).tolist() == [1.0, 0.0]


def test_kl_penalised_returns_and_rewards():
    # REINFORCE++ (Hu 2025): G_t = r - beta * sum_{i >= t} k1_i; k1 = [0.1, 0.2, 0.3], r = 1,
    # beta = 0.5: G = [1 - 0.3, 1 - 0.25, 1 - 0.15] = [0.7, 0.75, 0.85]; padding 0.
    # RLOO (Ahmadian et al. 2024): R = r - beta * sum_t k1 = 1 - 0.3 = 0.7.
    from miles.rl.advantages import kl_penalised_returns, kl_penalised_rewards

    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    returns = kl_penalised_returns(torch.tensor([1.0]), kl, mask, 0.5)
    assert_close(returns, torch.tensor([[0.7, 0.75, 0.85, 0.0]], dtype=torch.float64))
    assert_close(kl_penalised_rewards(torch.tensor([1.0]), kl, mask, 0.5),
                 torch.tensor([0.7], dtype=torch.float64))
