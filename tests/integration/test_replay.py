"""`miles replay` on a recorded trajectories topic: deterministic, filtered, any algorithm."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.config import load_config
from miles.errors import ConfigError
from miles.protocol import encode
from miles.protocol.topics import topic_name
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from miles.trainer.replay import Replay, ReplayConfig
from tests.factories import make_group, make_sample

VOCAB = 78  # the tiny character tokenizer
LORA = LoraSettings(r=4, alpha=8)
GROUPS = 10


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


async def record(bus, run: str) -> None:
    """What a live run leaves behind: groups from versions 0..5 over 3 partitions (the last
    quarter of each response one version later), one of them far behind, and a corrupt record."""
    topic = topic_name(run, "trajectories")
    for i in range(GROUPS):
        version = 0 if i == 7 else i // 2  # group 7: lag 4 against the newest so far (4)
        group = make_group(4, 5, vocab_size=VOCAB, seed=i, policy_version=version,
                           group_id=f"g{i}")
        await bus.publish(topic, encode(group), partition=i % 3)
        await asyncio.sleep(0.003)  # distinct timestamps: the replay order is publish order
    await bus.publish(topic, b"\x93not a record", partition=0)


def weights(learner) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in learner.model.named_parameters() if p.requires_grad}


async def replay(bus, run, model_dir, out_dir, algo: str = "grpo", **config):
    algorithm = load_config(AlgorithmConfig, base=preset(algo))
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, seed=3, algorithm=algorithm), lora=LORA)
    summary = await Replay(bus, learner, ReplayConfig(
        run=run, out_dir=out_dir, groups_per_step=4, **config)).run()
    return summary, weights(learner)


async def test_two_replays_of_a_range_give_bitwise_identical_weights(bus, run, model_dir,
                                                                      tmp_path):
    await record(bus, run)
    first, a = await replay(bus, run, model_dir, tmp_path / "a")
    distributed.destroy()
    second, b = await replay(bus, run, model_dir, tmp_path / "b")
    assert first["replay/records"] == second["replay/records"] == GROUPS + 1
    assert first["replay/invalid"] == 1
    assert first["replay/dropped_stale"] == 1  # group 7
    assert first["replay/groups_trained"] == GROUPS - 1 and first["steps"] == 3  # 4 + 4 + 1
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    metrics = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert (tmp_path / "a" / "weights" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["steps"] == 3


async def test_a_range_staleness_off_and_another_algorithm(bus, run, model_dir, tmp_path):
    await record(bus, run)
    summary, _ = await replay(bus, run, model_dir, tmp_path / "ppo", algo="ppo",
                              start="1", end="3", staleness="off")
    assert summary["replay/records"] == 6  # offsets 1 and 2 of each partition
    assert summary["replay/groups_trained"] == 6 and "replay/dropped_stale" not in summary
    metrics = json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "trainer/value_loss" in metrics


async def test_an_earlier_replay_is_never_overwritten(bus, run, model_dir, tmp_path):
    await record(bus, run)
    await replay(bus, run, model_dir, tmp_path, max_steps=1)
    distributed.destroy()
    with pytest.raises(ConfigError, match="holds an earlier replay"):
        await replay(bus, run, model_dir, tmp_path)


async def test_groups_the_learner_cannot_train_are_skipped(bus, run, model_dir, tmp_path):
    """Valid on the wire, fatal (temperature 0) or NaN (reward 1e308) in a step."""
    await record(bus, run)
    topic = topic_name(run, "trajectories")
    await bus.publish(topic, encode(make_group(4, 5, vocab_size=VOCAB, seed=20, group_id="cold",
                                               sampling={"temperature": 0.0})), partition=1)
    huge = make_group(vocab_size=VOCAB, group_id="huge", samples=[
        make_sample(5, vocab_size=VOCAB, seed=21 + i, reward=r)
        for i, r in enumerate((1e308, 0.0))])
    await bus.publish(topic, encode(huge), partition=2)
    summary, _ = await replay(bus, run, model_dir, tmp_path / "out", staleness="off")
    assert summary["replay/rejected_groups"] == 2
    assert summary["replay/rejected/sampling"] == summary["replay/rejected/rewards"] == 1
    assert summary["replay/groups_trained"] == GROUPS
