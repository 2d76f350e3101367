"""Every example config in examples/ runs as written, for two steps: the file is read as
`miles run` reads it, with only the model, the output folder, the run's size, the held-out
set and the reward overridden. The reward is one the untrained test model sometimes earns (a response starting
with a digit), so a preset that drops groups of equal rewards (DAPO) still gets its steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import load_with_preset
from miles.rl.algorithm import PRESETS, preset_layers
from miles.run import RunConfig, main_run
from tests.runs import write_dataset

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))


def test_there_is_an_example_for_each_preset():
    named = {load_with_preset(RunConfig, preset_layers(), "learner.algorithm",
                              path=path).learner.algorithm.name for path in EXAMPLES}
    assert named == set(PRESETS)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_runs_two_steps(example, model_dir, tmp_path):
    held_out = write_dataset(tmp_path / "held_out.jsonl", 8)  # the run's speed is not the point
    config = load_with_preset(RunConfig, preset_layers(), "learner.algorithm", path=example,
                              overrides=[f"model_dir={model_dir}", f"out_dir={tmp_path}",
                                         "max_steps=2", "max_seconds=0", "groups_per_step=2",
                                         "sampling.n=4", "eval_problems=4", "lora.r=4",
                                         "lora.alpha=8", f"eval_prompts={held_out}",
                                         "reward=format:[0-9].*"])
    report = main_run(config)
    assert (report["ended_by"], report["steps"]) == ("max_steps", 2)
    assert report["algo"] == config.learner.algorithm.name
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
