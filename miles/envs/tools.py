"""Tools: plain Python functions a model calls from its text, parsed, run and answered safely.

`tool(fn)` describes a function (sync or `async def`) by its name, docstring and signature; the
JSON-schema-like `Tool.schema()` is what chat templates take as `tools=`. Two call conventions
(`STYLES`), one per environment:
- `json`, as the Qwen/Hermes chat templates teach: `<tool_call>{"name": "NAME", "arguments":
  {...}}</tool_call>`, any number per action; results come back as
  `<tool_response>\\nRESULT\\n</tool_response>` blocks (or as `tool` messages for a chat template
  to wrap);
- `text`, for tiny models: `<tool>NAME: ARGUMENT</tool>`; ARGUMENT is everything after the first
  colon, stripped, passed as the tool's one parameter (tools with exactly one parameter only);
  results come back as `<result>RESULT</result>`.
`ToolBox.run(text)` never raises: an unknown tool, a malformed call, bad arguments, an exception
or a timeout each become an `error: ...` result, counted in `ToolTurn.errors`. Sync tools run in
a daemon thread per call (a timed-out one is abandoned, as with rewards); async tools run on the
event loop, so one that blocks it cannot be timed out. Calls of one action run in order, at most
`max_calls_per_step`; each result is cut at `max_result_chars` with a visible marker.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from miles.errors import ConfigError, ToolError
from miles.tasks.rewards.scorer import in_daemon_thread

STYLES = ("json", "text")
CLOSING_TAGS = {"json": "</tool_call>", "text": "</tool>"}
"""What ends a tool call in each style: the stop string of a tool-using environment."""
TRUNCATION_MARKER = "\n[truncated: {omitted} more characters]"
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
JSON_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TEXT_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
OPENING_TAGS = {"json": "<tool_call>", "text": "<tool>"}
JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                               list: "array", dict: "object"}


@dataclass(frozen=True, kw_only=True)
class ToolSettings:
    """How an environment runs tools."""

    timeout_s: float = 10.0
    """Wall-clock limit of one tool call."""
    max_result_chars: int = 2000
    """Characters of one result kept in the observation; the rest is replaced by a marker."""
    max_calls_per_step: int = 4
    """Tool calls run per action; further calls get an error result instead."""
    max_tool_turns: int = 8
    """Actions with tool calls per episode; the next action is scored as the final answer."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"tools.timeout_s must be > 0 and finite, got {self.timeout_s}")
        for name in ("max_result_chars", "max_calls_per_step", "max_tool_turns"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ConfigError(f"tools.{name} must be an integer >= 1, "
                                  f"got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Parameter:
    name: str
    json_type: str | None
    required: bool


@dataclass(frozen=True)
class Tool:
    """A callable described for a model: build it with `tool(fn)`."""

    name: str
    description: str
    fn: Callable[..., Any]
    parameters: tuple[Parameter, ...]
    is_async: bool

    def schema(self) -> dict[str, Any]:
        """The function description chat templates and OpenAI-style APIs take as `tools=`."""
        properties = {p.name: ({"type": p.json_type} if p.json_type else {})
                      for p in self.parameters}
        required = [p.name for p in self.parameters if p.required]
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": required}}}

    def bind(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of a call, checked; ToolError saying what is wrong if not."""
        known = {p.name: p for p in self.parameters}
        unexpected = sorted(set(arguments) - set(known))
        if unexpected:
            raise ToolError(f"{self.name} got unexpected argument(s) {unexpected}; "
                            f"it takes {sorted(known)}")
        for p in self.parameters:
            if p.name not in arguments:
                if p.required:
                    raise ToolError(f"{self.name} is missing argument {p.name!r}")
            elif p.json_type and not _has_type(arguments[p.name], p.json_type):
                raise ToolError(f"{self.name} argument {p.name!r} must be a {p.json_type}, "
                                f"got {arguments[p.name]!r}")
        return dict(arguments)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None) -> Any:
    """`fn` as a `Tool` (usable as `@tool` or `@tool(name=...)`): its parameters come from the
    signature (annotations str/int/float/bool/list/dict map to JSON types), its description from
    the docstring. ConfigError for signatures a model cannot call (*args, **kwargs,
    positional-only parameters)."""
    if fn is None:
        return lambda f: tool(f, name=name, description=description)
    tool_name = name or getattr(fn, "__name__", "")
    if not NAME_PATTERN.fullmatch(tool_name):
        raise ConfigError(f"tool name must match {NAME_PATTERN.pattern}, got {tool_name!r}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations only lose their JSON types
        hints = {}
    parameters = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise ConfigError(f"tool {tool_name}: parameter {p.name!r} must be passable by "
                              f"keyword (no *args, **kwargs or positional-only)")
        parameters.append(Parameter(p.name, JSON_TYPES.get(hints.get(p.name)),
                                    p.default is inspect.Parameter.empty))
    doc = description if description is not None else inspect.getdoc(fn) or ""
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))
    return Tool(tool_name, doc, fn, tuple(parameters), is_async)


def _has_type(value: Any, json_type: str) -> bool:
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {v: k for k, v in JSON_TYPES.items()}[json_type]
    return isinstance(value, python)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: a name and keyword arguments (json style) or one raw argument (text
    style); `error` says why the call is malformed (it is then not run)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    argument: str | None = None
    error: str | None = None


def parse_tool_calls(text: str, style: str) -> list[ToolCall]:
    """Every tool call in `text`, in order, malformed ones included (with their `error`)."""
    if style not in STYLES:
        raise ConfigError(f"tool style must be one of {STYLES}, got {style!r}")
    pattern, parse = (JSON_CALL, _json_call) if style == "json" else (TEXT_CALL, _text_call)
    calls, end = [], 0
    for match in pattern.finditer(text):
        calls.append(parse(match.group(1)))
        end = match.end()
    if OPENING_TAGS[style] in text[end:]:
        calls.append(ToolCall("", error=f"unclosed {OPENING_TAGS[style]} "
                                        f"(no {CLOSING_TAGS[style]})"))
    return calls


def _json_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", error=f"malformed tool call: not JSON ({err.msg} at char {err.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall("", error='malformed tool call: expected {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI-style arguments encoded as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error="malformed tool call: arguments must be an object")
    return ToolCall(call["name"], arguments)


def _text_call(body: str) -> ToolCall:
    name, colon, argument = body.partition(":")
    name = name.strip()
    if not colon or not NAME_PATTERN.fullmatch(name):
        return ToolCall(name, error="malformed tool call: expected <tool>NAME: ARGUMENT</tool>")
    return ToolCall(name, argument=argument.strip())


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    error: bool


@dataclass(frozen=True)
class ToolTurn:
    """The tool calls of one action, run: results in order, how many calls, how many failed."""

    results: tuple[ToolResult, ...]

    @property
    def calls(self) -> int:
        return len(self.results)

    @property
    def errors(self) -> int:
        return sum(result.error for result in self.results)


class ToolBox:
    """A set of tools with one call style and its settings; parses, runs and renders."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]], *, style: str = "json",
                 settings: ToolSettings | None = None):
        if style not in STYLES:
            raise ConfigError(f"tool style must be one of {STYLES}, got {style!r}")
        self.style = style
        self.settings = settings or ToolSettings()
        self.tools: dict[str, Tool] = {}
        for item in tools:
            described = item if isinstance(item, Tool) else tool(item)
            if described.name in self.tools:
                raise ConfigError(f"two tools are named {described.name!r}")
            if style == "text" and len(described.parameters) != 1:
                raise ConfigError(f"tool {described.name}: the text style passes one argument, "
                                  f"it takes {len(described.parameters)}")
            self.tools[described.name] = described

    def parse(self, text: str) -> list[ToolCall]:
        return parse_tool_calls(text, self.style)

    async def run(self, calls: list[ToolCall]) -> ToolTurn:
        """Run `calls` in order (at most `max_calls_per_step`); never raises for a tool's fault."""
        limit = self.settings.max_calls_per_step
        results = []
        for call in calls[:limit]:
            content, failed = await self._run_one(call)
            results.append(ToolResult(call.name, truncate(content, self.settings.max_result_chars),
                                      failed))
        results += [ToolResult(call.name, f"error: not run, at most {limit} tool calls per "
                                          "step", True) for call in calls[limit:]]
        return ToolTurn(tuple(results))

    def render(self, turn: ToolTurn) -> str:
        """The results as observation text in this box's style."""
        if self.style == "json":
            return "\n".join(f"<tool_response>\n{r.content}\n</tool_response>"
                             for r in turn.results)
        return "\n".join(f"<result>{r.content}</result>" for r in turn.results)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def _run_one(self, call: ToolCall) -> tuple[str, bool]:
        """(the result's text, whether it is an error)."""
        failure = call.error
        found = self.tools.get(call.name)
        if failure is None and found is None:
            failure = f"unknown tool {call.name!r} (tools: {', '.join(sorted(self.tools))})"
        if failure is not None:
            return f"error: {failure}", True
        timeout_s = self.settings.timeout_s
        deadline = asyncio.timeout(timeout_s)
        try:
            arguments = found.bind(call.arguments if call.argument is None
                                   else {found.parameters[0].name: call.argument})
            async with deadline:
                if found.is_async:
                    value = await found.fn(**arguments)
                else:
                    value = await in_daemon_thread(found.fn, **arguments)
        except ToolError as err:
            return f"error: {err}", True
        except TimeoutError as err:
            why = f"timed out after {timeout_s:g} s" if deadline.expired() else \
                f"raised TimeoutError: {err}"
            return f"error: {call.name} {why}", True
        except Exception as err:  # noqa: BLE001 - a tool must never stop the episode
            return f"error: {call.name} raised {type(err).__name__}: {err}", True
        return _as_text(value), False


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple, int, float, bool)) or value is None:
        return json.dumps(value, default=str)
    return str(value)


def truncate(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, followed by a marker saying how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + TRUNCATION_MARKER.format(omitted=len(text) - limit)
