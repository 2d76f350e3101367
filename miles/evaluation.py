"""Held-out evaluation: greedy accuracy of an engine's current weights on a list of problems.

Greedy decoding is `top_k=1` sampling (the argmax token), through the same engine the producers
use, so evaluation sees exactly the weights and the tokenisation that generated the training data.
"""

from __future__ import annotations

from miles.engines.base import RolloutEngine
from miles.rl.sampling import SamplingParams
from miles.tasks.arithmetic import Problem
from miles.tasks.rewards import RewardFn, exact_match

EVAL_BATCH = 256


def greedy_accuracy(engine: RolloutEngine, problems: list[Problem], *,
                    reward: RewardFn = exact_match, max_new_tokens: int = 8) -> float:
    """Fraction of `problems` whose greedy answer earns a positive reward."""
    params = SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=max_new_tokens)
    correct = 0
    for start in range(0, len(problems), EVAL_BATCH):
        chunk = problems[start:start + EVAL_BATCH]
        outputs = engine.generate([engine.encode(p.prompt) for p in chunk], params, seed=0)
        for problem, (completion,) in zip(chunk, outputs):
            ids = completion.token_ids
            text = engine.decode(ids[:-1] if completion.finish_reason == "stop" else ids)
            correct += reward(text, problem.answer) > 0
    return correct / max(len(problems), 1)
