"""Environments for multi-turn episodes: the contract, tools, the sandboxed interpreter, loading.

An environment spec (the `env` setting) is a built-in name (`BUILTIN_ENVIRONMENTS`:
`single_turn`, today's prompt -> answer -> reward; `calculator`; `python`) or
`package.module:Name` naming an `Environment` subclass. `load_environment` returns a factory
that builds a fresh instance per episode; a class whose constructor takes `reward=` gets the
run's reward `Scorer` (the built-ins all do), a `ToolEnvironment` the run's tool limits
(`settings=`, the `tools.*` settings) and `python` (a `PythonEnv`) the process's sandbox with
the run's limits (`sandbox.*`). This package imports no engine, bus or trainer:
the producer drives environments, never the other way round. See docs/environments.md.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from miles.envs.base import (FINISH_REASONS, INFO_ERROR, INFO_TOOL_CALLS, INFO_TOOL_ERRORS,
                             Action, Environment, Message, Messages, Observation, SingleTurn,
                             Step, Task, score_final)
from miles.envs.builtin import CalculatorEnv, PythonEnv, python_tool, shared_sandbox
from miles.envs.calculator import calculator
from miles.envs.sandbox import PythonSandbox, SandboxLimits, SandboxResult
from miles.envs.tool_env import ToolEnvironment
from miles.envs.tools import Tool, ToolBox, ToolCall, ToolSettings, parse_tool_calls, tool
from miles.errors import ConfigError
from miles.plugins import import_object, split_spec
from miles.tasks.rewards import Scorer

__all__ = ["BUILTIN_ENVIRONMENTS", "FINISH_REASONS", "INFO_ERROR", "INFO_TOOL_CALLS",
           "INFO_TOOL_ERRORS", "Action", "CalculatorEnv", "Environment", "EnvironmentFactory",
           "Message", "Messages", "Observation", "PythonEnv", "PythonSandbox", "SandboxLimits",
           "SandboxResult", "SingleTurn", "Step", "Task", "Tool", "ToolBox", "ToolCall",
           "ToolEnvironment", "ToolSettings", "calculator", "load_environment",
           "parse_tool_calls", "python_tool", "score_final", "tool"]

EnvironmentFactory = Callable[[], Environment]
BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {
    "single_turn": SingleTurn, "calculator": CalculatorEnv, "python": PythonEnv}


def load_environment(spec: str, *, reward: Scorer | None = None, tools: ToolSettings | None = None,
                     sandbox: SandboxLimits | None = None) -> EnvironmentFactory:
    """A factory of fresh environments for `spec` (see the module docstring); ConfigError
    naming the spec if it cannot be loaded or built with what is given."""
    cls = BUILTIN_ENVIRONMENTS.get(spec)
    if cls is None:
        if split_spec(spec) is None:
            raise ConfigError(f"env must be one of {sorted(BUILTIN_ENVIRONMENTS)} or "
                              f"package.module:Name, got {spec!r}")
        cls = import_object(spec, kind="env")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"env {spec!r} is not an Environment subclass "
                          f"(a {type(cls).__name__}: {cls!r})")
    if inspect.isabstract(cls):
        raise ConfigError(f"env {spec!r} is abstract: it does not implement "
                          f"{sorted(cls.__abstractmethods__)}")
    kwargs = {"reward": reward} if _takes(cls, "reward") else {}
    if tools is not None and issubclass(cls, ToolEnvironment) and _takes(cls, "settings"):
        kwargs["settings"] = tools
    if sandbox is not None and issubclass(cls, PythonEnv):
        kwargs["sandbox"] = shared_sandbox(sandbox)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"env {spec!r} cannot be built with {sorted(kwargs) or 'no arguments'}"
                          f": {err}") from None
    if kwargs and reward is None:
        raise ConfigError(f"env {spec!r} needs a reward")
    return functools.partial(cls, **kwargs)


def _takes(cls: type, name: str) -> bool:
    """Whether `cls(...)` takes keyword argument `name`."""
    try:
        parameter = inspect.signature(cls).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
