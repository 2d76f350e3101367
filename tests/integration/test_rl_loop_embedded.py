"""Producer and trainer against each other on the embedded bus with a tiny model.

Versions advance, the producer loads them, the staleness bound holds (and 0 means every group
is on-policy), and the ledger accounts for every group.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.feeder import feed
from miles.protocol import TrajectoryGroup, WeightVersion, decode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.algorithm import AlgorithmConfig
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import Scorer
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.loop import LoopConfig, TrainerLoop
from miles.trainer.runner import StepRunner
from miles.weights.following import FollowConfig
from miles.weights.signing import Verifier, ensure_key_pair
from tests.rewards import digit_for_odd_answers, starts_with_digit

LORA = LoraSettings(r=4, alpha=8)
STEPS = 4
PER_STEP = 4


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


def full(param) -> torch.Tensor:
    param = param.detach()
    return param.full_tensor() if isinstance(param, DTensor) else param


async def run_loop(model_dir, out_dir, *, max_staleness: int, lora: LoraSettings | None = LORA,
                   algorithm: AlgorithmConfig = AlgorithmConfig(), reward=starts_with_digit):
    run = f"loop{max_staleness}"
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=2, trajectory_partitions=2))
        await feed(bus, run, arithmetic_problems("train")[:200])
        engine = HFEngine(model_dir, lora=lora)
        _, public_key = ensure_key_pair(Path(out_dir) / "keys")  # the trainer's default pair
        worker = RolloutWorker(bus, engine, Scorer(reward), RolloutConfig(
            run=run, sampling=SamplingParams(n=4, max_new_tokens=4), prompts_per_batch=PER_STEP,
            groups_per_step=PER_STEP, max_staleness=max_staleness, heartbeat_s=0.2,
            weights=FollowConfig(store=Path(out_dir) / "weights", public_key=public_key)))
        learner = Learner(model_dir, LearnerConfig(lr=1e-2 if lora else 1e-4,
                                                   algorithm=algorithm), lora=lora)
        before = {n: full(p).clone() for n, p in learner.model.named_parameters()}
        loop = TrainerLoop(bus, StepRunner(learner, LoopConfig(
            run=run, out_dir=out_dir, groups_per_step=PER_STEP, max_staleness=max_staleness,
            max_steps=STEPS, checkpoint_every=2), base_model=str(model_dir)))
        stop = asyncio.Event()
        producing = asyncio.create_task(worker.run(stop))
        summary = await asyncio.wait_for(loop.run(asyncio.Event()), 300)
        stop.set()
        await asyncio.wait_for(producing, 60)
        async with bus.consumer([topic_name(run, "control")], group_id="audit") as audit:
            versions = [decode(r.value, WeightVersion) for r in await audit.poll(timeout_s=1)]
        async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit:
            groups = [decode(r.value, TrajectoryGroup)
                      for r in await audit.poll(max_records=10_000, timeout_s=1)]
    changed = [n for n, p in learner.model.named_parameters()
               if not torch.equal(full(p), before[n])]
    return summary, worker, engine, versions, changed, {g.group_id: g for g in groups}


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_versions_advance_and_staleness_holds(model_dir, tmp_path, max_staleness):
    summary, worker, engine, versions, changed, published = await run_loop(
        model_dir, tmp_path, max_staleness=max_staleness)
    assert summary["steps"] == STEPS and summary["policy_version"] == STEPS
    assert changed and all("lora" in name for name in changed)
    assert [v.policy_version for v in versions] == list(range(STEPS + 1))
    verifier = Verifier(tmp_path / "keys" / "control.pub", who="test")
    assert all(verifier.refusal(v) is None for v in versions)  # signed by the trainer
    assert engine.policy_version >= STEPS - 1, "the producer hot-loaded new versions"
    assert worker.counts["producer/unverified"] == 0 and worker.trainer.consumed > 0
    assert worker.counts["producer/weight_loads"] >= STEPS - 1
    lags = summary["lag_histogram"]
    assert max(lags) <= max_staleness
    if max_staleness == 0:
        assert set(lags) == {0}
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [g for entry in ledger for g in entry["trained"]]
    assert len(trained) == len(set(trained)) == STEPS * PER_STEP
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for key in ("trainer/loss", "trainer/reward_mean", "trainer/kl_behaviour",
                "trainer/is_weight_mean", "trainer/clip_frac", "trainer/step_s",
                "trainer/tokens_per_s"):
        assert all(isinstance(m[key], float) for m in metrics), key
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000004"


async def test_full_fine_tuning_publishes_full_weights_the_producer_loads(model_dir, tmp_path):
    summary, worker, engine, versions, changed, published = await run_loop(
        model_dir, tmp_path, max_staleness=1, lora=None)
    assert summary["policy_version"] == STEPS
    assert {v.format for v in versions} == {"full"}
    assert all(v.uri.endswith("/model.safetensors") for v in versions)
    assert any(name.endswith("embed_tokens.weight") for name in changed)
    assert engine.policy_version >= STEPS - 1 and worker.counts["producer/weight_errors"] == 0


async def test_dynamic_sampling_trains_only_groups_with_a_reward_spread(model_dir, tmp_path):
    summary, worker, engine, versions, changed, published = await run_loop(
        model_dir, tmp_path, max_staleness=1, reward=digit_for_odd_answers,
        algorithm=AlgorithmConfig(dynamic_sampling=True))
    assert summary["policy_version"] == STEPS
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [g for entry in ledger for g in entry["trained"]]
    filtered = [g for entry in ledger for g in entry["filtered"]]
    assert len(trained) == STEPS * PER_STEP, "the shortfall was refilled from the stream"
    assert filtered and not set(filtered) & set(trained)
    spread = {gid: len({s.reward for s in g.samples}) > 1 for gid, g in published.items()}
    assert all(spread[g] for g in trained) and not any(spread[g] for g in filtered)
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["trainer/filtered_groups"] == len(filtered)


async def test_the_trainer_commits_its_offsets_at_every_checkpoint(model_dir, tmp_path,
                                                                   monkeypatch):
    """Committed offsets follow the run (checkpoints at steps 2 and 4, then shutdown), so the
    trainer group's lag in `miles status` is live, not frozen until the trainer stops."""
    commits = []
    commit = TrainerLoop._commit

    async def spy(self):
        commits.append(sum(o for tp, o in self.positions.items()
                           if tp in self.consumer.assignment()))
        await commit(self)

    monkeypatch.setattr(TrainerLoop, "_commit", spy)
    await run_loop(model_dir, tmp_path, max_staleness=1)
    assert len(commits) == 3 and 0 < commits[0] <= commits[1] == commits[2]
    assert commits[0] >= 2 * PER_STEP  # two steps' groups were behind the first checkpoint
