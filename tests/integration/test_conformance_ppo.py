"""PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022) through the real `Learner` on a
hand-computed batch: GAE advantages and returns from the critic's old values, whitened over the
batch, the clipped surrogate and value losses at the first update, and the gradient's direction.

GAE (Schulman et al. 2016, Eq. (16)), gamma = 1, lambda = 0.95, the outcome reward R on the last
response token, V_{T} = 0 after it:
    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = sum_k (gamma lambda)^k delta_{t+k},
    returns_t = A_t + V_t,   A_t <- (A_t - mean(A)) / (std(A) + 1e-8) over all response tokens.
PPO-clip (Eq. (7)) with the decoupled behaviour weight w_t = min(pi_prox / pi_behav, 2), and the
clipped value loss (value_clip 0.2), both token means over the N response tokens:
    L_pi = -1/N sum_t w_t min(r_t A_t, clip(r_t, 0.8, 1.2) A_t)    (r_t = 1 at the first update)
    L_V = 1/N sum_t 0.5 max((V_t - R_t)^2, (V_old + clip(V - V_old, +-0.2) - R_t)^2)
    trainer/loss = L_pi + value_coef * L_V    (value_coef 0.5)
"""

from __future__ import annotations

import math

import pytest
import torch

from miles.config import load_config
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.trainer import distributed, learner as learner_module
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group, version_zero_sample as sample
from tests.integration.conformance import gae_by_hand

VOCAB = 78
LENGTHS, REWARDS = [4, 2, 5, 3], [1.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


def test_ppo_gae_losses_and_gradient_direction(model_dir, monkeypatch):
    algorithm = load_config(AlgorithmConfig, base={**preset("ppo"), "ppo_epochs": 1})
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, seed=0, algorithm=algorithm),
                      lora=LoraSettings(r=4, alpha=8))
    with torch.no_grad():  # a value head that is not ~0: the GAE terms all matter
        learner.model.value_head.bias.fill_(0.3)
    group = make_group(4, 5, vocab_size=VOCAB, seed=3, policy_version=0,
                       samples=[sample(n, r, i) for i, (n, r) in enumerate(zip(LENGTHS,
                                                                               REWARDS))])
    captured = []
    real_prepare = learner_module.prepare

    def keep(*args, **kwargs):
        out = real_prepare(*args, **kwargs)
        captured.append(out)
        return out

    monkeypatch.setattr(learner_module, "prepare", keep)
    (batch,) = learner.micro_batches([group])
    mask = batch.response_mask
    proximal = learner.score(batch)  # [B, L-1]: the first update's current == proximal
    metrics = learner.train_step([group])
    ((extra,),), critic_metrics = captured[0]  # one slice of one micro-batch
    # GAE by hand from the old values the learner scored, row by row
    raw, returns = torch.zeros_like(extra.old_values), torch.zeros_like(extra.old_values)
    for row in range(len(LENGTHS)):
        sample_index = batch.sample_ids[row][1]
        positions = mask[row].nonzero().squeeze(-1).tolist()
        values = [float(extra.old_values[row, p]) for p in positions]
        a, r = gae_by_hand(values, REWARDS[sample_index])
        raw[row, positions], returns[row, positions] = torch.tensor(a), torch.tensor(r)
    flat = raw[mask].double()
    whitened = (raw - flat.mean()) / (math.sqrt(float(flat.var(unbiased=False))) + 1e-8)
    torch.testing.assert_close(extra.returns[mask], returns[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(extra.advantages[mask], whitened[mask].float(), rtol=1e-4,
                               atol=1e-5)
    # explained variance of the old values: 1 - Var(R - V) / Var(R)
    ret, err = returns[mask].double(), (returns - extra.old_values)[mask].double()
    expected_ev = 1.0 - float(err.var(unbiased=False) / ret.var(unbiased=False))
    assert critic_metrics["trainer/value_explained_var"] == pytest.approx(expected_ev, rel=1e-5)
    # the first update's losses by hand (ratio 1; new values == old values: no value clip)
    n = sum(LENGTHS)
    weight = torch.exp(proximal - batch.behaviour_logprobs).clamp(max=2.0)
    policy = float(-(weight * extra.advantages)[mask].sum() / n)
    value = float((0.5 * (extra.old_values - returns) ** 2)[mask].sum() / n)
    assert metrics["trainer/policy_loss"] == pytest.approx(policy, rel=1e-5, abs=1e-7)
    assert metrics["trainer/value_loss"] == pytest.approx(value, rel=1e-5)
    assert metrics["trainer/loss"] == pytest.approx(policy + 0.5 * value, rel=1e-5)
    assert metrics["trainer/clip_frac"] == 0.0 and metrics["trainer/value_clip_frac"] == 0.0
    # direction: the surrogate sum w A logp rose, the critic moved toward the returns
    objective = lambda logp: float((weight * extra.advantages * logp)[mask].sum())  # noqa: E731
    assert objective(learner.score(batch)) > objective(proximal)
    with torch.no_grad():
        new_values = learner.scorer.values(batch)  # after the update (no dropout here)
    assert float((0.5 * (new_values - returns) ** 2)[mask].sum() / n) < value
