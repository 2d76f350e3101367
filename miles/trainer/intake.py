"""What the trainer admits: the checks a decoded group passes before it may enter a batch.

The codec (`miles.protocol.schema`) checks a record against the wire format alone: types, the
ranges that hold for any trainer, sibling arrays of one length, token ids below the record's own
`vocab_size`, finite logprobs <= 0, finite rewards, versions >= 0, and an episode's structure
(1.4: `loss_mask` entries 0 or 1 with at least one policy token, versions -1 exactly on
observation tokens, valid `turn_ends`; `miles.protocol.episodes`). A record can pass all of that
and still end this trainer's step, or silently bend it: a temperature it cannot re-score with, a
vocabulary that is not its model's, a row longer than its memory plan, versions it has not
reached yet, rewards that overflow the advantages. `check_group` tests a `TrajectoryGroup`
against what this trainer computes with (`TrainerLimits`, taken from its learner and config)
and returns the first `Rejection` (the rule, the field, the reason) or None. The loop
dead-letters a rejected group with that reason and skips it (`docs/wire-format.md`, "What the
trainer admits", lists every rule and its limit).

Simplifications:
- A group is checked once, when it is polled, against the trainer's policy version then:
  versions only grow within a trainer process, so a group admitted then is still admissible
  when its step runs.
- Token ids need no rule of their own: the codec keeps them below the record's `vocab_size`,
  and the vocabulary rule makes that the model's.
- The longest row is `learner.max_tokens_per_micro_batch`, the budget the user sized the
  trainer's memory for (`miles.trainer.memory` estimates it); the batcher would otherwise give
  a longer sample a micro-batch of its own, of any size.
- Episodes: every rule that speaks of versions or staleness reads the policy's tokens only
  (`Sample.policy_versions`, `TrajectoryGroup.min_version`): observation tokens (version -1)
  were sampled by no policy. A row is the whole episode (prompt + every turn's tokens): the
  length rule counts observation tokens, which the trainer's forward holds like any other.
- A token reward on an observation token is refused rather than moved to the policy token
  before it: the episode builder never writes one there (docs/wire-format.md, Episodes), a
  foreign producer that does has a bug to surface, and there may be no policy token before it
  (a `loss_mask` without `turn_ends` may open with observations). Moving it would also guess
  at which action earned it.
- Sampling parameters must be numbers of the right kind (an int `top_k`, no bools, no strings
  such as "0.7"): a foreign writer's string is a bug to surface, not a value to guess at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.errors import ConfigError
from miles.protocol import TrajectoryGroup
from miles.protocol.fields import preview
from miles.protocol.limits import MAX_TOKENS_PER_SEQUENCE
from miles.rl.algorithm import AlgorithmConfig
from miles.trainer.batching import (OVERLONG_NEEDS_LIMIT, outcome_advantages,
                                    recorded_max_new_tokens)

if TYPE_CHECKING:
    from miles.trainer.learner import Learner

MIN_TEMPERATURE = 1e-5
"""Lowest temperature the trainer re-scores with: vLLM samples greedily below it (its sampling
epsilon), which no temperature reproduces, and logits / T overflows float32 (nan logprobs) for
T below ~1e-37."""

DEFAULT_MAX_ABS_REWARD = 1e4
"""Default bound on |reward| and |token reward|: rewards are correctness (0/1), format bonuses,
reward-model scores (|r| of order 10) or length penalties, so 1e4 is orders of magnitude of
headroom, while the advantages, losses and gradient norms that scale with the raw reward (Dr.
GRPO, RLOO, GAE returns) stay far from float32's range."""


@dataclass(frozen=True, kw_only=True)
class IntakeConfig:
    """Bounds of what the trainer admits that are not fixed by its model or learner."""

    max_abs_reward: float = DEFAULT_MAX_ABS_REWARD  # groups with a |reward| or |token reward|
    # above this are dead-lettered (see DEFAULT_MAX_ABS_REWARD)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_abs_reward) and self.max_abs_reward > 0):
            raise ConfigError("loop.intake.max_abs_reward must be finite and > 0, got "
                              f"{self.max_abs_reward}")


@dataclass(frozen=True, kw_only=True)
class TrainerLimits:
    """What one trainer computes with, as far as admitting a group goes."""

    vocab_size: int  # rows of the model's embedding matrix
    max_row_tokens: int  # longest prompt + response: learner.max_tokens_per_micro_batch
    max_abs_reward: float  # IntakeConfig.max_abs_reward
    algorithm: AlgorithmConfig  # the advantages a group's rewards must give finitely

    @classmethod
    def of(cls, learner: Learner, config: IntakeConfig) -> TrainerLimits:
        return cls(vocab_size=learner.vocab_size,
                   max_row_tokens=learner.config.max_tokens_per_micro_batch,
                   max_abs_reward=config.max_abs_reward, algorithm=learner.algorithm)


@dataclass(frozen=True)
class Rejection:
    """Why a group is not admitted: `rule` (a metric key part), the `field` path, the reason."""

    rule: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def check_group(group: TrajectoryGroup, limits: TrainerLimits, *,
                policy_version: int) -> Rejection | None:
    """The first rule `group` breaks for a trainer at `policy_version` with `limits`, or None."""
    return (check_sampling(group, limits) or check_overlong(group, limits)
            or check_vocabulary(group, limits)
            or check_lengths(group, limits) or check_versions(group, policy_version)
            or check_rewards(group, limits) or check_reward_positions(group)
            or check_advantages(group, limits))


def _number(value: object) -> bool:
    return type(value) in (int, float)  # bool is not a number here


def check_sampling(group: TrajectoryGroup, limits: TrainerLimits) -> Rejection | None:
    """The sampling parameters the trainer re-scores with (`batching.sampling_setting`) and the
    response limit it normalises and shapes with (`batching.max_new_tokens`)."""
    params = group.sampling
    checks = {
        "temperature": (_number, lambda t: t >= MIN_TEMPERATURE,
                        f"a number >= {MIN_TEMPERATURE:g}"),
        "top_p": (_number, lambda p: 0 < p <= 1, "a number in (0, 1]"),
        "top_k": (lambda k: type(k) is int, lambda k: True, "an int (<= 0: no top-k filter)"),
        "max_new_tokens": (lambda n: type(n) is int, lambda n: 0 <= n <= MAX_TOKENS_PER_SEQUENCE,
                           f"an int in [0, {MAX_TOKENS_PER_SEQUENCE}] (0: not recorded)"),
    }
    for name, (typed, in_range, expected) in checks.items():
        if name in params and not (typed(params[name]) and in_range(params[name])):
            return Rejection("sampling", f"sampling.{name}",
                             f"must be {expected}, got {preview(params[name])}")
    return None


def check_overlong(group: TrajectoryGroup, limits: TrainerLimits) -> Rejection | None:
    """Under the overlong penalty the group records the response limit it was sampled with
    (else its longest response would be taken for the limit and get the full penalty)."""
    if limits.algorithm.overlong_buffer and recorded_max_new_tokens(group) <= 0:
        return Rejection("overlong", "sampling.max_new_tokens",
                         OVERLONG_NEEDS_LIMIT.removeprefix("sampling.max_new_tokens "))
    return None


def check_vocabulary(group: TrajectoryGroup, limits: TrainerLimits) -> Rejection | None:
    """The group's vocabulary is the model's (so are its token ids: the codec keeps them below
    `vocab_size`)."""
    if group.vocab_size != limits.vocab_size:
        return Rejection("vocab_size", "vocab_size",
                         f"{group.vocab_size} is not the trainer's model's {limits.vocab_size}")
    return None


def check_lengths(group: TrajectoryGroup, limits: TrainerLimits) -> Rejection | None:
    """Every row (prompt + response) fits one micro-batch of the trainer's token budget."""
    prompt = len(group.prompt_token_ids)
    budget = f"learner.max_tokens_per_micro_batch = {limits.max_row_tokens}"
    if prompt + 1 > limits.max_row_tokens:
        return Rejection("length", "prompt_token_ids",
                         f"{prompt} tokens leave no room for a response within {budget}")
    for i, sample in enumerate(group.samples):
        if prompt + len(sample.response_token_ids) > limits.max_row_tokens:
            return Rejection("length", f"samples[{i}].response_token_ids",
                             f"prompt + response = {prompt + len(sample.response_token_ids)} "
                             f"tokens, above {budget}")
    return None


def check_versions(group: TrajectoryGroup, policy_version: int) -> Rejection | None:
    """No policy token claims a policy version the trainer has not reached (its lag would be
    negative and pass any staleness bound); the codec already keeps them >= 0 (an episode's
    observation tokens -1, which no policy sampled)."""
    arrays = [s.versions for s in group.samples]  # -1 (observations) is never above
    whole = np.frombuffer(b"".join(arrays), dtype=arrays[0].dtype)
    if int(whole.max()) <= policy_version:
        return None
    for i, versions in enumerate(arrays):
        above = np.flatnonzero(versions > policy_version)
        if above.size:
            k = int(above[0])
            return Rejection("versions", f"samples[{i}].versions",
                             f"policy version {int(versions[k])} at index {k} is above the "
                             f"trainer's {policy_version}")
    raise AssertionError("versions above the trainer's found in the whole but in no sample")


def check_rewards(group: TrajectoryGroup, limits: TrainerLimits) -> Rejection | None:
    """|reward| and every |token reward| at most `max_abs_reward`."""
    bound = limits.max_abs_reward
    for i, sample in enumerate(group.samples):
        if abs(sample.reward) > bound:
            return Rejection("rewards", f"samples[{i}].reward",
                             f"|{sample.reward:g}| is above loop.intake.max_abs_reward = {bound:g}")
        rewards = sample.token_rewards
        if rewards is not None and float(np.abs(rewards).max()) > bound:
            k = int(np.argmax(np.abs(rewards)))
            return Rejection("rewards", f"samples[{i}].token_rewards",
                             f"|{float(rewards[k]):g}| at index {k} is above "
                             f"loop.intake.max_abs_reward = {bound:g}")
    return None


def check_reward_positions(group: TrajectoryGroup) -> Rejection | None:
    """No token reward on an episode's observation token (loss_mask 0): GAE gives a reward to
    the policy token whose action earned it, and an observation token is no action."""
    for i, sample in enumerate(group.samples):
        rewards, mask = sample.token_rewards, sample.loss_mask
        if rewards is None or mask is None:
            continue
        off = np.flatnonzero((rewards != 0) & (mask == 0))
        if off.size:
            k = int(off[0])
            return Rejection("reward_positions", f"samples[{i}].token_rewards",
                             f"{float(rewards[k]):g} at index {k} is on an observation token "
                             "(loss_mask 0); a turn's reward goes on its last policy token")
    return None


def check_advantages(group: TrajectoryGroup, limits: TrainerLimits) -> Rejection | None:
    """The group's shaped rewards and its advantages under the trainer's estimator are finite."""
    rewards, advantages = outcome_advantages([group], limits.algorithm)
    if bool(torch.isfinite(rewards[0]).all() and torch.isfinite(advantages[0]).all()):
        return None
    return Rejection("advantages", "samples.reward",
                     f"the {limits.algorithm.estimator} advantages of these rewards are not "
                     "finite")
