"""Per-turn rewards reach PPO's GAE through the real Learner (batching, scoring, the step).

The batch: one group of two episodes (1.4) with their behaviour logprobs the learner's own.
Episode 0 has two turns of 3 policy tokens (6 observation tokens between, T = 12) and earns
its whole return, 1.0, in turn 1: `token_rewards` 1.0 on its token 2 (turn 1's last policy
token).
Episode 1 (2 + 2 policy tokens) has return 0.5 and `token_rewards` all 0. PPO with gamma 0.9,
lam 0.95, one update per step; the value head's bias is 0.3, so every bootstrap term matters.

The checks, on the step's prepared GAE (`prepare`, captured) and on the gradient it hands the
optimizer (a probe: `train_step(apply=False)`, the learner's weights never move):
- each episode's returns are the GAE recurrence over its policy tokens with its token rewards
  at theirs and the rest of its return on its last one (`gae_by_hand`); for episode 0 that is
  not the return-on-the-last-token of a trainer ignoring `token_rewards` (turn 1's returns
  differ by > 0.2), and the gradient of the batch differs from the one without token rewards;
- token rewards all 0 are the old behaviour exactly: episode 1's returns are the same bits with
  or without them, and a batch whose token rewards are all 0 gives the same advantages, returns
  and gradient, bit for bit, as the batch without any.
"""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from miles.trainer import learner as learner_module
from miles.trainer.learner import Learner, LearnerConfig
from tests.factories import make_episode, make_group
from tests.integration.conformance import (LORA, VOCAB, gae_by_hand, preset_config,  # noqa: F401
                                           process_group)

TURNS = [[(3, 6), (3, 0)], [(2, 5), (2, 0)]]
REWARDS = [1.0, 0.5]
TURN_ONE_END = 2  # episode 0's turn 1 ends at response token 2
GAMMA = 0.9
PROMPT = np.array([5, 6, 7], np.int32)
LENGTHS = [sum(p + o for p, o in turns) for turns in TURNS]  # T = 12, 9
MASKS = [np.concatenate([np.r_[np.ones(p, bool), np.zeros(o, bool)] for p, o in turns])
         for turns in TURNS]  # [T] the policy's tokens


def per_turn() -> list[np.ndarray]:
    """Episode 0 earns its return in turn 1; episode 1's token rewards are all 0."""
    first = np.zeros(LENGTHS[0], np.float32)
    first[TURN_ONE_END] = REWARDS[0]
    return [first, np.zeros(LENGTHS[1], np.float32)]


def episodes(token_rewards: list, logprobs: list | None = None) -> list:
    samples = []
    for i, (turns, reward) in enumerate(zip(TURNS, REWARDS)):
        e = make_episode(turns, vocab_size=VOCAB, policy_version=0, seed=i, reward=reward,
                         token_rewards=token_rewards[i])
        ids = np.where(e.response_token_ids < 4, 4, e.response_token_ids).astype(np.int32)
        lp = e.logprobs if logprobs is None else logprobs[i]
        samples.append(type(e)(**{**vars(e), "response_token_ids": ids, "logprobs": lp}))
    return [make_group(prompt_token_ids=PROMPT, samples=samples, vocab_size=VOCAB,
                       group_id="g-t", sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                 "max_new_tokens": 64})]


@pytest.fixture(scope="module")
def learner_and_logprobs(model_dir):
    config = LearnerConfig(lr=1e-3, seed=0, max_tokens_per_micro_batch=256, grad_clip=math.inf,
                           algorithm=preset_config("ppo", gamma=GAMMA))
    learner = Learner(model_dir, config, lora=LORA)
    with torch.no_grad():
        learner.model.value_head.bias.fill_(0.3)
    own = [np.zeros(n, np.float32) for n in LENGTHS]  # observation tokens: 0.0
    for batch in learner.micro_batches(episodes([None, None])):
        logp = learner.score(batch).cpu()  # [B, L-1]
        for row, (_, index) in enumerate(batch.sample_ids):
            start = len(PROMPT) - 1
            scored = logp[row, start:start + LENGTHS[index]].numpy()
            own[index][MASKS[index]] = scored[MASKS[index]]
    return learner, own


@pytest.fixture
def probe(learner_and_logprobs, monkeypatch):
    """`probe(token_rewards)`: (the micro-batches, their prepared extras, the gradient of every
    trained weight) of a probing step on the episodes with those token rewards."""
    learner, own = learner_and_logprobs
    prepared, real_prepare = [], learner_module.prepare
    monkeypatch.setattr(learner_module, "prepare",
                        lambda *a, **k: prepared.append(real_prepare(*a, **k)) or prepared[-1])

    def run(token_rewards: list):
        groups, grads, step = episodes(token_rewards, own), [], learner._step

        def recording(apply, finite):
            grads.append([p.grad.detach().clone() for p in learner.params if p.grad is not None])
            return step(apply, finite)

        learner._step = recording
        try:
            learner.train_step(groups, apply=False)
        finally:
            del learner._step
        (extras,), _ = prepared.pop()
        return learner.micro_batches(groups), extras, grads[0]

    return run


def policy_positions(batch, row: int, index: int) -> list[int]:
    """The targets of episode `index`'s policy tokens in `batch`'s row `row`."""
    positions = (len(PROMPT) - 1 + np.flatnonzero(MASKS[index])).tolist()
    assert batch.response_mask[row].nonzero().squeeze(-1).tolist() == positions
    return positions


def returns_of(batches, extras) -> dict[int, torch.Tensor]:
    """Each episode's GAE returns at its policy tokens, by episode index."""
    return {index: extra.returns[row, policy_positions(batch, row, index)]
            for batch, extra in zip(batches, extras)
            for row, (_, index) in enumerate(batch.sample_ids)}


def test_gae_gives_each_turn_its_reward(probe):
    batches, extras, grads = probe(per_turn())
    old_values = {index: extra.old_values[row, policy_positions(batch, row, index)].tolist()
                  for batch, extra in zip(batches, extras)
                  for row, (_, index) in enumerate(batch.sample_ids)}
    got = returns_of(batches, extras)
    for index, steps in enumerate(per_turn()):
        policy = steps[MASKS[index]].tolist()
        _, expected = gae_by_hand(old_values[index], REWARDS[index], gamma=GAMMA, steps=policy)
        assert_close(got[index], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    _, at_the_end = gae_by_hand(old_values[0], REWARDS[0], gamma=GAMMA)
    gap = (got[0][:3] - torch.tensor(at_the_end[:3])).abs().min()
    assert gap > 0.2, f"turn 1's returns are those of a trainer ignoring token_rewards ({gap})"
    _, _, ignored = probe([None, None])
    num = sum(float((g - h).square().sum()) for g, h in zip(grads, ignored))
    gap = math.sqrt(num / sum(float(h.square().sum()) for h in ignored))
    assert gap > 0.05, f"the gradient does not see the per-turn reward ({gap})"


def test_token_rewards_all_zero_are_the_old_behaviour_bit_for_bit(probe):
    batches, extras, grads = probe([np.zeros(n, np.float32) for n in LENGTHS])
    old_batches, old_extras, old_grads = probe([None, None])
    for extra, old in zip(extras, old_extras, strict=True):
        for name in ("old_values", "advantages", "returns"):
            assert torch.equal(getattr(extra, name), getattr(old, name)), name
    assert len(grads) == len(old_grads) > 0
    assert all(torch.equal(g, h) for g, h in zip(grads, old_grads))
    mixed = returns_of(*probe(per_turn())[:2])  # episode 1 keeps all-zero token rewards
    assert torch.equal(mixed[1], returns_of(old_batches, old_extras)[1])
