"""Every loss and metric of an episode counts the policy's tokens only (1.4 `loss_mask`).

The batch: prompt [7, 8, 9]; sample 0 an episode of turns (2 policy, 3 observation) and (1
policy, 0 observation), T = 6, mask 1 1 0 0 0 1; sample 1 a single-turn response of 2 tokens.
Target t of a row predicts token t + 1, so the response starts at target P - 1 = 2:
row 0 (the episode, longest first) has policy targets 2, 3, 7 and observation targets 4, 5, 6;
row 1 policy targets 2, 3. N = 5 policy tokens, 2 rows.

The per-token inputs below put extreme values on the observation targets (a current logprob far
above the proximal one, behaviour logprobs of -20, an entropy of 100): counted, any of them
would change the expected numbers, which are written out from the policy targets alone.
"""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from miles.rl.advantages import (gae_advantages, kl_penalised_returns, kl_penalised_rewards,
                                 token_rewards)
from miles.rl.aggregation import Normalisers
from miles.rl.algorithm import AlgorithmConfig
from miles.rl.losses import LossSettings, compute_policy_loss
from miles.trainer.batching import make_micro_batches, outcome_advantages, shaped_rewards
from tests.factories import make_episode, make_group, make_sample

VOCAB = 50
EPISODE = make_episode([(2, 3), (1, 0)], vocab_size=VOCAB, policy_version=0, reward=1.0)
SINGLE = make_sample(2, vocab_size=VOCAB, seed=5, reward=0.0)
GROUP = make_group(prompt_token_ids=np.array([7, 8, 9], np.int32), samples=[EPISODE, SINGLE],
                   vocab_size=VOCAB, sampling={"max_new_tokens": 16})
POLICY_MASK = [[False, False, True, True, False, False, False, True],
               [False, False, True, True, False, False, False, False]]
OBS = -0.1  # a current logprob on observation targets


def micro_batch(algorithm=AlgorithmConfig(), packed=False):
    (batch,) = make_micro_batches([GROUP], max_tokens=100, algorithm=algorithm, packed=packed)
    return batch


@pytest.mark.parametrize("packed", [False, True])
def test_the_response_mask_marks_the_policys_tokens_only(packed):
    batch = micro_batch(packed=packed)
    assert batch.sample_ids == (("g-0", 0), ("g-0", 1))
    assert batch.response_mask.tolist() == POLICY_MASK
    assert batch.num_tokens == 5  # trainer/tokens: policy tokens


def test_mask_truncated_masks_a_truncated_episode_whole():
    truncated = make_episode([(2, 3), (1, 0)], vocab_size=VOCAB, policy_version=0,
                             finish_reason="length")
    group = make_group(prompt_tokens=3, samples=[truncated, SINGLE], vocab_size=VOCAB)
    (batch,) = make_micro_batches([group], max_tokens=100,
                                  algorithm=AlgorithmConfig(mask_truncated=True))
    assert batch.response_mask.sum(dim=1).tolist() == [0, 2]


def inputs():
    """logp, proximal, behaviour, reference, entropy ([2, 8]); observation targets extreme."""
    def rows(episode, single):
        return torch.tensor([[0, 0, *episode], [0, 0, *single, 0, 0, 0, 0]])

    o = OBS
    logp = rows([-1.0, -0.5, o, o, o, -1.2], [-2.0, -2.0])
    proximal = rows([-1.0, -1.0, -5.0, -5.0, -5.0, -1.0], [-2.0, -2.0])
    behaviour = rows([-1.0, -1.0, -20.0, -20.0, -20.0, -1.0], [-2.0, -2.5])
    reference = rows([-1.0, -0.7, -30.0, -30.0, -30.0, -1.0], [-2.2, -2.0])
    entropy = rows([1.0, 2.0, 100.0, 100.0, 100.0, 3.0], [0.5, 0.5])
    return logp, proximal, behaviour, reference, entropy


ADVANTAGES = torch.tensor([[1.0], [-1.0]])  # [B, 1]
NORMALISERS = Normalisers(tokens=5.0, rows=2.0, constant=8.0)


def policy_loss(settings: LossSettings):
    logp, proximal, behaviour, reference, entropy = inputs()
    mask = micro_batch().response_mask
    return compute_policy_loss(logp, proximal, behaviour, ADVANTAGES, mask,
                               normalisers=NORMALISERS, settings=settings, ref_logp=reference,
                               entropy=entropy)


def ppo_token_losses():
    """PPO-clip [0.8, 1.28] times the token behaviour weight, on the 5 policy targets.

    row 0 (A = 1): ratios 1, e^0.5 (clipped to 1.28), e^-0.2 (inside); weights 1;
    row 1 (A = -1): ratios 1, 1; weights 1, e^(-2 + 2.5) = e^0.5 (below is_upper 2)."""
    return [-1.0, -1.28, -math.exp(-0.2)], [1.0, math.exp(0.5)]


def k3(x):
    return math.exp(x) - x - 1.0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_sum_constant"])
def test_ppo_loss_under_every_aggregation(aggregation):
    row0, row1 = ppo_token_losses()
    expected = {"token_mean": (sum(row0) + sum(row1)) / 5,
                "seq_mean_token_mean": (sum(row0) / 3 + sum(row1) / 2) / 2,
                "seq_sum_constant": (sum(row0) + sum(row1)) / (2 * 8)}[aggregation]
    loss, metrics = policy_loss(LossSettings(aggregation=aggregation))
    assert_close(float(loss), expected, rtol=1e-5, atol=1e-6)


def test_kl_and_entropy_terms_and_every_metric_count_policy_tokens():
    loss, m = policy_loss(LossSettings(kl_coef=0.1, entropy_coef=0.01))
    row0, row1 = ppo_token_losses()
    kl_ref = [0.0, k3(-0.7 + 0.5), k3(-1.0 + 1.2), k3(-2.2 + 2.0), 0.0]  # k3 of ref - logp
    entropy = (1.0 + 2.0 + 3.0 + 0.5 + 0.5) / 5
    assert_close(float(m["policy_loss"]), (sum(row0) + sum(row1)) / 5, rtol=1e-5, atol=1e-6)
    assert_close(float(m["kl_loss"]), 0.1 * sum(kl_ref) / 5, rtol=1e-4, atol=1e-7)
    assert_close(float(m["entropy_loss"]), -0.01 * entropy, rtol=1e-5, atol=1e-7)
    assert_close(float(loss), float(m["policy_loss"] + m["kl_loss"] + m["entropy_loss"]))
    expected = {
        "tokens": 5.0,
        "loss_sum": sum(row0) + sum(row1),
        "clipped": 1.0, "clipped_low": 0.0, "clipped_high": 1.0,  # row 0's e^0.5
        "kl_proximal_sum": k3(0.5) + k3(-0.2),  # k3 of logp - proximal
        "is_weight_sum": 4.0 + math.exp(0.5), "is_weight_max": math.exp(0.5),
        "is_truncated": 0.0, "is_masked": 0.0,
        "kl_behaviour_sum": 2 * k3(0.5) + k3(-0.2),  # k3 of logp - behaviour
        "kl_mismatch_sum": k3(0.5),  # k3 of proximal - behaviour: row 1's second token
        "mismatch_sum": 0.5,
        "kl_ref_sum": sum(kl_ref),
        "entropy_sum": 7.0,
    }
    got = {k: float(m[k]) for k in expected}
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_gspo_sequence_ratio_is_the_geometric_mean_over_policy_tokens():
    """s_0 = exp(mean(0, 0.5, -0.2)) = e^0.1, clipped to 1 + 4e-4 (A > 0); s_1 = 1. The
    behaviour weight (geometric, GSPO's default): row 0 exp(mean(0, 0, 0)) = 1, row 1
    exp(mean(0, 0.5)) = e^0.25. Counting the observation targets, s_0 would be
    exp((0.3 + 3 * 4.9) / 6) and row 0's weight exp(45 / 6), truncated to 2."""
    loss, m = policy_loss(LossSettings(objective="gspo", aggregation="seq_mean_token_mean"))
    row0 = -(1 + 4e-4)  # every token of row 0: -min(s A, clip(s) A)
    row1 = 1.0 * math.exp(0.25)
    assert_close(float(loss), (row0 + row1) / 2, rtol=1e-5, atol=1e-6)
    assert float(m["clipped"]) == 3.0  # row 0's three policy tokens, none of its observations
    assert_close(float(m["is_weight_sum"]), 3.0 + 2 * math.exp(0.25), rtol=1e-5, atol=1e-6)


def test_sequence_level_behaviour_weight_sums_policy_tokens():
    """is_level="sequence": row 1's weight exp(0 + 0.5), row 0's exp(0) (observations: 45)."""
    _, m = policy_loss(LossSettings(is_level="sequence"))
    assert_close(float(m["is_weight_sum"]), 3.0 + 2 * math.exp(0.5), rtol=1e-5, atol=1e-6)
    assert float(m["is_truncated"]) == 0.0


def test_gae_bootstraps_across_the_environments_turns():
    """One row, policy targets 1, 2, 5 (observations 3, 4 between turns, 6 after), values
    0.5, 0.2, 0.4 there (9 elsewhere: never read), the outcome 1 on the last policy token,
    gamma 0.9, lambda 0.8. Over the compressed row v = (0.5, 0.2, 0.4), r = (0, 0, 1):
    delta_3 = 1 - 0.4 = 0.6, A_3 = 0.6; delta_2 = 0.9 * 0.4 - 0.2 = 0.16,
    A_2 = 0.16 + 0.72 * 0.6 = 0.592; delta_1 = 0.9 * 0.2 - 0.5 = -0.32,
    A_1 = -0.32 + 0.72 * 0.592 = 0.10624; returns = A + v."""
    mask = torch.tensor([[False, True, True, False, False, True, False]])
    values = torch.tensor([[9.0, 0.5, 0.2, 9.0, 9.0, 0.4, 9.0]])
    rewards = token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 1.0, 0]]  # on the last policy token
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(advantages, torch.tensor([[0, 0.10624, 0.592, 0, 0, 0.6, 0]]))
    assert_close(returns, torch.tensor([[0, 0.60624, 0.792, 0, 0, 1.0, 0]]))


def test_gae_of_a_prefix_row_is_unchanged():
    mask = torch.tensor([[False, True, True, True, False]])
    values = torch.tensor([[0.0, 0.5, 0.2, 0.4, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    advantages, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(advantages, torch.tensor([[0, 0.10624, 0.592, 0.6, 0]]))


def test_kl_penalties_in_the_reward_cover_policy_tokens_only():
    mask = torch.tensor([[False, True, True, False, False, True, False]])
    kl = torch.tensor([[5.0, 0.5, 0.5, 5.0, 5.0, 0.5, 5.0]])
    assert_close(token_rewards(torch.tensor([1.0]), mask, kl, 0.1),
                 torch.tensor([[0, -0.05, -0.05, 0, 0, 0.95, 0]]))
    # RLOO-style sequence reward: r - coef * sum of the policy tokens' KL = 1 - 0.1 * 1.5
    assert_close(kl_penalised_rewards(torch.tensor([1.0]), kl, mask, 0.1),
                 torch.tensor([0.85], dtype=torch.float64))
    returns = kl_penalised_returns(torch.tensor([1.0]), kl, mask, 0.1)  # G_t = 1 - 0.1 sum_i>=t
    assert_close(returns, torch.tensor([[0, 0.85, 0.9, 0, 0, 0.95, 0]], dtype=torch.float64))


def test_reinforce_pp_whitens_over_policy_tokens():
    """Rewards 1 (the episode, 3 policy tokens) and 0 (2 tokens), weights 3 and 2: mean 3/5,
    var (3 * 0.4^2 + 2 * 0.6^2) / 5 = 0.24, A = (0.4, -0.6) / (sqrt(0.24) + 1e-6). Weighted by
    T = 6 instead, A = (1/4, -3/4) / sqrt(0.1875)."""
    _, (advantages,) = outcome_advantages([GROUP], AlgorithmConfig(estimator="reinforce_pp"))
    std = math.sqrt(0.24) + 1e-6
    assert_close(advantages, torch.tensor([0.4 / std, -0.6 / std]))


def test_the_overlong_penalty_measures_the_whole_episode():
    """max_new_tokens 16 recorded, buffer 12: penalty from 4 tokens on. The episode's T = 6
    (3 policy tokens): excess 2, penalty 2 / 12 of 1.0; the 2-token response: none."""
    algorithm = AlgorithmConfig(overlong_buffer=12, overlong_penalty=1.0)
    assert_close(shaped_rewards(GROUP, algorithm), torch.tensor([1.0 - 2 / 12, 0.0],
                                                                dtype=torch.float64))
