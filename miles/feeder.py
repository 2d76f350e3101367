"""`miles feed`: publish a dataset's prompts to a run's prompts topic as `PromptTask`s.

Each epoch is shuffled with `seed + epoch`, so a feed is reproducible; the task id is the record
key, so one task always lands on the same partition.
"""

from __future__ import annotations

import random
import time

from miles.bus import Bus
from miles.protocol import PromptTask, encode
from miles.protocol.topics import topic_name
from miles.tasks.arithmetic import Problem
from miles.tasks.messages import MESSAGES_KEY, messages_json


def epoch_order(problems: list[Problem], epoch: int, *, shuffle: bool, seed: int) -> list[Problem]:
    order = list(problems)
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def prompt_task(problem: Problem, *, epoch: int = 0, created_at: float = 0.0) -> PromptTask:
    """`problem` as the wire's prompt task; a conversation rides in `metadata["messages"]`."""
    metadata = {} if problem.messages is None else {MESSAGES_KEY: messages_json(problem.messages)}
    return PromptTask(task_id=problem.task_id, prompt=problem.prompt, reference=problem.answer,
                      epoch=epoch, metadata=metadata, created_at=created_at)


async def feed(bus: Bus, run: str, problems: list[Problem], *, epochs: int = 1,
               shuffle: bool = True, seed: int = 0, limit: int | None = None,
               skip: int = 0) -> int:
    """Publish the first `limit` tasks (default: all) of `epochs` passes over `problems`, less
    the first `skip` of them (published by a feed that was cut short); returns how many were
    published now."""
    topic = topic_name(run, "prompts")
    pending = []
    order = [(epoch, problem) for epoch in range(epochs)
             for problem in epoch_order(problems, epoch, shuffle=shuffle, seed=seed)]
    for epoch, problem in order[skip:limit]:
        task = prompt_task(problem, epoch=epoch, created_at=time.time())
        pending.append(await bus.send(topic, encode(task), key=problem.task_id.encode()))
    for delivery in pending:
        await delivery
    return len(pending)
