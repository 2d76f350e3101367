"""How the producer turns a batch of prompts into `TrajectoryGroup`s: single-turn or episodes.

- `SingleTurnGroups` (no `env` set, the behaviour before environments): one engine call for the
  batch (`n` completions per prompt), one `Scorer` call per group, one sample per completion.
  The engine's context (`RolloutEngine.context_limit`) bounds prompt plus response: a prompt
  near it samples only the room left (`max_new_tokens` cut, and recorded so in the group's
  `sampling`; such rows get an engine call per room, as a vLLM server refuses prompt plus
  max_tokens past max_model_len), and a prompt that fills it is rejected before generating.
  So is a prompt the engine refuses (`EngineRejectedError`: the refused call's rows are
  generated one by one to find it): the same request would fail again, so the batch goes on
  without it and the worker dead-letters it (`rejected`).
- `EpisodeGroups` (`env` set): `miles.episodes.EpisodeRunner` plays `n` episodes per prompt;
  each prompt's finished episodes are its group. A failed episode (its environment raised or
  timed out, its chat template broke the token prefix, its task was malformed) is counted by
  kind and left out of the group: the trainer has no way yet to skip a sample (it would train
  an "abort" sample like any other), so a failed episode never reaches it. It is recorded
  instead: each batch's failed episodes (`failed`) are dead-lettered by the worker (the DLQ,
  keyed by the prompt's record and `episode-<i>`), with the reason
  `episode failed: <kind>: <message>` and, as payload, a `TrajectoryGroup` holding the
  episode's sample (finish reason "abort", its failure as `error`, `episode["failed"]` its
  kind; no payload when no turn was played). A prompt whose episodes all failed publishes no
  group (`producer/empty_groups`). The group's prompt is its
  episodes' first prompt; an episode whose environment opened with another prompt (a `reset`
  that varies) fails as `prompt_mismatch`. The group's `sampling.max_new_tokens` is the limit
  on a sample's length T, as wire-format.md asks of episodes: `episodes.max_total_tokens`
  (`turn_tokens` records the per-turn limit).

Counters (`producer/...`): `episodes`, `turns`, `tool_calls`, `tool_errors`, `env_s`,
`work_s` (the producer's own time on episodes: decoding, rendering, building samples),
`failed_episodes`, `failed/<kind>`, `truncated_episodes`, `empty_groups`, `unk_observations`
(observations holding the tokenizer's unknown token: the model cannot read them; warned once),
and the gauge `env_threads_stuck` (environment threads still running past a timeout,
`miles.episodes.hosting`). An environment whose stop strings the tokenizer cannot write stops
the producer at start-up (`miles.episodes.check_stop_strings`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from miles.engines.base import Completion, RolloutEngine
from miles.envs import EnvironmentFactory
from miles.episodes import (EpisodeRecord, EpisodeRunner, EpisodeSettings, check_stop_strings,
                            context_warning, is_single_turn)
from miles.episodes.hosting import abandoned_threads
from miles.errors import CodecError, EngineRejectedError
from miles.protocol import PromptTask, Sample, TrajectoryGroup, encode
from miles.protocol.records import failed_episode_reason
from miles.rl.sampling import SamplingParams
from miles.tasks.rewards import Scored, Scorer

log = logging.getLogger(__name__)
Batch = list[tuple[PromptTask, list[int]]]
EPISODE_COUNTERS = ("episodes", "turns", "tool_calls", "tool_errors", "env_s", "work_s",
                    "failed_episodes", "truncated_episodes", "empty_groups", "unk_observations",
                    "env_threads_stuck")


@dataclass(frozen=True, slots=True)
class FailedEpisode:
    """A failed episode of the last batch, as it is dead-lettered."""

    index: int  # its prompt's position in the batch
    part: str  # `episode-<i>`: which of the prompt's episodes (the letter's key)
    reason: str  # "episode failed: <kind>: <message>"
    kind: str
    payload: bytes | None  # its encoded group (None: no turn was played, or it does not encode)


@dataclass(frozen=True, slots=True)
class RejectedPrompt:
    """A prompt of the last batch the engine cannot take for what it asks."""

    index: int  # its position in the batch
    why: str  # e.g. "the prompt's 40 tokens fill engine hf's context of 32"


class GroupBuilder:
    """What both paths share: the run's identity and the group record around samples."""

    def __init__(self, engine: RolloutEngine, sampling: SamplingParams, producer_id: str,
                 counts: dict[str, float]):
        self.engine, self.sampling, self.producer_id = engine, sampling, producer_id
        self.counts = counts
        self.generate_s = 0.0  # engine time of the last batch
        self.failed: list[FailedEpisode] = []  # the last batch's failed episodes
        self.rejected: list[RejectedPrompt] = []  # the last batch's refused prompts

    def group(self, task: PromptTask, prompt: list[int], samples: list[Sample], sequence: int,
              sampling: dict, timings: dict[str, float], suffix: str = "") -> TrajectoryGroup:
        return TrajectoryGroup(
            group_id=f"{task.task_id}/e{task.epoch}/{self.producer_id}/{sequence}{suffix}",
            task_id=task.task_id, epoch=task.epoch,
            prompt_token_ids=np.asarray(prompt, dtype=np.int32), samples=samples,
            producer_id=self.producer_id, engine=self.engine.name,
            vocab_size=self.engine.vocab_size, sampling=sampling, reference=task.reference,
            timings=timings, created_at=time.time())


class SingleTurnGroups(GroupBuilder):
    """n completions per prompt, scored per group (see the module docstring)."""

    def __init__(self, engine, sampling, producer_id, counts, *, scorer: Scorer,
                 in_engine: Callable):
        super().__init__(engine, sampling, producer_id, counts)
        self.scorer, self.in_engine = scorer, in_engine

    async def groups(self, batch: Batch, seed: int, sequence: int) -> list[TrajectoryGroup]:
        """The scored groups of `batch`'s prompts, less those the engine refused (`rejected`).
        One engine call per distinct room left (one, unless a prompt is near the context)."""
        self.rejected = []
        began = time.perf_counter()
        calls: dict[int, tuple[SamplingParams, list[int]]] = {}
        for i, (_, prompt) in enumerate(batch):
            try:
                params = self.params_for(prompt)
            except EngineRejectedError as err:
                self.rejected.append(RejectedPrompt(i, str(err)))
                continue
            calls.setdefault(params.max_new_tokens, (params, []))[1].append(i)
        completions: dict[int, list[Completion]] = {}
        for params, rows in calls.values():
            await self._generate(batch, rows, params, seed, completions)
        self.generate_s = time.perf_counter() - began
        return [await self.scored_group(task, prompt, completions[i], sequence)
                for i, (task, prompt) in enumerate(batch) if i in completions]

    def params_for(self, prompt: list[int]) -> SamplingParams:
        """The sampling of `prompt`: `max_new_tokens` cut to the room the engine's context
        leaves; EngineRejectedError when the prompt leaves none (checked before generating)."""
        limit = self.engine.context_limit
        if limit is None or len(prompt) + self.sampling.max_new_tokens <= limit:
            return self.sampling
        if len(prompt) >= limit:
            raise EngineRejectedError(f"the prompt's {len(prompt)} tokens fill engine "
                                      f"{self.engine.name}'s context of {limit}")
        return dataclasses.replace(self.sampling, max_new_tokens=limit - len(prompt))

    async def _generate(self, batch: Batch, rows: list[int], params: SamplingParams, seed: int,
                        out: dict[int, list[Completion]]) -> None:
        """The completions of `batch[rows]` into `out`, in one engine call; if the engine
        refuses it, row by row, so only the refused prompts are `rejected`."""
        try:
            groups = await self.in_engine(self.engine.generate, [batch[i][1] for i in rows],
                                          params, seed=seed)
        except EngineRejectedError as err:
            if len(rows) == 1:
                self.rejected.append(RejectedPrompt(rows[0], str(err)))
                return
            for row in rows:
                await self._generate(batch, [row], params, seed, out)
            return
        out.update(zip(rows, groups, strict=True))

    async def scored_group(self, task: PromptTask, prompt: list[int],
                           completions: list[Completion], sequence: int,
                           token_versions: list[np.ndarray] | None = None,
                           generate_s: float | None = None) -> TrajectoryGroup:
        """The group of `completions`, scored; `token_versions[i]` are sample i's per-token
        versions (None: each sample's `policy_version` for all its tokens); `generate_s` its
        generation time (None: the last batch's)."""
        began = time.perf_counter()
        n = len(completions)
        texts = [self.engine.decode(c.token_ids[:-1] if c.finish_reason == "stop"
                                    else c.token_ids) for c in completions]
        scored = await self.scorer.score(texts, [task.reference] * n, [task.prompt] * n)
        versions = token_versions or [None] * n
        samples = [_sample(c, s, v) for c, s, v in zip(completions, scored, versions, strict=True)]
        return self.group(task, prompt, samples, sequence, self.params_for(prompt).as_wire(),
                          {"generate_s": self.generate_s if generate_s is None else generate_s,
                           "reward_s": time.perf_counter() - began})


def _sample(completion: Completion, scored: Scored, versions: np.ndarray | None) -> Sample:
    ids = completion.token_ids
    if versions is None:
        versions = np.full(len(ids), completion.policy_version, dtype=np.int32)
    return Sample(response_token_ids=ids, logprobs=completion.logprobs, versions=versions,
                  reward=scored.reward, finish_reason=completion.finish_reason,
                  error=scored.error)


class EpisodeGroups(GroupBuilder):
    """n episodes per prompt through an environment (see the module docstring)."""

    def __init__(self, engine, sampling, producer_id, counts, *, factory: EnvironmentFactory,
                 settings: EpisodeSettings, in_engine: Callable):
        super().__init__(engine, sampling, producer_id, counts)
        self.factory, self.settings, self.in_engine = factory, settings, in_engine
        check_stop_strings(engine, factory)
        self.compact = is_single_turn(factory)
        if (warning := context_warning(settings, engine.context_limit)) is not None:
            log.warning("%s", warning)
        for name in EPISODE_COUNTERS:
            counts.setdefault(f"producer/{name}", 0)

    async def groups(self, batch: Batch, seed: int, sequence: int) -> list[TrajectoryGroup]:
        self.generate_s = 0.0
        runner = EpisodeRunner(self.engine, self.factory, self.settings, self.sampling,
                               generate_in_engine=self._generate, in_engine=self._timed)
        records = await runner.run(batch, seed)
        self.counts["producer/env_threads_stuck"] = abandoned_threads()  # a gauge
        failed_before = self.counts["producer/failed_episodes"]
        groups = [self._group(task, episodes, sequence)
                  for (task, _), episodes in zip(batch, records)]
        self.failed = [self._failed(index, task, ids, j, episode, sequence)
                       for index, ((task, ids), episodes) in enumerate(zip(batch, records))
                       for j, episode in enumerate(episodes) if episode.failed]
        if self.counts["producer/failed_episodes"] > failed_before:
            log.warning("failed episodes so far (never trained): %s", {
                k.removeprefix("producer/failed/"): int(v) for k, v in self.counts.items()
                if k.startswith("producer/failed/")})
        return [g for g in groups if g is not None]

    async def _generate(self, prompts, params, **kwargs):
        return await self._timed(self.engine.generate, prompts, params, **kwargs)

    async def _timed(self, fn, *args, **kwargs):
        """`fn` in the engine's thread, its time counted as generation (`generate_s`)."""
        began = time.perf_counter()
        try:
            return await self.in_engine(fn, *args, **kwargs)
        finally:
            self.generate_s += time.perf_counter() - began

    def _group(self, task: PromptTask, episodes: list[EpisodeRecord],
               sequence: int) -> TrajectoryGroup | None:
        prompt = next((e.prompt for e in episodes if not e.failed), None)
        for episode in episodes:
            if not episode.failed and episode.prompt != prompt:
                episode.fail("prompt_mismatch", "reset opened with another first prompt than "
                                                "the group's first episode")
        samples = []
        for episode in episodes:
            if not episode.failed:
                with episode.working():
                    samples.append(episode.sample(compact=self.compact))
            self._count(episode)
        if not samples:
            self.counts["producer/empty_groups"] += 1
            return None
        return self.group(task, prompt, samples, sequence, self._sampling_wire(),
                          {"generate_s": self.generate_s,
                           "env_s": sum(e.env_s for e in episodes)})

    def _failed(self, index: int, task: PromptTask, prompt: list[int], j: int,
                episode: EpisodeRecord, sequence: int) -> FailedEpisode:
        """The dead letter's parts: the reason and the episode's sample in a group of its own
        (`<group id>/episode-<j>`)."""
        part, reason = f"episode-{j}", failed_episode_reason(episode.failure)
        sample = episode.sample(compact=self.compact)
        payload = None
        if sample is not None:
            group = self.group(task, episode.prompt or prompt, [sample], sequence,
                               self._sampling_wire(), {"env_s": episode.env_s}, f"/{part}")
            try:
                payload = encode(group)
            except CodecError as err:  # what broke the episode may break its sample too
                reason += f" (its sample does not encode: {err})"
        return FailedEpisode(index, part, reason, episode.failure_kind, payload)

    def _count(self, episode: EpisodeRecord) -> None:
        counts = self.counts
        counts["producer/episodes"] += 1
        counts["producer/turns"] += len(episode.turns)
        counts["producer/tool_calls"] += episode.tool_calls
        counts["producer/tool_errors"] += episode.tool_errors
        counts["producer/env_s"] += episode.env_s
        counts["producer/work_s"] += episode.work_s
        counts["producer/truncated_episodes"] += episode.truncated is not None
        if episode.unk_observations and not counts["producer/unk_observations"]:
            log.warning("an observation holds the tokenizer's unknown token: the model reads "
                        "it as <unk> (counted in producer/unk_observations)")
        counts["producer/unk_observations"] += episode.unk_observations
        if episode.failed:
            counts["producer/failed_episodes"] += 1
            key = f"producer/failed/{episode.failure_kind}"
            counts[key] = counts.get(key, 0) + 1

    def _sampling_wire(self) -> dict:
        wire = self.sampling.as_wire()
        if self.compact:
            wire["max_new_tokens"] = min(wire["max_new_tokens"], self.settings.max_total_tokens)
            return wire
        return {**wire, "max_new_tokens": self.settings.max_total_tokens,
                "turn_tokens": self.sampling.max_new_tokens}
