"""Environments for tests, importable as `tests.envs:NAME` (like `tests.rewards`)."""

from miles.envs import Action, Environment, Step, Task, ToolEnvironment

NOT_A_CLASS = 42


class Echo(Environment):
    """Two turns: echoes the first action back, ends on the second with reward 1.0."""

    def __init__(self):
        self.turns = 0

    async def reset(self, task: Task):
        return None

    async def step(self, action: Action) -> Step:
        self.turns += 1
        if self.turns == 1:
            return Step(f"you said {action.text}")
        return Step(None, 1.0, done=True)


class NeedsConfig(Environment):
    """Cannot be built by the loader: a required argument it does not know about."""

    def __init__(self, path: str):
        self.path = path

    async def reset(self, task):
        return None

    async def step(self, action):
        return Step(None, 0.0, done=True)


class Unfinished(Environment):
    """Abstract: no `step`."""

    async def reset(self, task):
        return None


class NotAnEnvironment:
    pass


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Adder(ToolEnvironment):
    tools = (add,)
