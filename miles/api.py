"""`miles.train(...)`: a whole run from Python (a notebook, a script), the same run as
`miles run CONFIG` (`miles.run.main_run`), with a progress bar.

    import miles
    result = miles.train(model="path/to/checkpoint", dataset=my_dataset, reward=my_reward,
                         algo="grpo", max_steps=200, learner={"lr": 1e-5})
    result.metrics["final_accuracy"], result.out_dir, result.policy_dir

`dataset` is a built-in task name, a file or saved-dataset folder (as `prompts`), a
`datasets.Dataset`, or a list of dicts; rows need the fields `dataset_format` names (the
`dataset` section of the config: default `prompt`, `answer`, optional `id`). An in-memory dataset is written to `out_dir/dataset.jsonl`.
`reward` is a spec (`exact_match`, `math`, `module:function`, ...) or a callable
`fn(response, reference) -> float`; a callable that is not importable by name (a lambda, a
function defined in a notebook) works on the embedded bus only, since Kafka's producers are
other processes. Any other setting of `RunConfig` is a keyword: nested sections as dicts
(`sampling={"n": 4}`) or dotted names in `settings` (`{"sampling.n": 4}`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.errors import ConfigError


@dataclass(frozen=True)
class RunResult:
    metrics: dict  # the run's report (report.json): accuracies, steps, what ended it, curve
    out_dir: Path  # checkpoints, weights, metrics.jsonl, ledger.jsonl, report.json
    policy_dir: Path | None  # the final policy as a Hugging Face checkpoint (export_policy)


def train(model: str | Path | None = None, dataset: Any = "arithmetic",
          reward: str | Callable = "exact_match", algo: str = "grpo", *,
          out_dir: str | Path = "runs/train", resume: bool = False, progress: bool = True,
          dataset_format: Mapping[str, Any] | None = None,
          settings: Mapping[str, Any] | None = None, **options: Any) -> RunResult:
    """Train `model` (None: the built-in tiny model and its warm start) on `dataset` with
    `reward` under preset `algo`; blocks until a bound (`max_steps`, `epochs`, `max_seconds`)
    is met; the result. `resume=True` carries on the run in `out_dir`."""
    from miles.config import load_with_preset
    from miles.rl.algorithm import preset_layers
    from miles.run import RunConfig, main_run

    out = Path(out_dir)
    values = {"out_dir": out, "prompts": prompts_source(dataset, out),
              "dataset": dict(dataset_format or {}), **options}
    if model is not None:
        values["model_dir"] = Path(model)
    values["reward"] = reward_spec(reward, bus=str(values.get("bus", "")))
    overrides = [*flatten(values), *flatten(settings or {})]
    config = load_with_preset(RunConfig, preset_layers(), "learner.algorithm", algo=algo,
                              overrides=overrides)
    report = main_run(config, resume=resume, progress=progress)
    policy = report.get("policy_dir")
    return RunResult(metrics=report, out_dir=out, policy_dir=Path(policy) if policy else None)


def flatten(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Settings as `--set` overrides: nested dicts become dotted keys, non-strings JSON."""
    overrides = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            overrides += flatten(value, f"{dotted}.")
        elif isinstance(value, (str, Path)):
            overrides.append(f"{dotted}={value}")
        else:
            overrides.append(f"{dotted}={json.dumps(value)}")
    return overrides


def prompts_source(dataset: Any, out_dir: Path) -> str:
    """What `prompts` names for `dataset`: the name or path itself, or a JSONL file written
    from the rows of an in-memory dataset."""
    if isinstance(dataset, (str, Path)):
        return str(dataset)
    rows = dataset.to_list() if hasattr(dataset, "to_list") else dataset
    if not isinstance(rows, Iterable) or isinstance(rows, Mapping):
        raise ConfigError(f"dataset must be a name, a path, a datasets.Dataset or a list of "
                          f"dicts, got {type(dataset).__name__}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "dataset.jsonl"
    with open(path, "w") as f:
        for number, row in enumerate(rows, start=1):
            if not isinstance(row, Mapping):
                raise ConfigError(f"dataset row {number} is a {type(row).__name__}, not a dict")
            f.write(json.dumps(dict(row), default=str) + "\n")
    return str(path)


def reward_spec(reward: str | Callable, *, bus: str) -> str:
    """A reward callable by the name it is importable under, or else registered in this process
    (embedded bus only)."""
    if isinstance(reward, str):
        return reward
    if not callable(reward):
        raise ConfigError(f"reward must be a spec or a callable, got {type(reward).__name__}")
    name = importable_name(reward)
    if name is not None:
        return name
    if bus.startswith("kafka"):
        raise ConfigError(f"reward {reward!r} is not importable by name (a lambda or a function "
                          "defined in __main__ or a notebook), and Kafka's producers are other "
                          "processes: define it in a module and pass the function or "
                          "'module:function'")
    from miles.tasks.rewards import register_reward

    return register_reward(reward)


def importable_name(fn: Callable) -> str | None:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is fn else None
