"""The model a run starts from when it names none: the built-in tiny model after a supervised
warm start on the task (`miles sft`), cached under ~/.cache/miles/demo by what it was built from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from miles.sft import supervised_warm_start, teacher_forced_probe
from miles.tasks.arithmetic import Problem
from miles.tasks.datasets import BUILT_IN, load_problems
from miles.tasks.multiplication import warm_start_problems
from miles.tasks.tiny_model import build_tiny_model

if TYPE_CHECKING:
    from miles.run import RunConfig

log = logging.getLogger(__name__)
CACHE = Path.home() / ".cache" / "miles" / "demo"
WARM_STARTS: dict[tuple[str, str], Callable[[list[Problem]], list[Problem]]] = {
    ("multiplication", "calculator"): warm_start_problems,
}
"""(task, env) -> the supervised pairs that teach the environment's format to the task's
training problems; any other pair is warmed up on the problems' answers (single-turn)."""
PROBE_PROBLEMS = 200  # training problems held back from the SFT to measure its success
CHAT_TASKS = ("multiplication",)  # tasks whose episodes need the tag characters (chat tokenizer)


def warm_start(config: RunConfig, should_stop: Callable[[], bool] = lambda: False) -> Path:
    """The model RL starts from: the user's, or the cached tiny model after `miles sft` on the
    task's warm-start pairs (`WARM_STARTS`), cached by the SFT settings, task and format. With
    `sft.stop_at_success` the first `PROBE_PROBLEMS` training problems are held back from the
    SFT and probed (`teacher_forced_probe`: every pair of a problem reproduced) until that
    share of them succeeds. Blocking; StoppedError once `should_stop()`."""
    if config.model_dir is not None:
        return Path(config.model_dir)
    task = config.prompts if config.prompts in BUILT_IN else "arithmetic"
    pairs = WARM_STARTS.get((task, config.env))
    chat = task in CHAT_TASKS or bool(config.env)  # an environment's tags need '<', '>', '_'
    keyed = {**asdict(config.sft), "task": task}
    if pairs is not None or chat:  # the arithmetic demos keep their cache key
        keyed |= {"env": config.env if pairs is not None else "", "chat": chat}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    sft_dir = CACHE / f"sft-{key}"
    if (sft_dir / "config.json").exists():
        return sft_dir
    base = build_tiny_model(CACHE / ("base-chat" if chat else "base"), chat=chat)
    log.info("building the supervised warm start in %s", sft_dir)
    examples = pairs or (lambda problems: problems)
    problems = load_problems(task, "train")
    probe = None
    if config.sft.stop_at_success > 0:
        probe = teacher_forced_probe([examples([p]) for p in problems[:PROBE_PROBLEMS]])
        problems = problems[PROBE_PROBLEMS:]
    staging = sft_dir.with_name(sft_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    supervised_warm_start(base, staging, examples(problems), config.sft, probe=probe,
                          should_stop=should_stop)
    staging.rename(sft_dir)
    return sft_dir
