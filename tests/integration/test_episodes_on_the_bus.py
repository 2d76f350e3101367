"""Episodes (1.4) over both buses into the trainer loop: trained on their policy tokens, lag
from their policy tokens, and an episode breaking a wire rule dead-lettered with its field.

Two valid groups of two episodes each (versions 0 on policy tokens, -1 on observation tokens:
with the -1s counted every group's lag would be 1, stale under max_staleness 0) and one whose
first loss_mask holds a 2, published before them.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np

from miles.engines.base import LoraSettings
from miles.protocol import DeadLetter, Sample, decode, encode
from miles.protocol.topics import topic_name
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from tests.accounting import TINY_VOCAB_SIZE, ledger
from tests.conftest import unique_run
from tests.factories import array_map, make_episode, make_group, pack_map, wire_map
from tests.integration.test_intake_positions import _process_group  # noqa: F401

TURNS = [[(2, 6), (1, 5), (1, 0)], [(3, 8), (2, 0)]]  # 4 + 5 policy tokens, 19 observation


def episode_group(i: int):
    samples = []
    for k, turns in enumerate(TURNS):
        e = make_episode(turns, vocab_size=TINY_VOCAB_SIZE, seed=10 * i + k, reward=float(k))
        samples.append(Sample(**{**vars(e), "versions": np.where(e.loss_mask == 1, 0, -1)
                                 .astype(np.int32)}))
    return make_group(prompt_tokens=4, vocab_size=TINY_VOCAB_SIZE, samples=samples,
                      group_id=f"episodes-{i}", sampling={"max_new_tokens": 64})


def bad_mask() -> bytes:
    raw = wire_map(episode_group(9))
    mask = np.frombuffer(raw["samples"][0]["loss_mask"]["data"], np.uint8).copy()
    mask[1] = 2
    raw["samples"][0]["loss_mask"] = array_map(mask, "|u1")
    return pack_map(raw)


async def test_episodes_are_trained_over_the_bus(bus, run, model_dir, tmp_path):
    learner = Learner(model_dir, LearnerConfig(lr=1e-2), lora=LoraSettings(r=4, alpha=8))
    config = LoopConfig(run=run, out_dir=tmp_path, groups_per_step=2, max_staleness=0,
                        max_steps=1)
    trajectories = topic_name(run, "trajectories")
    await bus.publish(trajectories, bad_mask(), partition=0)
    for i in range(2):
        await bus.publish(trajectories, encode(episode_group(i)), partition=0)
    loop = TrainerLoop(bus, StepRunner(learner, config, base_model=str(model_dir)))
    summary = await asyncio.wait_for(loop.run(asyncio.Event()), 300)
    assert [e["trained"] for e in ledger(tmp_path)] == [["episodes-0", "episodes-1"]]
    assert summary["lag_histogram"] == {0: 2}
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["trainer/tokens"] == 2 * (4 + 5)  # policy tokens only
    async with bus.consumer([topic_name(run, "dlq")], group_id=unique_run()) as audit:
        letters = [decode(r.value, DeadLetter) for r in await audit.poll(timeout_s=5)]
    assert [letter.reason for letter in letters] == [
        "samples[0].loss_mask: value 2 at index 1 is not 0 or 1"]
