"""Shared batch and checks of the per-preset conformance tests (tests/integration/
test_conformance_*.py): a small batch whose advantages and loss are computed by hand in each
test, trained by the real `Learner` on the tiny model.

The batch: group "a" with rewards [1, 0, 0] and responses of 2, 3 and 4 tokens, group "b" with
rewards [1, 1] and 2 tokens each (sizes differ on purpose: REINFORCE++ must see both at once);
13 response tokens, 5 rows, max_new_tokens 4. Each sample's behaviour logprobs are the learner's
own (scored before the step), so every importance weight and, at the first update, every
current/proximal ratio is 1: the policy term per token is then -A (PPO, GSPO), -A logp (CISPO).

Checks: the advantages of the learner's micro-batches, the step's loss and that the step moved
the policy in the direction of the surrogate: sum_i A_i * sum_t logp_i,t (the policy-gradient
objective at ratio 1) grows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from miles.rl.advantages import AdvantageSettings
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.rl.losses import LossSettings
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group, make_sample

VOCAB = 78  # the tiny character tokenizer
LORA = LoraSettings(r=4, alpha=8)
REWARDS = {"a": [1.0, 0.0, 0.0], "b": [1.0, 1.0]}
LENGTHS = {"a": [2, 3, 4], "b": [2, 2]}
MAX_NEW_TOKENS = 4
TOKENS = 13  # sum of LENGTHS
ROWS = 5
SCHEDULE = ("mini_batches", "ppo_epochs")  # one update per step here: the ratio stays 1


def preset_config(name: str, **changes) -> AlgorithmConfig:
    """The preset's AlgorithmConfig with one update per step (the objective and estimator are
    what these tests check; the schedule has its own tests) and `changes`."""
    fields = dict(preset(name))
    fields["loss"] = LossSettings(**fields.get("loss", {}))
    fields["advantage"] = AdvantageSettings(**fields.get("advantage", {}))
    names = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    schedule = {k: 1 for k in SCHEDULE if k in names}
    return AlgorithmConfig(**(fields | schedule | changes))


def build(model_dir, algorithm: AlgorithmConfig, *, lr: float = 1e-3) -> Learner:
    config = LearnerConfig(lr=lr, max_tokens_per_micro_batch=64, seed=0, algorithm=algorithm)
    return Learner(model_dir, config, lora=LORA)


def batch_groups(learner: Learner) -> list:
    """The batch above, with behaviour logprobs the learner's own."""
    drafts = [_group(g, None) for g in REWARDS]
    scored = _scored(learner, drafts)
    return [_group(g, scored) for g in REWARDS]


def _group(name: str, logprobs: dict | None):
    rng = np.random.default_rng(ord(name))
    samples = []
    for i, (reward, n) in enumerate(zip(REWARDS[name], LENGTHS[name])):
        tokens = rng.integers(3, VOCAB, n, dtype=np.int32)
        lp = logprobs[(f"g-{name}", i)] if logprobs else np.full(n, -1.0, dtype=np.float32)
        samples.append(make_sample(n, vocab_size=VOCAB, response_token_ids=tokens,
                                   logprobs=lp, reward=reward))
    return make_group(prompt_tokens=3, vocab_size=VOCAB, samples=samples, seed=ord(name),
                      group_id=f"g-{name}",
                      sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                "max_new_tokens": MAX_NEW_TOKENS})


@torch.no_grad()
def _scored(learner: Learner, groups: list) -> dict:
    """The learner's logprobs of each sample's response tokens, by sample id."""
    out = {}
    for batch in learner.micro_batches(groups):
        logp = learner.score(batch).cpu()  # [B, L-1]
        for row, sample_id in enumerate(batch.sample_ids):
            out[sample_id] = logp[row][batch.response_mask[row]].numpy().astype(np.float32)
    return out


def advantages_by_sample(learner: Learner, groups: list) -> dict:
    """The outcome advantages the learner trains each sample with."""
    return {sample_id: float(batch.advantages[row])
            for batch in learner.micro_batches(groups)
            for row, sample_id in enumerate(batch.sample_ids)}


@torch.no_grad()
def logprob_sums(learner: Learner, groups: list) -> dict:
    """sum_t logp of each sample's response under the learner's current policy."""
    out = {}
    for batch in learner.micro_batches(groups):
        logp = learner.score(batch).cpu()  # [B, L-1]
        for row, sample_id in enumerate(batch.sample_ids):
            out[sample_id] = float(logp[row][batch.response_mask[row]].sum())
    return out


def surrogate(advantages: dict, sums: dict) -> float:
    """The policy-gradient objective at ratio 1: sum_i A_i * sum_t logp_i,t."""
    return sum(advantages[k] * sums[k] for k in advantages)


def expected(values: dict) -> dict:
    """{(group_id, index): value} from {"a": [...], "b": [...]}."""
    return {(f"g-{g}", i): v for g, vs in values.items() for i, v in enumerate(vs)}


def tokens_weighted_sum(advantages: dict) -> float:
    """sum_i n_i A_i: with ratio 1, -this / 13 is the token-mean PPO loss."""
    return sum(advantages[(f"g-{g}", i)] * n for g, ns in LENGTHS.items()
               for i, n in enumerate(ns))


def step_and_check_direction(learner: Learner, groups: list, advantages: dict) -> dict:
    """One train step; asserts it raised the surrogate; returns the step's metrics."""
    before = surrogate(advantages, logprob_sums(learner, groups))
    metrics = learner.train_step(groups)
    after = surrogate(advantages, logprob_sums(learner, groups))
    assert after > before, (before, after)
    return metrics


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """Imported by each conformance module: its learners share one in-process group."""
    yield
    distributed.destroy()


def trained_weights(learner: Learner) -> dict[str, torch.Tensor]:
    """Full copies of the learner's trained parameters, by name."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in learner.model.named_parameters() if p.requires_grad}


@torch.no_grad()
def aggregated_loss(learner: Learner, groups: list) -> float:
    """The policy loss the learner's settings give on the batch at its current weights, summed
    over its micro-batches with the batch's normalisers (as the learner accumulates it)."""
    from miles.rl.aggregation import Normalisers
    from miles.rl.losses import compute_policy_loss

    normalisers = Normalisers(tokens=float(TOKENS), rows=float(ROWS),
                              constant=float(MAX_NEW_TOKENS))
    total = 0.0
    for batch in learner.micro_batches(groups):
        logp = learner.score(batch)  # [B, L-1]
        mask = batch.response_mask.to(logp.device)
        loss, _ = compute_policy_loss(
            logp, logp, batch.behaviour_logprobs.to(logp.device),
            batch.advantages.to(logp.device).unsqueeze(1), mask, normalisers=normalisers,
            settings=learner.kl.loss_settings())
        total += float(loss)
    return total


def gae_by_hand(values: list[float], reward: float, lam: float = 0.95, *, gamma: float = 1.0,
                steps: list[float] | None = None) -> tuple[list, list]:
    """A_k and returns_k over a response's (or an episode's policy) tokens k = 1..m in order:
    delta_k = r_k + gamma V_{k+1} - V_k with V_{m+1} = 0; r_k is `steps[k]` (the token rewards
    at the policy tokens; default none) plus, on k = m, what they leave of the outcome reward."""
    n, advantages, running = len(values), [0.0] * len(values), 0.0
    steps = steps or [0.0] * n
    for k in reversed(range(n)):
        following = values[k + 1] if k + 1 < n else 0.0
        rest = reward - sum(steps) if k == n - 1 else 0.0
        delta = steps[k] + rest + gamma * following - values[k]
        running = delta + gamma * lam * running
        advantages[k] = running
    return advantages, [a + v for a, v in zip(advantages, values)]
