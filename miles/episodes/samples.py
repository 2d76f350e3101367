"""An episode as it is recorded: its turns, how it ended, and the wire `Sample` it becomes.

The sample (see docs/wire-format.md, Episodes): `response_token_ids` are every token after the
first prompt (each turn's sampled ids, then its observation's ids); `loss_mask` 1 on sampled
ids; `versions` the sampling policy version, -1 on observations; `logprobs` as sampled, 0.0 on
observations; `turn_ends` each turn's exclusive end; `token_rewards` each step's reward on the
turn's last policy token (only when some step gave one); `reward` the episode's return, the
sum of the step rewards given (the environment contract: an environment that scores only the
end gives one reward on its last step); `episode` the counters.

Single-turn compatibility: an episode of one turn without observation tokens is written as a
1.3 single-turn sample (no mask, turn ends or token rewards), and with `compact=True` (the
`SingleTurn` environment) without an `episode` map either, exactly as producers wrote it
before environments.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from miles.engines.base import Completion
from miles.protocol import FLOAT_DTYPE, TOKEN_DTYPE, Sample
from miles.protocol.limits import OBSERVATION_VERSION

ENV_S_DIGITS = 4  # env_s is rounded in the episode map (informational)


@dataclass
class Turn:
    """One model turn and what the environment answered."""

    completion: Completion
    reward: float | None = None
    observation: list[int] = field(default_factory=list)
    versions: np.ndarray | None = None  # [T] per-token policy versions (None: the completion's)


@dataclass
class EpisodeRecord:
    """Everything known about one episode; `sample()` is its wire form."""

    task_index: int
    order: int = 0  # its position among the batch's episodes (its rows' order in a round)
    prompt: list[int] | None = None  # the first prompt's ids (the group's prompt_token_ids)
    turns: list[Turn] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    unk_observations: int = 0  # observations with the tokenizer's unknown token; not on the wire
    env_s: float = 0.0
    work_s: float = 0.0  # the producer's own time on it (decode, render, its sample; not the
    # engine, not the environment); not on the wire
    truncated: str | None = None  # which limit cut the episode short
    failure: str | None = None  # why the episode failed (kind: message); never trained
    failure_kind: str | None = None
    reward_error: str | None = None  # the final step's info["error"] (a reward that failed)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def length(self) -> int:
        return sum(len(t.completion.token_ids) + len(t.observation) for t in self.turns)

    @contextmanager
    def working(self) -> Iterator[None]:
        """Count the time of the block as the producer's own work on this episode."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.work_s += time.perf_counter() - began

    def fail(self, kind: str, message: str) -> None:
        if self.failure is None:
            self.failure_kind, self.failure = kind, f"{kind}: {message}"

    def finish_reason(self) -> str:
        if self.failed:
            return "abort"
        if self.truncated is not None:
            return "length"
        return "stop"

    def sample(self, *, compact: bool = False) -> Sample | None:
        """The wire sample, or None when no turn was generated (nothing to record)."""
        if not self.turns:
            return None
        ids, logprobs, versions, mask, ends, rewards = [], [], [], [], [], []
        end = 0
        for turn in self.turns:
            c, obs = turn.completion, turn.observation
            ids += [c.token_ids, np.asarray(obs, dtype=TOKEN_DTYPE)]
            logprobs += [c.logprobs, np.zeros(len(obs), dtype=FLOAT_DTYPE)]
            versions += [np.full(len(c.token_ids), c.policy_version, dtype=TOKEN_DTYPE)
                         if turn.versions is None else turn.versions.astype(TOKEN_DTYPE),
                         np.full(len(obs), OBSERVATION_VERSION, dtype=TOKEN_DTYPE)]
            mask += [np.ones(len(c.token_ids), dtype=np.uint8), np.zeros(len(obs), np.uint8)]
            rewards.append((end + len(c.token_ids) - 1, turn.reward))
            end += len(c.token_ids) + len(obs)
            ends.append(end)
        single = len(self.turns) == 1 and not self.turns[0].observation
        given = [(i, r) for i, r in rewards if r is not None]
        token_rewards = None
        if given and not single:
            token_rewards = np.zeros(end, dtype=FLOAT_DTYPE)
            for i, r in given:
                token_rewards[i] = r
        return Sample(
            response_token_ids=np.concatenate(ids).astype(TOKEN_DTYPE),
            logprobs=np.concatenate(logprobs).astype(FLOAT_DTYPE),
            versions=np.concatenate(versions), reward=float(sum(r for _, r in given)),
            token_rewards=token_rewards, finish_reason=self.finish_reason(),
            error=self.failure or self.reward_error,
            loss_mask=None if single else np.concatenate(mask),
            turn_ends=None if single else np.asarray(ends, dtype=TOKEN_DTYPE),
            episode={} if compact and not self.failed else self.summary())

    def summary(self) -> dict[str, str | int | float]:
        """The `episode` map: turns, tool_calls, tool_errors, env_s; truncated and failed when
        they apply."""
        out: dict[str, str | int | float] = {
            "turns": len(self.turns), "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors, "env_s": round(self.env_s, ENV_S_DIGITS)}
        if self.truncated is not None:
            out["truncated"] = self.truncated
        if self.failure_kind is not None:
            out["failed"] = self.failure_kind
        return out
