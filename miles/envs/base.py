"""The environment contract: `Task` in, `Action`s from the model, `Step`s back.

An `Environment` instance lives for one episode: the producer calls `reset(task)` once, then
`step(action)` with each model turn until a `Step` says `done`, then `close()` (always, also
when the episode failed). A single-turn task is the one-step case (`SingleTurn`): the first step
is scored by today's reward functions and ends the episode.

Choices:
- Observations are text (appended to the context as is) or chat messages (`{"role", "content"}`
  dicts the producer renders with the tokenizer's chat template); `reset` may return None for
  "the task's prompt as is", so a producer can reuse the prompt tokens it already has.
- `Action.text` is the decode of `Action.token_ids`, including a stop string that ended the turn
  (an engine must keep it: a tool call's closing tag is part of what the model sampled).
- `Step.reward` is optional per step; the episode's return is the producer's business (sum of
  the rewards given), so an environment that only scores the end gives one reward on the last step.
- Contract violations raise `EnvError`; a reward's failure is data (`Step.info["error"]`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Union

from miles.errors import EnvError
from miles.tasks.messages import check_messages
from miles.tasks.rewards import Scorer

Message = Mapping[str, str]
Messages = tuple[Message, ...]
Observation = Union[str, Messages]

FINISH_REASONS = ("stop", "stop_string", "length")
"""Why a model turn ended: EOS, one of the environment's stop strings, the token budget."""
INFO_ERROR = "error"
INFO_TOOL_CALLS = "tool_calls"
INFO_TOOL_ERRORS = "tool_errors"


def _frozen(mapping: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    if not isinstance(mapping, Mapping):
        raise EnvError(f"{what} must be a mapping, got {type(mapping).__name__}")
    return MappingProxyType(dict(mapping))


def checked_observation(value: object, what: str) -> Observation:
    """`value` as a str or a tuple of read-only messages (`check_messages`: the checks a
    dataset's and the wire's conversations get); EnvError naming `what` if neither."""
    if isinstance(value, str):
        return value
    if not isinstance(value, Sequence) or not value:
        raise EnvError(f"{what} must be a string or a non-empty sequence of messages, "
                       f"got {type(value).__name__}")
    try:
        messages = check_messages(value)
    except ValueError as err:
        raise EnvError(f"{what} {err}") from None
    return tuple(MappingProxyType(message) for message in messages)


@dataclass(frozen=True)
class Task:
    """What an episode starts from: a prompt (text or chat messages), a reference answer for the
    reward, and anything else the dataset row carried."""

    prompt: Observation
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", checked_observation(self.prompt, "Task.prompt"))
        if self.answer is not None and not isinstance(self.answer, str):
            raise EnvError(f"Task.answer must be a string or None, got {self.answer!r}")
        object.__setattr__(self, "metadata", _frozen(self.metadata, "Task.metadata"))

    @property
    def prompt_text(self) -> str:
        """The prompt as one string (message contents joined by newlines), for `prompt=`."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(message["content"] for message in self.prompt)


@dataclass(frozen=True)
class Action:
    """One model turn: its decoded text, the exact token ids sampled, and why it ended."""

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise EnvError(f"Action.text must be a string, got {type(self.text).__name__}")
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.finish_reason not in FINISH_REASONS:
            raise EnvError(f"Action.finish_reason must be one of {FINISH_REASONS}, "
                           f"got {self.finish_reason!r}")


@dataclass(frozen=True)
class Step:
    """The environment's answer to an action: the next observation (None only when done), an
    optional reward for this step, whether the episode is over, and counters/notes in `info`
    (`tool_calls`, `tool_errors`, `error`)."""

    observation: Observation | None
    reward: float | None = None
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.observation is None:
            if not self.done:
                raise EnvError("Step.observation may be None only when done=True")
        else:
            object.__setattr__(self, "observation",
                               checked_observation(self.observation, "Step.observation"))
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
                raise EnvError(f"Step.reward must be a number or None, got {self.reward!r}")
            if not math.isfinite(self.reward):
                raise EnvError(f"Step.reward must be finite, got {self.reward}")
            object.__setattr__(self, "reward", float(self.reward))
        object.__setattr__(self, "info", _frozen(self.info, "Step.info"))


class Environment(ABC):
    """One episode of interaction; subclass it and implement `reset` and `step`.

    `stop_strings` end a model turn besides EOS (the engine stops there and the string is part of
    the action), e.g. `("</tool_call>",)`.

    `own_thread` (True): each episode's instance runs on its own thread and event loop, so a
    method that blocks (`time.sleep`, CPU work, a blocking client) holds only its episode, and
    the step timeout still fires. Its asyncio objects are its own: do not share an asyncio
    lock, event, queue or client between episodes (threading primitives work). False runs it
    on the producer's loop: cheaper, asyncio objects can be shared, but a call that blocks
    stalls every episode and the producer (see docs/environments.md, "Where it runs").
    """

    stop_strings: ClassVar[tuple[str, ...]] = ()
    own_thread: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        stops = cls.stop_strings
        if not (isinstance(stops, tuple) and all(isinstance(s, str) and s for s in stops)):
            raise EnvError(f"{cls.__qualname__}.stop_strings must be a tuple of non-empty "
                           f"strings, got {stops!r}")

    @abstractmethod
    async def reset(self, task: Task) -> Observation | None:
        """Start the episode; the first observation, or None for the task's prompt as is."""

    @abstractmethod
    async def step(self, action: Action) -> Step:
        """Take the model's turn; what comes back, and whether the episode is over."""

    async def close(self) -> None:
        """Release what the episode held (called once, also after a failure); default: nothing."""
        return None

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools the episode may call, described for a chat template's `tools=` (JSON
        schema, as OpenAI's); default: none."""
        return []


class SingleTurn(Environment):
    """Today's single-turn task as an environment: the prompt, one answer, its reward."""

    def __init__(self, *, reward: Scorer):
        self.reward = reward
        self._task: Task | None = None
        self._done = False

    async def reset(self, task: Task) -> None:
        self._task, self._done = task, False
        return None

    async def step(self, action: Action) -> Step:
        task = self._started()
        self._done = True
        return await score_final(self.reward, action.text, task)

    def _started(self) -> Task:
        return started_task(self, self._task, self._done)


async def score_final(reward: Scorer, answer: str, task: Task, **info: Any) -> Step:
    """The last Step of an episode: `answer` scored against the task's reference; a reward that
    failed gives 0.0 with the reason in `info["error"]` (as `Scorer.score` reports it)."""
    (scored,) = await reward.score([answer], [task.answer], [task.prompt_text])
    if scored.error is not None:
        info[INFO_ERROR] = scored.error
    return Step(None, scored.reward, done=True, info=info)


def started_task(env: Environment, task: Task | None, done: bool) -> Task:
    """The task of an episode `env` is playing: EnvError before `reset` or after the end."""
    if task is None:
        raise EnvError(f"{type(env).__name__}.step called before reset")
    if done:
        raise EnvError(f"{type(env).__name__}.step called after the episode ended")
    return task
