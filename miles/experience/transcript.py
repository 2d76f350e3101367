"""A trajectory group as text a person reads: each sample's turns, the model's words apart
from the environment's, decoded with the run's tokenizer (`miles tail --model-dir`).

A sample's response is cut at its `turn_ends` (one turn: the whole response); inside a turn the
`loss_mask` separates the model's tokens (1) from the observation after them (0). A turn's
reward is its `token_rewards` at the turn's last model token (the step's reward, `-` if the
environment gave none); the wire records why the episode ended, not why each turn did, so the
last turn carries the sample's finish reason and the earlier ones `turn` (ended by a stop
string or EOS, then observed). Texts are decoded with special tokens kept (an EOS the model
sampled shows) and quoted as JSON strings, so a newline stays on its line.
"""

from __future__ import annotations

import json

import numpy as np

from miles.protocol import Sample, TrajectoryGroup

INDENT = "  "


def transcript(group: TrajectoryGroup, tokenizer) -> list[str]:
    """The group's prompt and every sample's turns, one line each (indented)."""
    lines = [f"{INDENT}prompt {_decoded(tokenizer, group.prompt_token_ids)}"]
    for index, sample in enumerate(group.samples):
        lines.append(f"{INDENT}sample {index} reward {sample.reward:.3g} "
                     f"finish {sample.finish_reason}" + _episode_notes(sample))
        lines += [f"{INDENT * 2}{line}" for line in _turns(sample, tokenizer)]
    return lines


def _turns(sample: Sample, tokenizer) -> list[str]:
    ids = sample.response_token_ids
    mask = np.ones(len(ids), dtype=bool) if sample.loss_mask is None else sample.loss_mask == 1
    ends = [len(ids)] if sample.turn_ends is None else sample.turn_ends.tolist()
    lines, start = [], 0
    for number, end in enumerate(ends, start=1):
        model = np.flatnonzero(mask[start:end]) + start
        last = number == len(ends)
        reward = "-"
        if sample.token_rewards is not None and len(model):
            reward = f"{float(sample.token_rewards[model[-1]]):.3g}"
        elif last:
            reward = f"{sample.reward:.3g}"
        finish = sample.finish_reason if last else "turn"
        lines.append(f"turn {number} model {_decoded(tokenizer, ids[model])} "
                     f"reward {reward} finish {finish}")
        observed = np.flatnonzero(~mask[start:end]) + start
        if len(observed):
            lines.append(f"turn {number} env   {_decoded(tokenizer, ids[observed])}")
        start = end
    return lines


def _episode_notes(sample: Sample) -> str:
    notes = {k: sample.episode[k] for k in ("truncated", "failed") if k in sample.episode}
    if sample.error is not None:
        notes["error"] = sample.error
    return "".join(f" {k} {v}" for k, v in notes.items())


def _decoded(tokenizer, ids) -> str:
    return json.dumps(tokenizer.decode(list(map(int, ids)), skip_special_tokens=False),
                      ensure_ascii=False)
