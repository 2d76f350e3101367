"""Episodes through the real Learner: observation tokens are context, never trained.

The batch: one group of three episodes (1.4), rewards [1, 0, 0], each turn's policy tokens
followed by 20-30 observation tokens; 13 policy tokens against 110 observation tokens, so an
observation token trained would dominate the gradient. GRPO: A = [sqrt(2), -1/sqrt(2),
-1/sqrt(2)] (population std sqrt(2)/3 of [1, 0, 0]); the behaviour logprobs of the policy tokens
are the learner's own, so at the step's single update every ratio and importance weight is 1 and
the loss is -(1/13) sum_i A_i sum_{policy t} logp_i,t in value and gradient.

The check: the gradient the learner's `train_step` hands its optimizer (captured by a step
pre-hook, clipping off) equals the gradient of that loss computed here by hand from a plain
forward of each episode (observation tokens in the context, out of the sum); and the same loss
summed over every response token, what a trainer ignoring the mask would follow, is far from
it (relative gap > 0.5; with the batcher's mask set on every response token the learner's
gradient is 0.89 away from the expected one). PPO: the critic's GAE over the same episodes is
checked against the recurrence written over each episode's policy tokens.
"""

import math

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from miles.trainer.learner import Learner, LearnerConfig
from tests.factories import make_episode, make_group
from tests.integration.conformance import (LORA, VOCAB, gae_by_hand, preset_config,  # noqa: F401
                                           process_group)

TURNS = [[(2, 20), (1, 20), (2, 0)], [(3, 25), (3, 0)], [(1, 30), (1, 15)]]
REWARDS = [1.0, 0.0, 0.0]
A = [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)]
POLICY_TOKENS = 13
PROMPT = np.array([5, 6, 7], np.int32)


def episodes(logprobs=None):
    samples = []
    for i, (turns, reward) in enumerate(zip(TURNS, REWARDS)):
        e = make_episode(turns, vocab_size=VOCAB, policy_version=0, seed=i, reward=reward)
        ids = np.where(e.response_token_ids < 4, 4, e.response_token_ids).astype(np.int32)
        lp = e.logprobs if logprobs is None else logprobs[i]
        samples.append(type(e)(**{**vars(e), "response_token_ids": ids, "logprobs": lp}))
    return [make_group(prompt_token_ids=PROMPT, samples=samples, vocab_size=VOCAB,
                       group_id="g-e", sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                 "max_new_tokens": 64})]


def build(model_dir) -> Learner:
    config = LearnerConfig(lr=1e-3, max_tokens_per_micro_batch=256, seed=0, precision="fp32",
                           grad_clip=math.inf, algorithm=preset_config("grpo"))
    return Learner(model_dir, config, lora=LORA)


def row_logprobs(learner: Learner, sample) -> torch.Tensor:
    """logp of each response token of `sample` after the prompt, [T], by a plain forward of
    the learner's model (train mode: what its update sees)."""
    ids = torch.from_numpy(np.concatenate([PROMPT, sample.response_token_ids]).astype(np.int64))
    logits = learner.model(input_ids=ids.unsqueeze(0),
                           position_ids=torch.arange(len(ids)).unsqueeze(0)).logits[0]
    logp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[1:].unsqueeze(-1))
    return logp.squeeze(-1)[len(PROMPT) - 1:]  # [T]


def gradients(learner: Learner) -> list[torch.Tensor]:
    return [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for p in learner.actor_params]


def hand_gradient(learner: Learner, groups, *, observations: bool) -> list[torch.Tensor]:
    """Gradient of -(1/N) sum_i A_i sum_t logp_i,t over the policy tokens (N = 13), or over every
    response token (N = all) with `observations`."""
    learner.trained.train()
    samples = groups[0].samples
    masks = [torch.ones(len(s.response_token_ids), dtype=torch.bool) if observations
             else torch.from_numpy(s.policy_mask) for s in samples]
    n = sum(int(m.sum()) for m in masks)
    loss = -sum(a * row_logprobs(learner, s)[m].sum() for a, s, m in zip(A, samples, masks)) / n
    loss.backward()
    grads = gradients(learner)
    learner.optimizer.zero_grad(set_to_none=True)
    return grads


def relative_gap(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    num = sum(float((x - y).square().sum()) for x, y in zip(xs, ys))
    return math.sqrt(num / sum(float(y.square().sum()) for y in ys))


@pytest.fixture(scope="module")
def learner_and_batch(model_dir):
    learner = build(model_dir)
    with torch.no_grad():
        learner.trained.eval()
        scored = [row_logprobs(learner, s) for s in episodes()[0].samples]
    own = [torch.where(torch.from_numpy(s.policy_mask), lp, 0.0).numpy().astype(np.float32)
           for s, lp in zip(episodes()[0].samples, scored)]  # observation tokens: 0.0
    return learner, episodes(own)


def test_the_update_follows_the_policy_tokens_only(learner_and_batch):
    learner, groups = learner_and_batch
    assert sum(s.policy_tokens for s in groups[0].samples) == POLICY_TOKENS
    assert sum(len(s.response_token_ids) for s in groups[0].samples) == POLICY_TOKENS + 110
    expected = hand_gradient(learner, groups, observations=False)
    wrong = hand_gradient(learner, groups, observations=True)
    assert relative_gap(wrong, expected) > 0.5  # observation tokens would dominate
    captured = []
    hook = learner.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: captured.append(gradients(learner)))
    try:
        metrics = learner.train_step(groups)
    finally:
        hook.remove()
    (got,) = captured
    assert relative_gap(got, expected) < 1e-4, relative_gap(got, expected)
    assert metrics["trainer/tokens"] == POLICY_TOKENS
    loss = -(A[0] * 5 + A[1] * 6 + A[2] * 2) / POLICY_TOKENS
    assert abs(metrics["trainer/loss"] - loss) < 1e-4, (metrics["trainer/loss"], loss)
    assert abs(metrics["trainer/is_weight_mean"] - 1.0) < 1e-5
    assert metrics["trainer/clip_frac"] == 0.0


def test_ppo_gae_runs_over_policy_tokens_across_turns(model_dir, monkeypatch):
    """PPO (critic): the GAE of each episode is the recurrence over its policy tokens only, the
    next turn's first policy token bootstrapping the previous turn's last; observation targets
    get advantage 0 and return 0, and the value loss is a mean over the 13 policy tokens."""
    from miles.config import load_config
    from miles.rl.algorithm import AlgorithmConfig, preset
    from miles.trainer import learner as learner_module

    algorithm = load_config(AlgorithmConfig, base={**preset("ppo"), "ppo_epochs": 1})
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, seed=0, max_tokens_per_micro_batch=256,
                                               precision="fp32", algorithm=algorithm),
                      lora=LORA)
    with torch.no_grad():  # a value head that is not ~0: the bootstrap terms all matter
        learner.model.value_head.bias.fill_(0.3)
    groups = episodes()
    captured = []
    real_prepare = learner_module.prepare

    def keep(*args, **kwargs):
        out = real_prepare(*args, **kwargs)
        captured.append(out)
        return out

    monkeypatch.setattr(learner_module, "prepare", keep)
    batches = learner.micro_batches(groups)
    metrics = learner.train_step(groups)
    (extras,), _ = captured[0]
    raw, expected_returns, masks = [], [], []
    for batch, extra in zip(batches, extras):
        raw.append(torch.zeros_like(extra.old_values))
        expected_returns.append(torch.zeros_like(extra.old_values))
        masks.append(batch.response_mask)
        for row, (_, index) in enumerate(batch.sample_ids):
            sample = groups[0].samples[index]
            positions = (len(PROMPT) - 1 + np.flatnonzero(sample.loss_mask)).tolist()
            assert batch.response_mask[row].nonzero().squeeze(-1).tolist() == positions
            values = [float(extra.old_values[row, p]) for p in positions]
            a, r = gae_by_hand(values, REWARDS[index])
            raw[-1][row, positions] = torch.tensor(a)
            expected_returns[-1][row, positions] = torch.tensor(r)
    flat = torch.cat([r[m] for r, m in zip(raw, masks)]).double()
    assert flat.numel() == POLICY_TOKENS
    std = math.sqrt(float(flat.var(unbiased=False)))
    for extra, r, ret, mask in zip(extras, raw, expected_returns, masks):
        assert_close(extra.returns, ret, rtol=1e-5, atol=1e-6)  # 0 off the policy tokens
        assert_close(extra.advantages, torch.where(mask, (r - flat.mean()) / (std + 1e-8), 0.0)
                     .float(), rtol=1e-4, atol=1e-5)
    value = sum(float((0.5 * (e.old_values - ret) ** 2)[m].sum())
                for e, ret, m in zip(extras, expected_returns, masks)) / POLICY_TOKENS
    assert metrics["trainer/value_loss"] == pytest.approx(value, rel=1e-5)
    assert metrics["trainer/tokens"] == POLICY_TOKENS
