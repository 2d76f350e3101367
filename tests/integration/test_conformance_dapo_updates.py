"""DAPO (Yu et al. 2025) through the real `Learner` on a hand-computed batch: overlong reward
shaping, group-normalised advantages, the token-mean clipped objective with clip-higher at the
first update (ratio 1), several updates per batch, and the gradient's direction.

DAPO, Eq. (8) with the learner's decoupled behaviour weight w_t = min(pi_prox / pi_behav, 2):
    L = -1 / sum_i |o_i| * sum_i sum_t w_t min(r_t A_i, clip(r_t, 1 - 0.2, 1 + 0.28) A_i)
Overlong shaping, Eq. (13), L_max = max_new_tokens = 6, L_cache = overlong_buffer = 2:
    R_len(y) = 0 if |y| <= L_max - L_cache, (L_max - L_cache - |y|) / L_cache if |y| <= L_max.
Dynamic sampling as the learner sees it: a group whose rewards are all equal has zero advantages
(the loop drops such groups before they reach it).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles.config import load_config
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group, version_zero_sample as sample

VOCAB = 78
LENGTHS = [3, 6, 6, 5]  # responses of group A; max_new_tokens 6, overlong buffer 2
REWARDS = [1.0, 0.0, 1.0, 0.0]
SHAPED = [1.0, 0.0 - 1.0, 1.0 - 1.0, 0.0 - 0.5]  # + R_len: 0, -(6-4)/2, -(6-4)/2, -(5-4)/2
MEAN = sum(SHAPED) / 4  # -0.125
STD = math.sqrt(sum((r - MEAN) ** 2 for r in SHAPED) / 4)  # population std
ADVANTAGES = [(r - MEAN) / (STD + 1e-6) for r in SHAPED]  # GRPO, Shao et al. 2024, Eq. (3)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


def batch_groups() -> list:
    solved = make_group(4, 3, vocab_size=VOCAB, seed=7, policy_version=0,
                        samples=[sample(3, 1.0, 100 + i) for i in range(4)])  # all equal
    mixed = make_group(4, 6, vocab_size=VOCAB, seed=8, policy_version=0,
                       samples=[sample(n, r, i) for i, (n, r) in enumerate(zip(LENGTHS,
                                                                               REWARDS))])
    return [mixed, solved]


def dapo_learner(model_dir, lr: float) -> Learner:
    algorithm = load_config(AlgorithmConfig, base={**preset("dapo"), "dynamic_sampling": False})
    return Learner(model_dir, LearnerConfig(lr=lr, seed=0, algorithm=algorithm),
                   lora=LoraSettings(r=4, alpha=8))


def test_dapo_advantages_loss_and_gradient_direction(model_dir):
    learner = dapo_learner(model_dir, lr=1e-4)
    groups = batch_groups()
    assert learner.updates_per_step(len(groups)) == 2  # 16 mini-batches, 2 groups: one each
    (mixed_batch,) = learner.micro_batches(groups[:1])
    (solved_batch,) = learner.micro_batches(groups[1:])
    order = [mixed_batch.sample_ids.index((groups[0].group_id, i)) for i in range(4)]
    # shaping and advantages, per sample
    torch.testing.assert_close(mixed_batch.rewards[order], torch.tensor(SHAPED))
    torch.testing.assert_close(mixed_batch.advantages[order], torch.tensor(ADVANTAGES),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(solved_batch.advantages, torch.zeros(4))
    # the first update's loss by hand: ratio 1, so min(r A, clip(r) A) = A
    proximal = learner.score(mixed_batch)  # [B, L-1], what the first update starts from
    mask = mixed_batch.response_mask
    behaviour = mixed_batch.behaviour_logprobs
    weight = torch.exp(proximal - behaviour).clamp(max=2.0)  # decoupled PPO, truncated at 2
    a = mixed_batch.advantages.unsqueeze(1)  # [B, 1]
    first = float(-(weight * a)[mask].sum() / sum(LENGTHS))  # token mean over the 20 tokens
    # the objective the step should raise (first order): J = sum w A logp
    objective = lambda logp: float((weight * a * logp)[mask].sum())  # noqa: E731
    before = objective(proximal)
    metrics = learner.train_step(groups)
    # update 2 trains the solved group: A = 0, policy loss exactly 0 whatever its ratio
    assert metrics["trainer/updates"] == 2
    assert metrics["trainer/policy_loss"] == pytest.approx(first / 2, rel=1e-5)
    assert metrics["trainer/loss"] == pytest.approx(first / 2, rel=1e-5)
    after = objective(learner.score(mixed_batch))
    assert after > before  # the step moved the policy up the DAPO objective
    best, worst = int(np.argmax(ADVANTAGES)), int(np.argmin(ADVANTAGES))
    rows = learner.score(mixed_batch)
    assert float(rows[order[best]][mask[order[best]]].sum()) > \
        float(proximal[order[best]][mask[order[best]]].sum())
    assert float(rows[order[worst]][mask[order[worst]]].sum()) < \
        float(proximal[order[worst]][mask[order[worst]]].sum())


def test_dapo_clip_higher_bounds_the_ratio_asymmetrically(model_dir):
    """Several steps at a high lr: clipped tokens appear, and every clipped token lies outside
    [1 - 0.2, 1 + 0.28] on the side its advantage pushes (the clip of Eq. (8))."""
    learner = dapo_learner(model_dir, lr=5e-2)
    mixed = batch_groups()[0]  # (with the solved group second no clip could fire: its A is 0)
    groups = [mixed, make_group(4, 6, vocab_size=VOCAB, seed=9, policy_version=0, samples=[
        sample(n, 1.0 - r, 50 + i) for i, (n, r) in enumerate(zip(LENGTHS, REWARDS))])]
    steps = [learner.train_step(groups) for _ in range(3)]
    assert sum(m["trainer/clip_frac"] for m in steps) > 0.0
    assert all(m["trainer/clip_frac"] == pytest.approx(
        m["trainer/clip_frac_low"] + m["trainer/clip_frac_high"]) for m in steps)
    # the bounds themselves, on the objective the learner uses
    from miles.rl.objectives import ppo_clip
    settings = learner.algorithm.loss
    ratio = torch.tensor([[0.7, 0.9, 1.2, 1.3, 0.7, 1.3]])
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, -1.0]])
    terms = ppo_clip(ratio.log(), torch.zeros(1, 6), adv, torch.ones(1, 6, dtype=torch.bool),
                     settings=settings)
    # A > 0 clips above 1.28 only; A < 0 below 0.8 only (-min(rA, clip(r)A))
    assert terms.clipped.tolist() == [[False, False, False, True, True, False]]
    torch.testing.assert_close(terms.loss, torch.tensor([[-0.7, -0.9, -1.2, -1.28, 0.8, 1.3]]))
