"""Config loading: file, environment and --set layers, type conversion, clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from miles.config import field_paths, load_config, nest
from miles.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Inner:
    lr: float = 1e-4
    targets: tuple[str, ...] = ("q", "v")

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")


@dataclass(frozen=True, kw_only=True)
class Root:
    bus: str | None = None
    steps: int = 10
    algo: Literal["grpo", "ppo"] = "grpo"
    verbose: bool = False
    inner: Inner = field(default_factory=Inner)
    lora: Inner | None = None


def test_defaults():
    assert load_config(Root, env={}) == Root()


def test_layers_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('steps = 5\nbus = "kafka://x:1"\n[inner]\nlr = 3\n')
    env = {"MILES_STEPS": "7", "MILES_INNER__TARGETS": "a,b,c", "MILES_KAFKA_LIBS": "/ignored"}
    config = load_config(Root, path=path, env=env, overrides=["inner.lr=0.5", "verbose=yes"])
    assert config.steps == 7
    assert config.bus == "kafka://x:1"
    assert config.inner == Inner(lr=0.5, targets=("a", "b", "c"))
    assert config.verbose is True


def test_yaml_and_optional_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo: ppo\nlora:\n  lr: 0.1\n")
    config = load_config(Root, path=path, env={})
    assert config.algo == "ppo" and config.lora == Inner(lr=0.1)
    assert load_config(Root, path=path, env={}, overrides=["lora=none"]).lora is None


@pytest.mark.parametrize("override, message", [
    ("stepz=1", "unknown config key stepz"),
    ("inner.lrr=1", "unknown config key inner.lrr"),
    ("steps=many", "steps must be int"),
    ("algo=sac", "algo must be one of"),
    ("inner.lr=-1", "inner.lr must be > 0"),
    ("verbose=maybe", "verbose must be bool"),
    ("noequals", "key=value"),
])
def test_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Root, env={}, overrides=[override])


def test_file_values_are_not_coerced_from_wrong_types(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('steps = "ten"\n')
    with pytest.raises(ConfigError, match="steps must be int"):
        load_config(Root, path=path, env={})


def test_field_paths_lists_nested_keys():
    assert {"steps", "inner.lr", "inner.targets", "lora.lr"} <= set(field_paths(Root))


def test_a_preset_is_the_lowest_layer_and_keeps_unnamed_defaults(tmp_path):
    from miles.rl.algorithm import AlgorithmConfig, preset
    from miles.trainer.learner import LearnerConfig

    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  loss:\n    clip_low: 0.1\n")
    config = load_config(LearnerConfig, path=path, env={},
                         overrides=["algorithm.loss.clip_high=0.3"],
                         base=nest("algorithm", preset("dapo")))
    a = config.algorithm
    assert a.name == "dapo" and a.dynamic_sampling and a.overlong_buffer == 2  # preset
    assert (a.loss.clip_low, a.loss.clip_high) == (0.1, 0.3)  # file, then --set
    assert a.loss.objective == AlgorithmConfig().loss.objective  # nobody named it
    assert config.lr == LearnerConfig().lr


def test_an_unknown_preset_names_the_choices():
    from miles.rl.algorithm import preset

    with pytest.raises(ConfigError, match="algo must be one of .*'ppo'"):
        preset("ppo2")


def test_a_nested_section_s_own_check_is_reported_at_its_config_path():
    from consumers.trainer import TrainerSettings

    with pytest.raises(ConfigError, match=r"^learner\.algorithm\.loss\.clip_low must be in"):
        load_config(TrainerSettings, env={}, overrides=["learner.algorithm.loss.clip_low=3"])


def test_an_unknown_algorithm_name_fails_naming_the_field_and_the_presets():
    from consumers.trainer import parse_args

    with pytest.raises(ConfigError, match=r"^learner\.algorithm\.name must be one of "
                                          r"\[.*'dapo'.*\] \(a preset\), got 'bogus'"):
        parse_args(["--set", "learner.algorithm.name=bogus"])


def test_the_algorithm_name_chooses_the_preset_like_algo(tmp_path):
    from consumers.trainer import parse_args

    by_flag = parse_args(["--algo", "dapo"]).learner.algorithm
    by_name = parse_args(["--set", "learner.algorithm.name=dapo"]).learner.algorithm
    assert by_name == by_flag and by_name.dynamic_sampling and by_name.overlong_buffer == 2
    path = tmp_path / "c.toml"  # fields valid only over the preset: baseline is reinforce_pp's
    path.write_text('[learner.algorithm]\nname = "reinforce_pp"\n'
                    '[learner.algorithm.advantage]\nbaseline = true\n')
    assert parse_args(["--config", str(path)]).learner.algorithm.estimator == "reinforce_pp"
    assert parse_args([]).learner.algorithm.name == "grpo"
    with pytest.raises(ConfigError, match="--algo dapo and learner.algorithm.name='ppo' disagree"):
        parse_args(["--algo", "dapo", "--set", "learner.algorithm.name=ppo"])
