"""`miles run`'s door: each setting that cannot work is one clear ConfigError naming it, raised
before any model is loaded."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles import run as run_module
from miles.bus import kafka_errors
from miles.config import load_with_preset
from miles.errors import ConfigError
from miles.rl.algorithm import preset_layers
from miles.run import RunConfig, check_door, main_run
from tests.runs import write_dataset


def config_of(tmp_path, model_dir, *overrides: str) -> RunConfig:
    dataset = write_dataset(tmp_path / "data.jsonl", 8)
    return load_with_preset(RunConfig, preset_layers(), "learner.algorithm", overrides=[
        f"model_dir={model_dir}", f"prompts={dataset}", f"out_dir={tmp_path / 'out'}",
        *overrides])


def door_error(config: RunConfig) -> str:
    with pytest.raises(ConfigError) as caught:
        asyncio.run(check_door(config))
    return str(caught.value)


def test_an_unknown_key_names_itself(tmp_path, model_dir):
    with pytest.raises(ConfigError, match="learner.lrr"):
        config_of(tmp_path, model_dir, "learner.lrr=1e-4")


def test_a_model_folder_that_does_not_load(tmp_path, model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert door_error(config_of(tmp_path, empty)).startswith("model_dir: ")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert door_error(config_of(tmp_path, broken)).startswith("model_dir: ")


def test_a_dataset_without_the_named_fields(tmp_path, model_dir):
    message = door_error(config_of(tmp_path, model_dir, "dataset.prompt_field=question"))
    assert message.startswith("prompts: ") and "'question'" in message
    assert "dataset.prompt_field" in message


def test_a_reward_that_cannot_be_imported(tmp_path, model_dir):
    message = door_error(config_of(tmp_path, model_dir, "reward=no_such_module:score"))
    assert "reward 'no_such_module:score'" in message


def test_a_bus_that_cannot_be_reached(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(kafka_errors, "START_TIMEOUT_S", 1.0)
    message = door_error(config_of(tmp_path, model_dir, "bus=kafka://127.0.0.1:9"))
    assert message.startswith("bus: kafka://127.0.0.1:9 cannot be reached")


def test_the_door_comes_before_any_model_loads(tmp_path, model_dir, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(run_module, "warm_start", no_model)
    monkeypatch.setattr(run_module, "build_engine", no_model)
    with pytest.raises(ConfigError, match="^reward"):
        main_run(config_of(tmp_path, model_dir, "reward=no_such_module:score"))


def test_an_environment_with_more_stop_strings_than_the_engine_takes(tmp_path, model_dir):
    five = config_of(tmp_path, model_dir, "env=tests.envs:FiveStops", "engine=vllm-server")
    message = door_error(five)
    assert "FiveStops" in message and "5 stop strings" in message and "vllm-server" in message
    asyncio.run(check_door(config_of(tmp_path, model_dir, "env=tests.envs:FiveStops")))  # hf: 16


def test_an_embedded_vllm_producer_gets_its_own_settings(tmp_path, model_dir, monkeypatch):
    """The vLLM engines of an embedded run are built from each producer's daemon settings."""
    built = []
    monkeypatch.setattr(run_module, "build_engine", built.append)
    config = config_of(tmp_path, model_dir, "engine=vllm-server", "producers=2",
                       "vllm_server.base_url=http://127.0.0.1:9")
    for index in range(2):
        run_module.embedded_engine(config, model_dir, index)
    assert [s.engine for s in built] == ["vllm-server"] * 2
    assert [s.rollout.producer_id for s in built] == ["producer-0", "producer-1"]
    assert built[0].vllm_server.base_url == "http://127.0.0.1:9"
