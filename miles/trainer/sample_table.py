"""Sample tables: what a trainer step trained on, as rows a person can read (TRL's
`log_completions`, for an asynchronous trainer: each row also says which policy versions wrote
the completion and how stale it was).

Rows are the first samples of the step's trained groups, in the step's order, whole groups
(so a row's advantage can be read against its group's other rewards) until the table is full. Text is decoded
from the wire's token ids with the trainer's tokenizer, special tokens kept, so an episode's
completion shows the observations between its turns exactly as the model saw them. Advantages
are recomputed over all the step's trained groups (the learner does not hand back its own; the
same pure function of the same groups, so the same numbers, cheap next to the step); with a
critic (`gae`) the advantage comes from values, so the column is empty.
"""

from __future__ import annotations

from typing import Any

from miles.protocol import TrajectoryGroup
from miles.rl.algorithm import AlgorithmConfig
from miles.trainer.batching import outcome_advantages


def sample_rows(groups: list[TrajectoryGroup], tokenizer, algorithm: AlgorithmConfig, *,
                step: int, policy_version: int, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` rows {step, group_id, prompt, completion, reward, advantage,
    min_version, max_version, lag, finish_reason} of `groups`, trained at `step` by a
    trainer at `policy_version` (what lags were judged against)."""
    _, advantages = outcome_advantages(groups, algorithm)  # over the batch, as trained
    rows = []
    for group, group_advantages in zip(groups, advantages):
        if len(rows) >= limit:
            break
        prompt = tokenizer.decode(group.prompt_token_ids.tolist())
        for sample, advantage in zip(group.samples, group_advantages.tolist()):
            versions = sample.policy_versions
            rows.append({"step": step, "group_id": group.group_id, "prompt": prompt,
                         "completion": tokenizer.decode(sample.response_token_ids.tolist()),
                         "reward": float(sample.reward),
                         "advantage": None if algorithm.uses_critic else round(advantage, 6),
                         "min_version": int(versions.min()), "max_version": int(versions.max()),
                         "lag": policy_version - int(versions.min()),
                         "finish_reason": sample.finish_reason})
    return rows[:limit]
