"""Built-in tool environments and the `python` tool.

- `calculator` (`CalculatorEnv`): the `calculator` tool in the compact text style
  (`<tool>calculator: 12*34</tool>`), made for tiny models;
- `python` (`PythonEnv`): the `python` tool in the JSON `<tool_call>` style of Qwen/Hermes chat
  templates, running code in a `PythonSandbox` shared by all episodes of the process (each run
  is its own child process, so sharing it shares nothing but the settings).
"""

from __future__ import annotations

import functools

from miles.envs.calculator import calculator
from miles.envs.sandbox import PythonSandbox, SandboxLimits, SandboxResult
from miles.envs.tool_env import ToolEnvironment
from miles.envs.tools import Tool, ToolSettings, tool
from miles.errors import ToolError
from miles.tasks.rewards import Scorer

NO_OUTPUT = "(no output)"
FAILURES = {"error": "the code raised an error", "memory_limit": "out of memory",
            "cpu_limit": "CPU time limit exceeded", "wall_timeout": "time limit exceeded",
            "output_limit": "output limit exceeded, output truncated",
            "setup_failed": "the sandbox could not start"}


def python_tool(sandbox: PythonSandbox) -> Tool:
    """A `python(code)` tool running `code` in `sandbox`; a failed run is a ToolError whose
    text says why and carries what the code printed."""

    async def python(code: str) -> str:
        """Run Python code in a sandbox (no network, no files outside its own directory,
        limited time and memory) and return what it printed."""
        return sandbox_output(await sandbox.run(code))

    return tool(python)


def sandbox_output(result: SandboxResult) -> str:
    """stdout, then stderr if any; ToolError with the same text after the failure's reason."""
    output = "\n".join(part.rstrip("\n") for part in (result.stdout, result.stderr) if part)
    if result.ok:
        return output or NO_OUTPUT
    why = FAILURES.get(result.reason, result.reason)
    raise ToolError(f"{why} (exit code {result.exit_code})" + (f"\n{output}" if output else ""))


@functools.cache
def shared_sandbox(limits: SandboxLimits = SandboxLimits()) -> PythonSandbox:
    """The process's sandbox with `limits` for `PythonEnv` (built on first use: it probes the
    machine)."""
    return PythonSandbox(limits)


class CalculatorEnv(ToolEnvironment):
    """Arithmetic with a calculator: `<tool>calculator: EXPRESSION</tool>`, then the answer."""

    tool_style = "text"
    tools = (tool(calculator),)


class PythonEnv(ToolEnvironment):
    """Code execution: `<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`."""

    tool_style = "json"

    def __init__(self, *, reward: Scorer, settings: ToolSettings | None = None,
                 sandbox: PythonSandbox | None = None):
        self.sandbox = sandbox or shared_sandbox()
        super().__init__([python_tool(self.sandbox)], reward=reward, settings=settings)
