"""Tools: describing functions, parsing both call styles, running calls safely, the calculator."""

import asyncio
import threading
import time

import pytest

from miles.envs.calculator import MAX_EXPRESSION_CHARS, calculator, evaluate
from miles.envs.tools import (TRUNCATION_MARKER, ToolBox, ToolCall, ToolSettings,
                              parse_tool_calls, tool, truncate)
from miles.errors import ConfigError, ToolError


def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


async def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def sleepy(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "slept"


async def hang(text: str) -> str:
    """Never answers."""
    await asyncio.Event().wait()
    return text


def broken(text: str) -> str:
    """Always fails."""
    raise KeyError(text)


def refuse(text: str) -> str:
    """Fails cleanly."""
    raise ToolError(f"cannot do {text}")


def long_text(n: int) -> str:
    """n characters."""
    return "y" * n


# --- describing functions ---------------------------------------------------------------------

def test_a_function_becomes_a_described_tool():
    described = tool(add)
    assert (described.name, described.description, described.is_async) == \
        ("add", "Add two integers.", False)
    assert described.schema() == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "required": ["a"]}}}
    assert tool(shout).is_async
    assert tool(name="loud", description="Shouts.")(shout).name == "loud"


def test_signatures_a_model_cannot_call_are_refused():
    def variadic(*args):
        return args

    with pytest.raises(ConfigError, match="parameter 'args' must be passable by keyword"):
        tool(variadic)
    with pytest.raises(ConfigError, match="text style passes one argument, it takes 2"):
        ToolBox([add], style="text")
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        ToolBox([add, add])


# --- parsing ----------------------------------------------------------------------------------

def test_json_style_parses_several_calls_in_order():
    text = ('Let me compute. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
            '</tool_call> and <tool_call>\n{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}'
            '\n</tool_call>')
    assert parse_tool_calls(text, "json") == [ToolCall("add", {"a": 1, "b": 2}),
                                              ToolCall("shout", {"text": "hi"})]
    assert parse_tool_calls("no calls here", "json") == []


@pytest.mark.parametrize("body, error", [
    ("{not json}", "malformed tool call: not JSON (Expecting property name"),
    ('{"arguments": {}}', 'malformed tool call: expected {"name": ..., "arguments": {...}}'),
    ('["add"]', "malformed tool call: expected"),
    ('{"name": "add", "arguments": [1, 2]}', "malformed tool call: arguments must be an object"),
    ('{"name": "add", "arguments": "not json"}', "malformed tool call: arguments must be"),
])
def test_malformed_json_calls_are_kept_with_their_error(body, error):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", "json")
    assert call.error is not None and call.error.startswith(error)


def test_an_unclosed_call_is_a_malformed_call():
    calls = parse_tool_calls('<tool_call>{"name": "add"}</tool_call><tool_call>{"name"', "json")
    assert calls[0] == ToolCall("add", {})
    assert calls[1].error == "unclosed <tool_call> (no </tool_call>)"
    assert parse_tool_calls("<tool>calculator: 1+", "text")[0].error == \
        "unclosed <tool> (no </tool>)"


def test_text_style_passes_everything_after_the_first_colon():
    calls = parse_tool_calls("<tool>calculator:  (1+2) * 3 </tool> then "
                             "<tool>shout: a: b</tool>", "text")
    assert calls == [ToolCall("calculator", argument="(1+2) * 3"),
                     ToolCall("shout", argument="a: b")]


@pytest.mark.parametrize("text", ["<tool>calculator 1+2</tool>", "<tool>: 1+2</tool>",
                                  "<tool>two words: x</tool>"])
def test_malformed_text_calls(text):
    (call,) = parse_tool_calls(text, "text")
    assert call.error == "malformed tool call: expected <tool>NAME: ARGUMENT</tool>"


def test_unknown_style_is_a_config_error():
    with pytest.raises(ConfigError, match="tool style must be one of"):
        parse_tool_calls("", "xml")


# --- running ----------------------------------------------------------------------------------

async def run(box: ToolBox, text: str):
    return await box.run(box.parse(text))


async def test_calls_run_in_order_and_render_as_tool_responses():
    box = ToolBox([add, shout])
    turn = await run(box, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                          '<tool_call>{"name": "shout", "arguments": {"text": "ok"}}</tool_call>')
    assert (turn.calls, turn.errors) == (2, 0)
    assert box.render(turn) == ("<tool_response>\n5\n</tool_response>\n"
                                "<tool_response>\nOK\n</tool_response>")


async def test_text_style_renders_results():
    box = ToolBox([shout], style="text")
    turn = await run(box, "<tool>shout: hello there</tool>")
    assert box.render(turn) == "<result>HELLO THERE</result>"


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
     "error: unknown tool 'mul' (tools: add, broken, refuse)"),
    ('<tool_call>{"name": "add", "arguments": {"b": 1}}</tool_call>',
     "error: add is missing argument 'a'"),
    ('<tool_call>{"name": "add", "arguments": {"a": "1"}}</tool_call>',
     "error: add argument 'a' must be a integer, got '1'"),
    ('<tool_call>{"name": "add", "arguments": {"a": true}}</tool_call>',
     "error: add argument 'a' must be a integer, got True"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "c": 2}}</tool_call>',
     "error: add got unexpected argument(s) ['c']; it takes ['a', 'b']"),
    ('<tool_call>{"name": "broken", "arguments": {"text": "k"}}</tool_call>',
     "error: broken raised KeyError: 'k'"),
    ('<tool_call>{"name": "refuse", "arguments": {"text": "that"}}</tool_call>',
     "error: cannot do that"),
    ("<tool_call>{oops}</tool_call>",
     "error: malformed tool call: not JSON (Expecting property name enclosed in double quotes "
     "at char 1)"),
])
async def test_every_failure_is_an_error_result_never_an_exception(text, expected):
    box = ToolBox([add, broken, refuse])
    turn = await run(box, text)
    assert (turn.errors, turn.results[0].content) == (1, expected)


async def test_a_slow_sync_tool_times_out_and_is_abandoned():
    box = ToolBox([sleepy], settings=ToolSettings(timeout_s=0.2))
    before = threading.active_count()
    started = time.monotonic()
    turn = await run(box, '<tool_call>{"name": "sleepy", "arguments": {"seconds": 3}}</tool_call>')
    assert time.monotonic() - started < 2
    assert turn.results[0].content == "error: sleepy timed out after 0.2 s" and turn.errors == 1
    assert threading.active_count() == before + 1  # the abandoned daemon thread, still asleep


async def test_a_hanging_async_tool_times_out():
    box = ToolBox([hang], style="text", settings=ToolSettings(timeout_s=0.1))
    turn = await run(box, "<tool>hang: x</tool>")
    assert box.render(turn) == "<result>error: hang timed out after 0.1 s</result>"


async def test_results_are_truncated_with_a_visible_marker():
    box = ToolBox([long_text], settings=ToolSettings(max_result_chars=10))
    turn = await run(box, '<tool_call>{"name": "long_text", "arguments": {"n": 25}}</tool_call>')
    assert turn.results[0].content == "y" * 10 + "\n[truncated: 15 more characters]"
    short = await run(box, '<tool_call>{"name": "long_text", "arguments": {"n": 10}}</tool_call>')
    assert short.results[0].content == "y" * 10
    assert truncate("abc", 5) == "abc" and TRUNCATION_MARKER.format(omitted=1) in truncate("ab", 1)


async def test_calls_beyond_the_per_step_limit_are_not_run():
    box = ToolBox([add], settings=ToolSettings(max_calls_per_step=2))
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    turn = await run(box, call * 3)
    assert [r.content for r in turn.results] == \
        ["1", "1", "error: not run, at most 2 tool calls per step"]
    assert (turn.calls, turn.errors) == (3, 1)


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("timeout_s", float("nan")),
                                          ("max_result_chars", 0), ("max_calls_per_step", 0),
                                          ("max_tool_turns", 1.0)])
def test_settings_are_validated(field, value):
    with pytest.raises(ConfigError, match=f"tools.{field} must be"):
        ToolSettings(**{field: value})


# --- the calculator ---------------------------------------------------------------------------

@pytest.mark.parametrize("expression, result", [
    ("1 + 2", "3"), ("(12 + 3.5) * 4", "62"), ("2 ** 10 // 3", "341"), ("7 / 4", "1.75"),
    ("-7 / 4", "-1.75"), ("1 / 3", "1/3"), ("0.1 + 0.2", "0.3"), ("2 ** -2", "0.25"),
    ("10 % 3", "1"), ("-(3)", "-3"), ("+5", "5"), ("1e3", "1000"), ("1_000 * 2", "2000"),
    ("(1 / 3) ** 3", "1/27"), ("123456789 * 987654321", "121932631112635269"),
])
def test_calculator_is_exact(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression, error", [
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("2 ** 0.5", "only integer exponents"),
    ("2 ** 5000", "result too large"), ("2 ** 100000", "exponent 100000 is too large"),
    ("(2 ** 4000) * (2 ** 4000)", "result too large"), ("9 ** 9 ** 9", "too large"),
    ("2 ^ 3", "^ is not a power here, use **"), ("x + 1", "names are not supported"),
    ("abs(-1)", "function calls are not supported"), ("1 < 2", "Compare is not supported"),
    ("'a' * 3", "Constant is not supported"), ("True + 1", "Constant is not supported"),
    ("1 +", "not an arithmetic expression"),
    ("1+" * MAX_EXPRESSION_CHARS + "1", "expression too long"),
])
def test_calculator_refuses_clearly(expression, error):
    with pytest.raises(ToolError, match=error.replace("(", r"\(").replace("*", r"\*")
                       .replace("^", r"\^")):
        evaluate(expression)
