"""GAE's per-token rewards of a sample with `token_rewards` (an episode's per-turn rewards),
against hand-computed values: the steps at the policy tokens, the rest of the return on the last
one, the KL penalty on each; and the temporal credit this gives a turn-1 token under gamma < 1.
"""

import torch
from torch.testing import assert_close

from miles.rl.advantages import gae_advantages, token_rewards

# One two-turn episode, as a row: turn 1's policy tokens at 0, 1, its observation at 2, 3, turn
# 2's policy tokens at 4, 5, padding at 6.
MASK = torch.tensor([[True, True, False, False, True, True, False]])  # [1, 7]
TURN_REWARDS = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.25, 0.0]])  # on each turn's last token


def test_steps_at_their_tokens_and_the_rest_of_the_return_on_the_last():
    # return 2.0: the steps give 1.25 of it, the remaining 0.75 goes on token 5
    got = token_rewards(torch.tensor([2.0]), MASK, steps=TURN_REWARDS)
    assert_close(got, torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]]))
    assert float(got.sum()) == 2.0  # the undiscounted return is the sample's reward


def test_the_kl_penalty_is_still_subtracted_per_policy_token():
    kl = torch.tensor([[0.2, 0.4, 9.0, 9.0, 0.6, 0.8, 9.0]])  # off the mask: ignored
    got = token_rewards(torch.tensor([2.0]), MASK, kl, coef=0.5, steps=TURN_REWARDS)
    assert_close(got, torch.tensor([[-0.1, 0.8, 0.0, 0.0, -0.3, 0.6, 0.0]]))


def test_zero_steps_are_the_outcome_on_the_last_token_bit_for_bit():
    outcome = torch.tensor([0.7, -1.3, 0.1])  # [3]: not exact in binary
    mask = torch.tensor([[True, True, False], [False, True, True], [True, False, False]])
    kl = torch.tensor([[0.3, 0.1, 0.2], [0.5, 0.7, 0.11], [0.13, 0.0, 0.0]])
    old = token_rewards(outcome, mask, kl, coef=0.05)
    new = token_rewards(outcome, mask, kl, coef=0.05, steps=torch.zeros(3, 3))
    assert torch.equal(new, old)
    assert_close(old[:, -1], torch.tensor([0.0, -1.3 - 0.05 * 0.11, 0.0]))


def test_a_step_off_the_mask_is_not_lost_it_lands_on_the_last_token():
    # the intake refuses one on an observation token; a batch built without it keeps the return
    steps = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]])  # on an observation token
    got = token_rewards(torch.tensor([1.0]), MASK, steps=steps)
    assert_close(got, torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]))


def test_a_row_without_a_valid_token_gets_nothing():
    got = token_rewards(torch.tensor([1.0]), torch.zeros(1, 3, dtype=torch.bool),
                        steps=torch.tensor([[0.5, 0.0, 0.0]]))
    assert_close(got, torch.zeros(1, 3))


def test_a_turn_one_reward_gives_turn_one_tokens_its_credit_under_gamma_below_one():
    """Return 1.0, all of it earned by turn 1 (on token 1); gamma = lam = 0.5, every value 0.5.
    Over the policy tokens k = 1..4 (positions 0, 1, 4, 5), delta_k = r_k + 0.5 V_{k+1} - V_k
    (V_5 = 0), A_k = delta_k + 0.25 A_{k+1}.
    Per turn, r = [0, 1, 0, 0]: delta = [-0.25, 0.75, -0.25, -0.5],
      A_4 = -0.5, A_3 = -0.25 - 0.125 = -0.375, A_2 = 0.75 - 0.09375 = 0.65625,
      A_1 = -0.25 + 0.1640625 = -0.0859375.
    Return on the last token (token_rewards ignored), r = [0, 0, 0, 1]: delta = [-0.25, -0.25,
      -0.25, 0.5], A_4 = 0.5, A_3 = -0.125, A_2 = -0.28125, A_1 = -0.3203125."""
    steps = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    values = torch.where(MASK, 0.5, float("nan"))  # off the mask: never read
    outcome = torch.tensor([1.0])
    per_turn, returns = gae_advantages(token_rewards(outcome, MASK, steps=steps), values, MASK,
                                       gamma=0.5, lam=0.5)
    assert_close(per_turn, torch.tensor([[-0.0859375, 0.65625, 0, 0, -0.375, -0.5, 0]]))
    assert_close(returns, torch.tensor([[0.4140625, 1.15625, 0, 0, 0.125, 0.0, 0]]))
    at_the_end, _ = gae_advantages(token_rewards(outcome, MASK), values, MASK,
                                   gamma=0.5, lam=0.5)
    assert_close(at_the_end, torch.tensor([[-0.3203125, -0.28125, 0, 0, -0.125, 0.5, 0]]))
