"""Prompt sources: the built-in arithmetic task or a user's JSONL file of prompts and answers.

A JSONL line is an object with the prompt and the reference answer under configurable keys
(`prompt` and `answer` by default) and an optional id (`id`); lines without an id get
`<file stem>-<line number>`. Bad lines are errors naming the line: a dataset is checked once, up
front, rather than failing mid-run.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.errors import ConfigError
from miles.tasks.arithmetic import Problem, arithmetic_problems

BUILT_IN = {"arithmetic": True, "arithmetic-plain": False}
"""Built-in task names -> whether the answer is written least-significant digit first."""


def read_jsonl(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
               id_key: str = "id") -> list[Problem]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompt file {path} does not exist")
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number}: not JSON ({err.msg})") from err
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            raise ConfigError(f"{path}:{number}: needs a string {prompt_key!r}")
        answer = row.get(answer_key)
        if answer is None or isinstance(answer, (dict, list)):
            raise ConfigError(f"{path}:{number}: needs a scalar {answer_key!r}")
        task_id = str(row.get(id_key, f"{path.stem}-{number}"))
        problems.append(Problem(task_id=task_id, prompt=row[prompt_key], answer=str(answer)))
    if not problems:
        raise ConfigError(f"prompt file {path} holds no prompts")
    return problems


def load_problems(source: str, split: str = "train") -> list[Problem]:
    """`arithmetic` (the built-in task, reversed answers), `arithmetic-plain` (conventional
    digit order) or a path to a JSONL file (used for every split)."""
    if source in BUILT_IN:
        return arithmetic_problems(split, reverse=BUILT_IN[source])
    return read_jsonl(source)
