"""Tool and sandbox limits set from the daemons' settings (`tools.*`, `sandbox.*`, the keys
the validation messages name) reach the environments the producer builds: a tool timeout of
0.1 s times a sleeping tool out; the python environment's sandbox takes the limits."""

from __future__ import annotations

import pytest

from miles.config import load_config
from miles.envs import Action, SandboxLimits, Task, ToolSettings, load_environment
from miles.errors import ConfigError
from miles.run import RunConfig, environment
from miles.tasks.rewards import resolve_reward
from producers.rollout import ProducerSettings

SCORER = resolve_reward("exact_match")


async def napped(factory) -> dict:
    env = factory()
    await env.reset(Task("rest", "rested"))
    step = await env.step(Action("<tool>nap: 0.5</tool>"))
    return {"errors": step.info["tool_errors"], "observation": step.observation}


async def test_a_tool_timeout_from_the_settings_times_a_slow_tool_out():
    assert (await napped(load_environment("tests.envs:Napper", reward=SCORER)))["errors"] == 0
    quick = ToolSettings(timeout_s=0.1)
    out = await napped(load_environment("tests.envs:Napper", reward=SCORER, tools=quick))
    assert out["errors"] == 1 and "0.1" in out["observation"], out


async def test_the_producer_and_run_settings_carry_tools_and_sandbox():
    overrides = ["env=tests.envs:Napper", "tools.timeout_s=0.1", "sandbox.cpu_s=2"]
    producer = load_config(ProducerSettings, env={}, overrides=overrides)
    assert producer.tools.timeout_s == 0.1 and producer.sandbox.cpu_s == 2
    run = load_config(RunConfig, env={}, overrides=overrides)
    assert (await napped(environment(run, SCORER)))["errors"] == 1
    with pytest.raises(ConfigError, match="tools.timeout_s must be > 0"):
        load_config(ProducerSettings, env={}, overrides=["tools.timeout_s=0"])


def test_the_python_environment_takes_the_sandbox_limits():
    limits = SandboxLimits(cpu_s=2, memory_mb=256)
    env = load_environment("python", reward=SCORER, sandbox=limits)()
    assert env.sandbox.limits == limits
    assert load_environment("python", reward=SCORER)().sandbox.limits == SandboxLimits()


async def test_the_evaluator_daemon_carries_tools_and_sandbox(tmp_path):
    """`miles run` with fan-out writes the evaluator's settings file; the environment of its
    held-out episodes takes the run's tool and sandbox limits from it."""
    from consumers.evaluator import EvaluatorSettings, episode_eval
    from miles.config import write_settings
    from miles.run_daemons import daemon_settings

    run = load_config(RunConfig, env={}, overrides=[
        "env=tests.envs:Napper", "tools.timeout_s=0.1", "sandbox.cpu_s=2"])
    written = write_settings(daemon_settings(run, tmp_path)["evaluator"], tmp_path / "ev.yaml")
    settings = load_config(EvaluatorSettings, path=written, env={})
    assert settings.tools.timeout_s == 0.1 and settings.sandbox.cpu_s == 2
    assert (await napped(episode_eval(settings, SCORER).factory))["errors"] == 1
    assert episode_eval(EvaluatorSettings(), SCORER) is None  # single-turn: no environment
