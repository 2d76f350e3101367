"""`ToolEnvironment`: a multi-turn environment whose model calls tools until it answers.

Each step: when the action contains tool calls (in the class's `tool_style`) and the episode
has tool turns left (`ToolSettings.max_tool_turns`), the calls run and their results are the
next observation (done=False, `info` counts `tool_calls` and `tool_errors`); otherwise the
action is the final answer, scored by the reward (done=True). A subclass sets `tools` (or passes
them), `tool_style`, and may override `first_observation` (e.g. to describe the tools) and
`final_answer` (e.g. to cut the answer out of the text). `stop_strings` default to the style's
closing tag, so the engine ends a turn right after a call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from miles.envs.base import (INFO_TOOL_CALLS, INFO_TOOL_ERRORS, Action, Environment, Observation,
                             Step, Task, score_final, started_task)
from miles.envs.tools import CLOSING_TAGS, STYLES, Tool, ToolBox, ToolSettings, ToolTurn
from miles.errors import EnvError
from miles.tasks.rewards import Scorer

INFO_BUDGET_EXHAUSTED = "tool_budget_exhausted"


class ToolEnvironment(Environment):
    """Tools plus a final-answer reward; see the module docstring."""

    tool_style: ClassVar[str] = "json"
    tools: ClassVar[tuple[Tool | Callable[..., Any], ...]] = ()
    chat_observations: ClassVar[bool] = False
    """Observations as `tool` messages (for a chat template to wrap) instead of tagged text."""
    stop_strings = (CLOSING_TAGS["json"],)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if cls.tool_style not in STYLES:
            raise EnvError(f"{cls.__qualname__}.tool_style must be one of {STYLES}, "
                           f"got {cls.tool_style!r}")
        if "stop_strings" not in cls.__dict__:
            cls.stop_strings = (CLOSING_TAGS[cls.tool_style],)
        super().__init_subclass__(**kwargs)

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] | None = None, *,
                 reward: Scorer, settings: ToolSettings | None = None):
        self.toolbox = ToolBox(self.tools if tools is None else tools, style=self.tool_style,
                               settings=settings)
        self.reward = reward
        self.tool_turns = 0
        self._task: Task | None = None
        self._done = False

    async def reset(self, task: Task) -> Observation | None:
        self._task, self._done, self.tool_turns = task, False, 0
        return await self.first_observation(task)

    async def first_observation(self, task: Task) -> Observation | None:
        """The first observation; default None: the task's prompt as is."""
        return None

    def final_answer(self, action: Action) -> str:
        """The text the reward scores; default: the whole action."""
        return action.text

    async def step(self, action: Action) -> Step:
        task = self._started()
        calls = self.toolbox.parse(action.text)
        if calls and self.tool_turns < self.toolbox.settings.max_tool_turns:
            self.tool_turns += 1
            turn = await self.toolbox.run(calls)
            return Step(self._observation(turn),
                        info={INFO_TOOL_CALLS: turn.calls, INFO_TOOL_ERRORS: turn.errors})
        self._done = True
        info: dict[str, Any] = {INFO_TOOL_CALLS: 0, INFO_TOOL_ERRORS: 0}
        if calls:
            info[INFO_BUDGET_EXHAUSTED] = True
        return await score_final(self.reward, self.final_answer(action), task, **info)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' descriptions, for a chat template's `tools=`."""
        return self.toolbox.schemas()

    def _observation(self, turn: ToolTurn) -> Observation:
        if self.chat_observations:
            return tuple({"role": "tool", "content": r.content} for r in turn.results)
        return self.toolbox.render(turn)

    def _started(self) -> Task:
        return started_task(self, self._task, self._done)
