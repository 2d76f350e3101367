"""`miles replay`: train a fresh trainer on a recorded trajectories topic.

The replay reads `miles.<run>.trajectories` over [start, end) with `miles.bus.ranges` (a fixed
merge order, a consumer group of its own, nothing committed) and publishes nothing, so the live
run never notices it. Each record is decoded with full validation; invalid ones are counted and
skipped (the live trainer dead-lettered them already), and so are groups this learner cannot
train (`miles.trainer.intake`, every rule but the versions one: the replay's versions count its
own steps). Groups then pass the staleness rule and,
under DAPO's dynamic sampling, the equal-rewards filter, and every `groups_per_step` of them make
one `train_step` under whichever algorithm the settings choose. Advantages come from the
recorded rewards and importance weights from the recorded behaviour logprobs, as live.

Staleness: `off` trains every group. `recorded` measures a group's lag against the newest policy
version recorded so far in the range (the live trainer had reached at least that version when
the group arrived) and drops groups over `max_staleness`, as the live trainer would have.

Determinism: the same range, settings and seed give the same groups in the same steps, and on
CPU (fixed thread count) bitwise-identical weights.

Writes to `out_dir`: `metrics.jsonl` (every step), `weights/` (the final policy, exported like
the live trainer's versions) and `summary.json`.

Simplifications: one process (no torchrun); no checkpoints, so an interrupted replay starts
again from its start; the replay's policy versions count its own steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from miles.bus import Bus
from miles.bus.ranges import parse_bound, reader_group
from miles.bus.security import KafkaSecurity
from miles.engines.base import LoraSettings
from miles.errors import ConfigError
from miles.experience.rows import read_groups
from miles.protocol import TrajectoryGroup
from miles.protocol.limits import MAX_POLICY_VERSION
from miles.protocol.topics import topic_name
from miles.trainer.intake import IntakeConfig, TrainerLimits, check_group
from miles.trainer.learner import LearnerConfig
from miles.trainer.loop import uniform_rewards
from miles.trainer.progress import Progress

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    run: str = "demo"  # the recorded run: reads miles.<run>.trajectories
    start: str = "earliest"  # earliest, latest, an offset, @<epoch ms> or ISO 8601 (UTC)
    end: str = "latest"  # exclusive, same forms; resolved when the replay starts
    out_dir: Path = Path("runs/replay")  # metrics.jsonl, weights/, summary.json
    groups_per_step: int = 32  # trajectory groups per optimizer step
    staleness: Literal["recorded", "off"] = "recorded"  # lag vs recorded versions, or no filter
    max_staleness: int = 1  # staleness="recorded": groups with a larger lag are dropped
    max_steps: int = 0  # stop after this many steps (0: at the end of the range)
    intake: IntakeConfig = field(default_factory=IntakeConfig)  # what groups are trained

    def __post_init__(self) -> None:
        parse_bound(self.start), parse_bound(self.end)  # ConfigError on a bad bound
        if self.groups_per_step < 1:
            raise ConfigError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.staleness not in ("recorded", "off"):
            raise ConfigError(f"staleness must be 'recorded' or 'off', got {self.staleness!r}")
        for name in ("max_staleness", "max_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class ReplaySettings:
    bus: str = "kafka://127.0.0.1:9092"  # where the recorded topic lives (or embedded://)
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS/SASL (MILES_KAFKA__*)
    model_dir: Path = Path("model")  # the model to start from (from_pretrained)
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full fine-tuning
    torch_threads: int = 0  # 0 leaves torch's default
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)


class Replay:
    """One replay: the range reader feeding a learner."""

    def __init__(self, bus: Bus, learner, config: ReplayConfig):
        self.bus, self.learner, self.config = bus, learner, config
        self.out_dir = Path(config.out_dir)
        self.counts: Counter[str] = Counter()
        self.newest_recorded = 0
        self.step = 0
        self.progress = Progress()
        self.limits = TrainerLimits.of(learner, config.intake)

    async def run(self) -> dict:
        if (self.out_dir / "metrics.jsonl").exists():
            raise ConfigError(f"{self.out_dir} holds an earlier replay; choose a new out_dir")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        batch: list[TrajectoryGroup] = []
        try:
            async with aclosing(self._groups()) as groups:
                async for group in groups:
                    batch.append(group)
                    if len(batch) == self.config.groups_per_step:
                        await self._train(batch)
                        batch = []
                        if self.config.max_steps and self.step >= self.config.max_steps:
                            break
                else:
                    if batch:  # the range's tail: a smaller last step, nothing left out
                        await self._train(batch)
        finally:
            self.progress.close()
        return await self._finish(time.monotonic() - began)

    async def _groups(self):
        """Decoded groups of the range that pass the staleness and dynamic-sampling filters."""
        invalid: Counter[str] = Counter()
        records = read_groups(self.bus, topic_name(self.config.run, "trajectories"),
                              parse_bound(self.config.start), parse_bound(self.config.end),
                              group_id=reader_group(self.config.run, "replay"), invalid=invalid,
                              counts=self.counts)
        waited = time.monotonic()
        async with aclosing(records):
            async for _, group in records:
                self.counts["replay/read_s"] += time.monotonic() - waited
                self.counts["replay/records"] += 1
                if group is None:
                    self.counts["replay/invalid"] = invalid.total()
                elif self._admit(group):
                    yield group
                waited = time.monotonic()

    def _admit(self, group: TrajectoryGroup) -> bool:
        rejection = check_group(group, self.limits, policy_version=MAX_POLICY_VERSION)
        if rejection is not None:
            log.warning("group %s not trained: %s", group.group_id, rejection)
            self.counts["replay/rejected_groups"] += 1
            self.counts[f"replay/rejected/{rejection.rule}"] += 1
            return False
        versions = max(int(s.versions.max()) for s in group.samples)
        self.newest_recorded = max(self.newest_recorded, versions)
        if (self.config.staleness == "recorded"
                and group.lag(self.newest_recorded) > self.config.max_staleness):
            self.counts["replay/dropped_stale"] += 1
            return False
        if self.learner.algorithm.dynamic_sampling and uniform_rewards(group):
            self.counts["replay/filtered_groups"] += 1
            return False
        return True

    async def _train(self, groups: list[TrajectoryGroup]) -> None:
        began = time.perf_counter()
        metrics = await asyncio.to_thread(self.learner.train_step, groups)
        self.step += 1
        self.counts["replay/groups_trained"] += len(groups)
        step_s = time.perf_counter() - began
        line = {"step": self.step, "time": time.time(), **metrics, "trainer/step_s": step_s,
                "trainer/tokens_per_s": metrics.get("trainer/tokens", 0.0) / max(step_s, 1e-9),
                **self.counts}
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        self.progress.update(line)

    async def _finish(self, seconds: float) -> dict:
        weights = self.out_dir / "weights"
        await asyncio.to_thread(self.learner.export_weights, weights)
        read_s = self.counts["replay/read_s"]
        summary = {"steps": self.step, "policy_version": self.learner.policy_version,
                   "seconds": round(seconds, 2), **self.counts,
                   "records_per_read_s": round(self.counts["replay/records"] / max(read_s, 1e-9),
                                               1),
                   "weights": str(weights), "weights_format": self.learner.weights_format}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("replay of %s done: %d steps on %d groups in %.1f s", self.config.run,
                 self.step, self.counts["replay/groups_trained"], seconds)
        return summary


async def run_replay(settings: ReplaySettings) -> dict:
    """Build the learner from `settings` and replay; returns the summary."""
    import torch

    from miles.bus import open_bus
    from miles.trainer.learner import Learner

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("miles replay runs in one process; start it without torchrun")
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    learner = Learner(settings.model_dir, settings.learner, lora=settings.lora)
    async with open_bus(settings.bus, settings.kafka) as bus:
        return await Replay(bus, learner, settings.replay).run()
