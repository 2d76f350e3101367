"""The producer's env and episodes settings: read from config overrides, validated naming the
field; a bad env spec fails at start-up, before the bus is opened."""

from __future__ import annotations

import asyncio

import pytest

from miles.config import load_config
from miles.episodes import EpisodeSettings
from miles.errors import ConfigError
from producers.rollout import ProducerSettings, run_producer


def test_env_and_episode_limits_come_from_the_config():
    settings = load_config(ProducerSettings, overrides=[
        "env=calculator", "episodes.max_turns=3", "episodes.env_step_timeout_s=2.5"], env={})
    assert settings.env == "calculator"
    assert settings.episodes == EpisodeSettings(max_turns=3, env_step_timeout_s=2.5)
    assert load_config(ProducerSettings, overrides=[], env={}).env == ""  # single-turn default


@pytest.mark.parametrize("bad", ["max_turns=0", "max_total_tokens=0",
                                 "max_observation_tokens=0", "env_step_timeout_s=0",
                                 "max_concurrent=-1"])
def test_episode_settings_validate(bad):
    with pytest.raises(ConfigError, match=f"episodes.{bad.split('=')[0]}"):
        load_config(ProducerSettings, overrides=[f"episodes.{bad}"], env={})


@pytest.mark.parametrize("engine", ["hf", "vllm", "vllm-server"])
def test_streamed_turns_run_on_every_engine(engine):
    settings = load_config(ProducerSettings, overrides=[f"engine={engine}",
                                                        "episodes.stream_turns=true"], env={})
    assert settings.episodes.stream_turns


def test_streamed_turns_need_an_engine_that_streams():
    with pytest.raises(ConfigError, match="stream_turns needs one of the engines.*'other'"):
        EpisodeSettings(stream_turns=True).check_engine("other")


def test_a_bad_env_fails_before_the_bus(tmp_path, monkeypatch):
    import producers.rollout as daemon

    monkeypatch.setattr(daemon, "build_engine", lambda settings: object())
    settings = ProducerSettings(bus="kafka://127.0.0.1:1", env="tests.envs:NotAnEnvironment",
                                model_dir=tmp_path)
    with pytest.raises(ConfigError, match="not an Environment subclass"):
        asyncio.run(run_producer(settings, asyncio.Event()))
