"""Held-out evaluation through an environment: each problem is one greedy episode played by the
producer's runner, solved when its return is positive (scripted engine on the chat tokenizer,
so the policy says exactly what the test needs)."""

from __future__ import annotations

import pytest

from miles.envs import Environment, Step, load_environment
from miles.episodes import EpisodeSettings
from miles.evaluation import EpisodeEval, greedy_accuracy
from miles.tasks.multiplication import multiplication_problems
from miles.tasks.rewards import resolve_reward
from miles.tasks.tiny_model import build_char_tokenizer
from tests.scripted import ScriptedEngine

PROBLEMS = multiplication_problems("test")[:8]


def uses_the_tool(prompt: str) -> bool:
    return int(prompt.split("*")[0]) % 2 == 0


def reply(text: str) -> str:
    """Copies a calculator result; calls the calculator on even first operands, else guesses
    (and says "ok" to an Echo)."""
    if "you said" in text:
        return "ok"
    if "<result>" in text:
        return text.rsplit("<result>", 1)[1].split("</result>")[0]
    a, b = text.removesuffix("=").split("*")
    return (f"<tool>calculator: {a}*{b}</tool>" if uses_the_tool(text)
            else str(int(a) * int(b) + 1))


@pytest.fixture
def engine(tmp_path):
    build_char_tokenizer(chat=True).save_pretrained(tmp_path)
    engine = ScriptedEngine(tmp_path, reply)
    engine.params = []
    generate = engine.generate

    def recording(prompts, params, **kwargs):
        engine.params.append(params)
        return generate(prompts, params, **kwargs)

    engine.generate = recording
    return engine


async def test_success_is_the_greedy_episodes_return(engine):
    scorer = resolve_reward("exact_match")
    episodes = EpisodeEval(factory=load_environment("calculator", reward=scorer),
                           settings=EpisodeSettings(), turn_tokens=40)
    expected = sum(uses_the_tool(p.prompt) for p in PROBLEMS) / len(PROBLEMS)
    assert 0 < expected < 1
    assert await greedy_accuracy(engine, PROBLEMS, scorer=scorer, episodes=episodes) == expected
    # greedy (the argmax token), the run's per-turn budget, both turns of every episode batched
    assert [(p.n, p.top_k, p.max_new_tokens) for p in engine.params] == [(1, 1, 40)] * 2
    assert engine.calls[0][1] == ("</tool>",) and len(engine.calls[0][0]) == len(PROBLEMS)
    # the knob: scored single-turn, the same policy's first turns (calls, guesses) solve nothing
    assert await greedy_accuracy(engine, PROBLEMS, scorer=scorer) == 0.0


class Crashes(Environment):
    """Rewards every answer, then fails when it is closed: the episode failed."""

    async def reset(self, task):
        return None

    async def step(self, action):
        return Step(None, 1.0, done=True)

    async def close(self):
        raise RuntimeError("the simulator crashed")


async def test_a_failed_episode_is_not_solved(engine):
    settings = EpisodeSettings()
    assert await greedy_accuracy(engine, PROBLEMS, episodes=EpisodeEval(
        factory=Crashes, settings=settings)) == 0.0
    assert await greedy_accuracy(engine, PROBLEMS, episodes=EpisodeEval(
        factory=load_environment("tests.envs:Echo"), settings=settings)) == 1.0
