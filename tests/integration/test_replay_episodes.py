"""`miles replay` of recorded multi-turn episodes (wire 1.4) under GRPO and PPO (and, once
each, under every other preset).

The recorded topic holds groups of three episodes each (policy tokens, then observation tokens
with version -1 and mask 0, step rewards on each turn's last policy token), written by the
episode sample builder (`miles.episodes.EpisodeRecord.sample`) as the producer writes them:
groups of versions 0..3 (two per version), then one group of version 0 that is stale by then.
Under `staleness=recorded` every group but that one is trained (the observation tokens' -1 is
not a version: counted, an episode would look stale or older than any policy), the weights
change, the policy version counts the steps, and the same range and seed give bitwise-identical
weights twice.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.engines.base import Completion
from miles.episodes.samples import EpisodeRecord, Turn
from miles.config import load_config
from miles.protocol import encode
from miles.protocol.topics import run_topics, topic_name
from miles.bus import open_bus
from miles.rl.algorithm import PRESETS, AlgorithmConfig, preset
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.replay import Replay, ReplayConfig
from tests.factories import make_group
from tests.integration.test_replay import LORA, VOCAB, weights

# (policy tokens, observation tokens, step reward) per turn, per episode of a group
EPISODES = [[(3, 4, 0.25), (2, 3, 0.0), (2, 0, 1.0)],
            [(4, 5, 0.0), (3, 0, 0.0)],
            [(2, 6, 0.25), (2, 0, 0.5)]]
VERSIONS = [0, 0, 1, 1, 2, 2, 3, 3, 0]  # the last group: lag 3 against version 3
STALE = len(VERSIONS) - 1


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


def episode(turns, version: int, rng: np.random.Generator) -> EpisodeRecord:
    """An episode whose every turn version `version` sampled (ids from 4: no special token)."""
    record = EpisodeRecord(task_index=0, prompt=[5, 6, 7])
    for policy, observation, reward in turns:
        ids = rng.integers(4, VOCAB, policy, dtype=np.int32)
        logprobs = (-rng.uniform(0.5, 4.0, policy)).astype(np.float32)
        completion = Completion(token_ids=ids, logprobs=logprobs, finish_reason="stop",
                                policy_version=version)
        record.turns.append(Turn(completion, reward,
                                 rng.integers(4, VOCAB, observation).tolist()))
    return record


async def record_episodes(bus, run: str) -> list[str]:
    """Publish the episode groups over two partitions; their group ids in order."""
    topic, ids = topic_name(run, "trajectories"), []
    for i, version in enumerate(VERSIONS):
        rng = np.random.default_rng(i)
        samples = [episode(turns, version, rng).sample() for turns in EPISODES]
        group = make_group(vocab_size=VOCAB, group_id=f"e{i}", samples=samples,
                           prompt_token_ids=np.array([5, 6, 7], np.int32),
                           sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                     "max_new_tokens": 64})
        await bus.publish(topic, encode(group), partition=i % 2)
        await asyncio.sleep(0.003)  # distinct timestamps: the replay order is publish order
        ids.append(group.group_id)
    return ids


async def test_recorded_episodes_are_the_samples_replayed():
    """The builder writes 1.4 episodes: masks, -1 on observations, turn ends, step rewards."""
    sample = episode(EPISODES[0], 2, np.random.default_rng(0)).sample()
    assert sample.loss_mask.tolist() == [1] * 3 + [0] * 4 + [1] * 2 + [0] * 3 + [1] * 2
    assert set(sample.versions[sample.loss_mask == 0].tolist()) == {-1}
    assert sample.policy_versions.tolist() == [2] * 7
    assert sample.turn_ends.tolist() == [7, 12, 14]
    assert sample.reward == 1.25 and sample.token_rewards[[2, 8, 13]].tolist() == [0.25, 0, 1]


async def replay_episodes(bus, run, model_dir, out_dir, algo: str):
    """A replay under `algo` that keeps a ledger of the group ids each step trained; its
    summary, ledger, and the trainable weights before and after."""
    algorithm = load_config(AlgorithmConfig, base=preset(algo))
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, seed=3, algorithm=algorithm), lora=LORA)
    before, ledger, train_step = weights(learner), [], learner.train_step

    def recorded_step(groups):
        ledger.append([g.group_id for g in groups])
        return train_step(groups)

    learner.train_step = recorded_step
    summary = await Replay(bus, learner, ReplayConfig(
        run=run, out_dir=out_dir, groups_per_step=4, staleness="recorded",
        max_staleness=1)).run()
    assert summary["policy_version"] == learner.policy_version
    return summary, ledger, before, weights(learner)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
async def test_replayed_episodes_train_every_fresh_group_deterministically(
        bus, run, model_dir, tmp_path, algo):
    recorded = await record_episodes(bus, run)
    summary, ledger, before, a = await replay_episodes(bus, run, model_dir, tmp_path / "a",
                                                       algo)
    fresh = [g for i, g in enumerate(recorded) if i != STALE]
    assert [g for step in ledger for g in step] == fresh  # in publish order, 4 + 4
    assert summary["replay/groups_trained"] == len(fresh) and summary["steps"] == 2
    assert summary["replay/dropped_stale"] == 1  # only the group that really is stale
    assert "replay/rejected_groups" not in summary and "replay/invalid" not in summary
    assert summary["policy_version"] == 2
    assert any(not torch.equal(before[name], a[name]) for name in a)
    distributed.destroy()
    again, ledger_again, _, b = await replay_episodes(bus, run, model_dir, tmp_path / "b", algo)
    assert ledger_again == ledger and again["steps"] == summary["steps"]
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("algo", [name for name in PRESETS if name not in ("grpo", "ppo")])
async def test_replayed_episodes_train_under_every_other_preset(model_dir, tmp_path, algo):
    """The same recorded episodes under each remaining preset (embedded bus): every fresh group
    trained in two steps, the stale one dropped, the weights moved."""
    async with open_bus("embedded://") as bus:
        run = "replay-presets"
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=2))
        recorded = await record_episodes(bus, run)
        summary, ledger, before, after = await replay_episodes(bus, run, model_dir,
                                                               tmp_path, algo)
    assert [g for step in ledger for g in step] == [g for i, g in enumerate(recorded)
                                                    if i != STALE]
    assert summary["steps"] == 2 and summary["replay/dropped_stale"] == 1
    assert any(not torch.equal(before[name], after[name]) for name in after)
    distributed.destroy()
