"""The episode runner: n episodes per prompt, many at once, their turns batched into the engine.

Each episode is a straight-line coroutine: build the environment, `reset`, then per turn ask for
a completion, `step` the environment with it, append the observation's ids (`Renderer`), until a
`Step` is done or a limit truncates the episode; `close` always runs. Scheduling: a round takes
every episode that is waiting for its next turn and generates them in one engine call (in the
engine's thread, `generate_in_engine`); environment calls run meanwhile as asyncio tasks, so an
episode whose environment is slow simply misses this round and joins a later one, and nobody
waits for it. Every environment call (build, `reset`, `step`, `close`) is bounded by
`env_step_timeout_s` and runs on the episode's own thread and event loop
(`miles.episodes.hosting`; `Environment.own_thread`), so an environment that blocks holds its
own episode only, and its timeout fires on the producer's loop.

Failures: an environment that raises or times out, a chat template that breaks the prefix
rule (`EpisodeError`) or a malformed task fail that episode only: it is recorded with its
reason (`EpisodeRecord.failure`, "kind: message"; the sample's `error`, finish reason "abort"
and `episode["failed"]`) and the producer never publishes it for training. So does a request
the engine refuses for what it asks (`EngineRejectedError`, "engine_rejected": the rows of the
refused call are generated one by one to find it). Any other `EngineError` fails the whole
batch (the producer retries it), after every environment is closed.

Limits (`EpisodeSettings`): a turn samples at most `sampling.max_new_tokens` and never past
`max_total_tokens` for the episode; after `max_turns` turns, an observation longer than
`max_observation_tokens`, or one that would reach `max_total_tokens`, the episode ends
truncated (finish reason "length", `episode["truncated"]` names the limit), without that
observation: truncating an observation would show the model something the environment never
said (and cut a chat template's markup in half). A last turn cut by its token budget is
"length" too. One engine call uses the largest budget of its rows; a row past its own budget
is cut there, which keeps a valid sample of the shorter budget.

The engine's context (`RolloutEngine.context_limit`: hf's max_position_embeddings, vLLM's
max_model_len) bounds the whole sequence, prompt included: a turn never asks for more than the
room left (vLLM refuses such a request; hf would sample at positions the model never saw), and
an observation that would leave no room ends the episode truncated ("max_context"); a first
prompt that fills the context fails its episode ("max_context"). Rows near the context get an
engine call of their own per room left (the call's budget is the largest of its rows), so the
one call per round holds until episodes reach the context.

Streaming (`stream_turns`, `miles.episodes.turn_streams`): instead of rounds, each turn goes to
the engine the moment its episode asks for it. The HF engine's turns join its continuous
batcher at the next decoding step (the scheduler steps the batcher while any turn is in
flight; a weight load lands between two steps, so a turn may straddle it: its tokens carry the
version that sampled each, `TurnResult.versions`); the vLLM engines' turns are concurrent
requests, which vLLM batches itself. An episode whose tool returns no longer waits for the
round's longest turn, and the engine keeps generating the other episodes' turns while tools
run.

Simplification: the engine generates n=1 per row; the n episodes of a prompt are n rows (the
HF engine then computes the same tokens as n samples of one prompt, without sharing the
prefill).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from miles.engines.base import Completion, RolloutEngine
from miles.envs import (INFO_ERROR, INFO_TOOL_CALLS, INFO_TOOL_ERRORS, Action, Environment,
                        EnvironmentFactory, SingleTurn, Step)
from miles.episodes.hosting import (MAX_ABANDONED_THREADS, LoopHost, ThreadHost,
                                    abandoned_threads, runs_in_own_thread)
from miles.episodes.rendering import Context, Renderer, task_of
from miles.episodes.samples import EpisodeRecord, Turn
from miles.episodes.turn_streams import InEngineFn, TurnResult, turn_stream
from miles.errors import ConfigError, EngineRejectedError, EpisodeError
from miles.protocol import PromptTask
from miles.rl.sampling import SamplingParams

GenerateFn = Callable[..., Awaitable[list[list[Completion]]]]
Host = Union[LoopHost, ThreadHost]
STREAMING_TURN_ENGINES = ("hf", "vllm", "vllm-server")  # what `stream_turns` can run on
ROUND_GATHER_S = 0.05  # a round waits this long at most for episodes in environment calls


async def _in_thread(fn, *args):
    return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True, kw_only=True)
class EpisodeSettings:
    """Limits and timeouts of the producer's episodes (used when `env` is set)."""

    max_turns: int = 8  # model turns per episode; then it ends truncated ("max_turns")
    max_total_tokens: int = 256  # tokens after the first prompt (policy + observations)
    max_observation_tokens: int = 128  # ids one observation may add; more ends the episode
    env_step_timeout_s: float = 30.0  # bound on each reset, step and close of an environment
    max_concurrent: int = 0  # episodes running at once (0: every episode of the batch)
    stream_turns: bool = False  # turns join the engine's continuous batch (hf) between steps

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_observation_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"episodes.{name} must be >= 1, got {getattr(self, name)}")
        if not self.env_step_timeout_s > 0:
            raise ConfigError(f"episodes.env_step_timeout_s must be > 0, got "
                              f"{self.env_step_timeout_s}")
        if self.max_concurrent < 0:
            raise ConfigError(f"episodes.max_concurrent must be >= 0, got {self.max_concurrent}")

    def check_engine(self, engine: str) -> None:
        """ConfigError when these settings need what engine kind `engine` lacks."""
        if self.stream_turns and engine not in STREAMING_TURN_ENGINES:
            raise ConfigError(f"episodes.stream_turns needs one of the engines "
                              f"{', '.join(STREAMING_TURN_ENGINES)}, got engine {engine!r}")


@dataclass
class _Request:
    prompt: list[int]
    budget: int
    ceiling: int  # the most tokens the engine may be asked for here (its context's room)
    order: int  # its episode's position in the batch: rows go to the engine in this order
    stop_strings: tuple[str, ...]
    future: asyncio.Future


class EpisodeRunner:
    """Runs the episodes of a batch of prompts (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, factory: EnvironmentFactory,
                 settings: EpisodeSettings, sampling: SamplingParams, *,
                 generate_in_engine: GenerateFn, in_engine: InEngineFn = _in_thread):
        self.engine, self.factory, self.settings = engine, factory, settings
        self.sampling = sampling
        self.generate_in_engine = generate_in_engine
        self.renderer = Renderer(engine)
        self.rounds = 0  # engine calls made (streamed: decoding steps)
        self._requests: list[_Request] = []
        self._wake = asyncio.Event()
        self._in_env = 0  # episodes in an environment call now
        self._stream = turn_stream(engine, in_engine) if settings.stream_turns else None

    async def run(self, prompts: list[tuple[PromptTask, list[int]]],
                  seed: int) -> list[list[EpisodeRecord]]:
        """`sampling.n` episodes per prompt (with its token ids); their records, prompt by
        prompt. EngineError if the engine fails (every environment is closed first)."""
        limit = asyncio.Semaphore(self.settings.max_concurrent or len(prompts) * self.sampling.n)
        if self._stream is not None:
            self._stream.seed = seed
        tasks = [asyncio.create_task(self._episode(i, task, ids, limit, order))
                 for order, (i, (task, ids)) in enumerate(
                     (i, p) for i, p in enumerate(prompts) for _ in range(self.sampling.n))]
        try:
            await self._schedule(tasks, seed)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._stream is not None:
                await self._stream.abort_all()
            raise
        records = [task.result() for task in tasks]
        n = self.sampling.n
        return [records[i * n:(i + 1) * n] for i in range(len(prompts))]

    # -- scheduling ---------------------------------------------------------------------------

    async def _schedule(self, tasks: list[asyncio.Task], seed: int) -> None:
        """Rounds until every episode is over: each round generates the next turn of every
        episode waiting for one, in one engine call."""
        while True:
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # a programming error: crash loudly
            running = [task for task in tasks if not task.done()]
            if not running:
                return
            self._wake.clear()
            if self._stream is not None and self._stream.busy:
                self.rounds += 1
                await self._stream.step()
                continue
            if self._requests:
                await self._gather()
                requests, self._requests = self._requests, []
                requests.sort(key=lambda r: r.order)  # not arrival order: threads race
                await self._round(requests, seed + self.rounds)
                continue
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([*running, waker], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waker.cancel()

    async def _gather(self) -> None:
        """Give the episodes in environment calls up to `ROUND_GATHER_S` to join this round:
        a call on an environment's thread comes back through the loop a moment after it ends,
        and without the wait fast environments would miss every round and double the engine
        calls. A slower environment misses the round, as before."""
        deadline = time.monotonic() + ROUND_GATHER_S
        while self._in_env and (left := deadline - time.monotonic()) > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    async def _round(self, requests: list[_Request], seed: int) -> None:
        """One engine call per distinct (stop strings, ceiling) among `requests` (one, when
        every environment of the factory has the class's and no episode is near the engine's
        context); each row cut to its own budget."""
        self.rounds += 1
        calls: dict[tuple[tuple[str, ...], int], list[_Request]] = {}
        for request in requests:
            calls.setdefault((request.stop_strings, request.ceiling), []).append(request)
        for (stops, _), rows in calls.items():
            await self._generate_rows(rows, stops, seed)

    async def _generate_rows(self, rows: list[_Request], stops: tuple[str, ...],
                             seed: int) -> None:
        """Generate `rows` in one engine call. A request the engine refuses (EngineRejectedError:
        retrying cannot help) is found by generating the rows one by one, and fails its own
        episode ("engine_rejected"), not the batch."""
        params = dataclasses.replace(self.sampling, n=1,
                                     max_new_tokens=max(r.budget for r in rows))
        try:
            groups = await self.generate_in_engine([r.prompt for r in rows], params, seed=seed,
                                                   stop_strings=stops)
        except EngineRejectedError as err:
            if len(rows) == 1:
                rows[0].future.set_exception(EpisodeError("engine_rejected", str(err)))
                return
            for row in rows:
                await self._generate_rows([row], stops, seed)
            return
        for row, (completion,) in zip(rows, groups, strict=True):
            row.future.set_result(within_budget(completion, row.budget))

    async def _next_turn(self, prompt: list[int], budget: int, ceiling: int,
                         stop_strings: tuple[str, ...], order: int) -> TurnResult:
        if self._stream is not None:
            params = dataclasses.replace(self.sampling, n=1, max_new_tokens=budget)
            future = self._stream.submit(prompt, params, stop_strings)
            self._wake.set()
            return await future
        future = asyncio.get_running_loop().create_future()
        self._requests.append(_Request(list(prompt), budget, ceiling, order, stop_strings,
                                       future))
        self._wake.set()
        completion = await future
        return TurnResult(completion, np.full(len(completion.token_ids),
                                              completion.policy_version, dtype=np.int32))

    # -- one episode --------------------------------------------------------------------------

    async def _episode(self, index: int, task: PromptTask, prompt_ids: list[int],
                       limit: asyncio.Semaphore, order: int) -> EpisodeRecord:
        record = EpisodeRecord(task_index=index, order=order)
        async with limit:
            if abandoned_threads() >= MAX_ABANDONED_THREADS:
                record.fail("env_stuck", f"{abandoned_threads()} environment threads are still "
                                         f"running past their timeout; no new episode starts")
                return record
            host = (ThreadHost(f"env-{index}") if runs_in_own_thread(self.factory)
                    else LoopHost())
            env: Environment | None = None
            try:
                env = await self._env_call(record, host, "build", self.factory)
                context = await self._start(record, host, env, task, prompt_ids)
                await self._turns(record, host, env, context)
            except EpisodeError as failure:
                record.fail(failure.kind, str(failure))
            finally:
                await self._close(record, host, env)
        return record

    async def _start(self, record: EpisodeRecord, host: Host, env: Environment,
                     task: PromptTask, prompt_ids: list[int]) -> Context:
        episode_task = task_of(task)
        first = await self._env_call(record, host, "reset", env.reset, episode_task)
        with record.working():
            context = self.renderer.first(episode_task, first, prompt_ids,
                                          tools=env.tool_schemas())
            record.prompt = list(context.ids)
        return context

    async def _turns(self, record: EpisodeRecord, host: Host, env: Environment,
                     context: Context) -> None:
        while True:
            ceiling = self._ceiling(context)
            budget = min(ceiling, self.settings.max_total_tokens - record.length)
            result = await self._next_turn(context.ids, budget, ceiling, env.stop_strings,
                                           record.order)
            completion = result.completion
            with record.working():
                text = self.engine.decode(completion.token_ids)
                context.ids += completion.token_ids.tolist()
                turn = Turn(completion, versions=result.versions)
                record.turns.append(turn)
                action = Action(text, completion.token_ids.tolist(), completion.finish_reason)
            step = await self._env_call(record, host, "step", env.step, action)
            with record.working():
                if not self._goes_on(record, context, turn, text, step):
                    return

    def _ceiling(self, context: Context) -> int:
        """The most tokens the next turn may sample: `max_new_tokens`, or less where the
        engine's context has less room left. No room at all can only be the first turn's (a
        later one is truncated before, `_goes_on`): the episode fails ("max_context")."""
        limit = self.engine.context_limit
        if limit is None:
            return self.sampling.max_new_tokens
        room = limit - len(context.ids)
        if room < 1:
            raise EpisodeError("max_context", f"the first prompt's {len(context.ids)} tokens "
                                              f"fill the engine's context of {limit}")
        return min(self.sampling.max_new_tokens, room)

    def _goes_on(self, record: EpisodeRecord, context: Context, turn: Turn, text: str,
                 step: Step) -> bool:
        """Take `step` into the episode; whether it has another turn (else it ended, done or
        truncated by a limit)."""
        limits = self.settings
        self._take(record, turn, step)
        if step.done:
            if turn.completion.finish_reason == "length":
                record.truncated = "max_new_tokens"
            return False
        if len(record.turns) >= limits.max_turns:
            record.truncated = "max_turns"
            return False
        observation = self.renderer.extend(context, text, step.observation)
        record.unk_observations += self.renderer.unknown(observation)
        if len(observation) > limits.max_observation_tokens:
            record.truncated = "max_observation_tokens"
            return False
        if record.length + len(observation) >= limits.max_total_tokens:
            record.truncated = "max_total_tokens"
            return False
        if (self.engine.context_limit or math.inf) <= len(context.ids) + len(observation):
            record.truncated = "max_context"  # no room left for the model's next turn
            return False
        turn.observation = observation
        context.ids += observation
        return True

    @staticmethod
    def _take(record: EpisodeRecord, turn: Turn, step: Step) -> None:
        turn.reward = step.reward
        record.tool_calls += int(step.info.get(INFO_TOOL_CALLS, 0))
        record.tool_errors += int(step.info.get(INFO_TOOL_ERRORS, 0))
        if step.done and step.info.get(INFO_ERROR) is not None:
            record.reward_error = str(step.info[INFO_ERROR])

    async def _env_call(self, record: EpisodeRecord, host: Host, what: str, fn: Callable,
                        *args: Any) -> Any:
        """`fn(*args)` on the environment's host within the step timeout, its time counted;
        EpisodeError if it raises or times out (environments are user code: any exception is
        theirs)."""
        began = time.perf_counter()
        self._in_env += 1
        try:
            return await host.call(fn, *args, timeout_s=self.settings.env_step_timeout_s)
        except TimeoutError:
            raise EpisodeError("env_timeout", f"{what} took more than "
                                            f"{self.settings.env_step_timeout_s} s") from None
        except Exception as err:  # user code: recorded as the episode's failure
            raise EpisodeError("env_error", f"{what} raised {type(err).__name__}: {err}") from None
        finally:
            record.env_s += time.perf_counter() - began
            self._in_env -= 1
            self._wake.set()

    async def _close(self, record: EpisodeRecord, host: Host, env: Environment | None) -> None:
        """Close `env` (if it was built) and release its host; a stuck host (a call timed
        out) closes it on its own thread once the call returns, nobody waiting for it."""
        later = env.close if env is not None and host.stuck else None
        try:
            if env is not None and not host.stuck:
                await self._env_call(record, host, "close", env.close)
        except EpisodeError as failure:
            record.fail(failure.kind, str(failure))
        finally:
            host.release(later, self.settings.env_step_timeout_s)


def within_budget(completion: Completion, budget: int) -> Completion:
    """`completion` cut to `budget` tokens ("length"): the first `budget` tokens of a longer
    response are what a call with that budget would have sampled."""
    if len(completion.token_ids) <= budget:
        return completion
    return Completion(token_ids=completion.token_ids[:budget].copy(),
                      logprobs=completion.logprobs[:budget].copy(), finish_reason="length",
                      policy_version=completion.policy_version)


def context_warning(settings: EpisodeSettings, limit: int | None) -> str | None:
    """What to warn about at start-up when `max_total_tokens` does not fit the engine's
    context `limit` with any prompt (episodes then end at the context, "max_context")."""
    if limit is None or settings.max_total_tokens < limit:
        return None
    return (f"episodes.max_total_tokens ({settings.max_total_tokens}) plus a prompt does not "
            f"fit the engine's context ({limit} tokens): episodes end truncated "
            f"(\"max_context\") when the context is full; lower episodes.max_total_tokens below "
            f"{limit} minus the longest prompt")


def is_single_turn(factory: EnvironmentFactory) -> bool:
    """Whether `factory` builds `SingleTurn` environments (written exactly as before)."""
    target = getattr(factory, "func", factory)
    return isinstance(target, type) and issubclass(target, SingleTurn)
