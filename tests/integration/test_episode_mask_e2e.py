"""End to end on the embedded bus: producer with an environment whose observation tokens
outnumber the policy's (`tests.envs.Lecture`) and the trainer, for a few steps. The trainer
counts and trains the policy tokens only, and the observation's teacher-forced logprobs barely
move, while a run that ignores the mask (the knob, monkeypatched) counts every token and pushes
them up: the check fails if the trainer ever trains observation tokens.

The behaviour IS weight is pinned to 1 (`is_lower = is_upper = 1`): an observation's recorded
logprob is 0.0, so with the default correction a trained observation token would get a weight
near its probability (~0.01 here) and barely move; that would hide a lost mask rather than
show the mask working."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.feeder import feed
from miles.protocol import TrajectoryGroup, decode
from miles.protocol.records import Sample
from miles.protocol.topics import run_topics, topic_name
from miles.rl.algorithm import AlgorithmConfig
from miles.rl.losses import LossSettings
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import resolve_reward
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from miles.weights.following import FollowConfig
from miles.weights.signing import ensure_key_pair
from tests import envs

LORA = LoraSettings(r=4, alpha=8)
STEPS = 3
PER_STEP = 4
PROBES = 8  # published episodes whose observation logprobs are measured
NO_IS_CORRECTION = AlgorithmConfig(loss=LossSettings(is_lower=1.0, is_upper=1.0))


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


def observation_logprob(model, samples: list[tuple[np.ndarray, Sample]]) -> float:
    """Mean teacher-forced logprob of the observation tokens of `samples` (prompt, sample),
    each in its own episode's context."""
    values = []
    with torch.no_grad():
        for prompt, sample in samples:
            ids = torch.tensor([prompt.tolist() + sample.response_token_ids.tolist()])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # [T, V]
            logprobs = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            values.append(logprobs[torch.from_numpy(sample.loss_mask == 0)])
    return float(torch.cat(values).mean())


async def train_on_lectures(model_dir, out_dir: Path):
    """A few steps of producer + trainer on the Lecture environment; the published groups,
    metrics, ledger, and the observation logprob before and after training."""
    run = "lectures"
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        await feed(bus, run, arithmetic_problems("train")[:64])
        _, public_key = ensure_key_pair(out_dir / "keys")
        worker = RolloutWorker(bus, HFEngine(model_dir, lora=LORA), resolve_reward("exact_match"),
                               RolloutConfig(
            run=run, sampling=SamplingParams(n=4, temperature=1.0, max_new_tokens=3),
            prompts_per_batch=PER_STEP, groups_per_step=PER_STEP, max_staleness=STEPS,
            heartbeat_s=0.2, weights=FollowConfig(store=out_dir / "weights",
                                                  public_key=public_key)), env=envs.Lecture)
        learner = Learner(model_dir, LearnerConfig(lr=3e-2, algorithm=NO_IS_CORRECTION),
                          lora=LORA)
        loop = TrainerLoop(bus, StepRunner(learner, LoopConfig(
            run=run, out_dir=out_dir, groups_per_step=PER_STEP, max_staleness=STEPS,
            max_steps=STEPS, checkpoint_every=STEPS), base_model=str(model_dir)))
        stop = asyncio.Event()
        producing = asyncio.create_task(worker.run(stop))
        summary = await asyncio.wait_for(loop.run(asyncio.Event()), 300)
        stop.set()
        await asyncio.wait_for(producing, 60)
        async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit:
            groups = {g.group_id: g for g in (decode(r.value, TrajectoryGroup) for r in
                                              await audit.poll(max_records=10_000, timeout_s=1))}
    assert summary["steps"] == STEPS
    probes = [(g.prompt_token_ids, s) for g in groups.values() for s in g.samples
              if s.loss_mask is not None and (s.loss_mask == 0).any()][:PROBES]
    assert len(probes) == PROBES, "too few episodes held the observation"
    after = observation_logprob(learner.model, probes)
    with learner.model.disable_adapter():  # the base: where every version started
        before = observation_logprob(learner.model, probes)
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    ledger = [json.loads(line) for line in (out_dir / "ledger.jsonl").read_text().splitlines()]
    return groups, metrics, ledger, after - before


def step_tokens(groups, ledger, count) -> list[int]:
    return [sum(count(s) for gid in entry["trained"] for s in groups[gid].samples)
            for entry in ledger]


async def test_observation_tokens_are_neither_counted_nor_trained(model_dir, tmp_path,
                                                                  monkeypatch):
    groups, metrics, ledger, moved = await train_on_lectures(model_dir, tmp_path / "masked")
    observation = sum(int((s.loss_mask == 0).sum()) for g in groups.values() for s in g.samples
                      if s.loss_mask is not None)
    policy = sum(s.policy_tokens for g in groups.values() for s in g.samples)
    assert observation > 3 * policy  # the observations would dominate the gradient
    assert [m["trainer/tokens"] for m in metrics] == step_tokens(
        groups, ledger, lambda s: s.policy_tokens)

    monkeypatch.setattr(Sample, "policy_mask", property(   # the knob: the mask ignored
        lambda s: np.ones(len(s.response_token_ids), dtype=bool)))
    groups, metrics, ledger, moved_unmasked = await train_on_lectures(model_dir,
                                                                      tmp_path / "unmasked")
    assert [m["trainer/tokens"] for m in metrics] == step_tokens(
        groups, ledger, lambda s: len(s.response_token_ids))
    print(f"observation logprob moved {moved:+.4f} masked, {moved_unmasked:+.4f} unmasked")
    assert moved_unmasked > 0.15 and moved_unmasked > 5 * abs(moved), (moved, moved_unmasked)
