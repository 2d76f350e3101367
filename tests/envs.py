"""Environments for tests, importable as `tests.envs:NAME` (like `tests.rewards`)."""

import time

from miles.envs import Action, Environment, Step, Task, ToolEnvironment, score_final

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


class Counter(Environment):
    """`turns` turns (3, or the task's metadata["turns"]): after turn k (1-based) the
    observation is `n=k.` with step reward 0.25, and the last turn ends with reward 1.0.
    Records what it saw in `seen` (class-wide, for tests)."""

    seen: list = []
    closed = 0

    async def reset(self, task: Task):
        self.task, self.k = task, 0
        self.turns = int(task.metadata.get("turns", 3))
        return None

    async def step(self, action: Action) -> Step:
        self.k += 1
        Counter.seen.append((self.task.metadata.get("name"), self.k, action))
        if self.k >= self.turns:
            return Step(None, 1.0, done=True, info={"tool_calls": self.k - 1})
        return Step(f"n={self.k}.", 0.25, info={"tool_calls": 1, "tool_errors": self.k % 2})

    async def close(self) -> None:
        Counter.closed += 1


class Gated(Counter):
    """A Counter whose steps wait for `GATE` (set by the test) when the task's metadata says
    `slow`, sleep `delay` seconds when it gives one, and raise on turn `fail_at`."""

    gate = None  # an asyncio.Event the test creates
    own_thread = False  # the gate is the test loop's: this environment runs on that loop

    async def step(self, action: Action) -> Step:
        meta = self.task.metadata
        if meta.get("slow"):
            await Gated.gate.wait()
        if meta.get("delay"):
            import asyncio
            await asyncio.sleep(float(meta["delay"]))
        if int(meta.get("fail_at", 0)) == self.k + 1:
            raise RuntimeError("the simulator crashed")
        return await super().step(action)


LECTURE = " The quick brown fox jumps over the lazy dog, twice."


class Lecture(Environment):
    """Observation tokens that would dominate the gradient if trained: a first turn whose first
    token id is even gets `LECTURE` (about 50 tokens against two turns of a few) and, after a
    second turn, reward 1.0; any other first turn ends the episode with 0.0. Every episode
    holding the lecture is rewarded above its group's mean, so training its tokens would push
    their logprobs up."""

    async def reset(self, task: Task):
        self.k = 0
        return None

    async def step(self, action: Action) -> Step:
        self.k += 1
        if self.k == 1 and action.token_ids and action.token_ids[0] % 2 == 0:
            return Step(LECTURE)
        return Step(None, 1.0 if self.k == 2 else 0.0, done=True)


class StopCounter(Counter):
    """A Counter whose turns also end on one of four characters (stop strings; a vLLM server
    takes at most four): a random tiny model writes one within a few turns, so turns end
    "stop_string" on any engine."""

    stop_strings = ("1", "2", "+", "=")


class FiveStops(Counter):
    """A Counter with five stop strings: one more than a vLLM server takes."""

    stop_strings = ("1", "2", "+", "=", "3")


class Sleepy(Counter):
    """A Counter whose step blocks its thread (`time.sleep`, as a careless simulator or a
    blocking client would) for the task's metadata["sleep"] seconds."""

    async def step(self, action: Action) -> Step:
        import time
        time.sleep(float(self.task.metadata.get("sleep", 0)))
        return await super().step(action)


class ChatCounter(Counter):
    """A Counter whose observations are `tool` messages (rendered by the chat template)."""

    async def step(self, action: Action) -> Step:
        step = await super().step(action)
        if step.done:
            return step
        return Step(({"role": "tool", "content": step.observation},), step.reward,
                    info=step.info)


class Greeter(Counter):
    """A Counter that starts with its own first observation (text) instead of the prompt."""

    async def reset(self, task: Task):
        await super().reset(task)
        return "Hi. " + task.prompt_text


class SecondTry(Environment):
    """Two turns whatever the model says: the first is answered " again:", the second is the
    final answer, scored by the run's reward (multi-turn plumbing with any model)."""

    def __init__(self, *, reward):
        self.reward = reward

    async def reset(self, task: Task):
        self.task, self.k = task, 0
        return None

    async def step(self, action: Action) -> Step:
        self.k += 1
        if self.k == 1:
            return Step(" again:")
        return await score_final(self.reward, action.text, self.task)


def nap(seconds: str) -> str:
    """Sleep, then say so (a slow tool)."""
    time.sleep(float(seconds))
    return "rested"


class Napper(ToolEnvironment):
    """One slow tool in the text style: `<tool>nap: SECONDS</tool>`."""

    tool_style = "text"
    tools = (nap,)
