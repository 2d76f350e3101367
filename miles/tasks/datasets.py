"""Prompt sources: a built-in task, or a dataset of prompts and reference answers.

A source (`load_problems`) is a built-in task name (`arithmetic`, `arithmetic-plain`,
`multiplication`: two-digit products, the calculator environment's task), a
`.parquet` file, a directory written by Hugging Face `datasets`' `save_to_disk` (a `Dataset`, or
a `DatasetDict` whose split is chosen by `split`), or any other file, read as JSONL. A file or a
single `Dataset` serves every split; built-in tasks and `DatasetDict`s have their own.

`DatasetFormat` maps a row to a `Problem`: the prompt is a field as is, or a `str.format`
template over the row's fields (`"Question: {question}\\nAnswer:"`), or, in a row without that
field, a conversation (`messages_field`: a list of `{"role", "content"}`, checked by
`miles.tasks.messages`; the producer renders it with the chat template, the `Problem`'s prompt
text is its contents joined by newlines); the reference answer (any
string or number) and the id come from named fields. A row without an id gets
`<source name>-<row number>` (1-based, the line number in JSONL; a `DatasetDict` split adds the
split's name), stable across runs.

Choices:
- A dataset is checked whole, up front: the first bad row is an error naming the row and the
  field, rather than a silently dropped row or a failure mid-run.
- Parquet files and saved datasets are read with pyarrow (the `export` extra), imported only for
  them. A saved dataset is read directly as the Arrow stream files its `state.json` lists, so
  feeding needs neither the `datasets` package nor its dependencies; the tests hold this to the
  layout real `save_to_disk` calls write.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from miles.errors import ConfigError
from miles.tasks.arithmetic import Problem, arithmetic_problems
from miles.tasks.messages import Conversation, check_messages, messages_text
from miles.tasks.multiplication import multiplication_problems

BUILT_IN: dict[str, Callable[[str], list[Problem]]] = {
    "arithmetic": lambda split: arithmetic_problems(split, reverse=True),
    "arithmetic-plain": lambda split: arithmetic_problems(split, reverse=False),
    "multiplication": multiplication_problems,
}
"""Built-in task names -> their split's problems (arithmetic: answers least-significant digit
first; arithmetic-plain: in the usual order; multiplication: `a*b=` with two-digit operands)."""


@dataclass(frozen=True, kw_only=True)
class DatasetFormat:
    prompt_field: str = "prompt"  # the field holding the prompt, used as is (no template)
    messages_field: str = "messages"  # a row without prompt_field: its conversation (chat)
    prompt_template: str | None = None  # str.format over the row, e.g. "Q: {question}\nA:"
    answer_field: str = "answer"  # the field holding the reference answer (string or number)
    id_field: str = "id"  # the field holding the task id; absent: <source>-<row number>

    def __post_init__(self) -> None:
        for name in ("prompt_field", "messages_field", "answer_field", "id_field"):
            if not getattr(self, name):
                raise ConfigError(f"{name} must not be empty")
        if self.prompt_template is not None:
            template_fields(self.prompt_template)

    @cached_property
    def required(self) -> list[str]:
        """The fields every row must have (the id is optional; without a template, the prompt
        or the messages field, `prompt_fields`); worked out once."""
        prompt = [] if self.prompt_template is None else template_fields(self.prompt_template)
        return list(dict.fromkeys([*prompt, self.answer_field]))

    @property
    def prompt_fields(self) -> list[str]:
        """Without a template: the fields of which a row needs one (the prompt wins)."""
        return [] if self.prompt_template is not None else [self.prompt_field,
                                                            self.messages_field]


def template_fields(template: str) -> list[str]:
    """The row fields a prompt template names (`{meta[q]}` names `meta`)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ConfigError(f"prompt_template is not a str.format template: {err}") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ConfigError(f"prompt_template fields must be named, got {{{name}}}")
        fields.append(root)
    if not fields:
        raise ConfigError(f"prompt_template {template!r} names no field: every prompt would be "
                          "the same (write literal braces as {{ and }})")
    return list(dict.fromkeys(fields))


def to_problem(row: Mapping, fmt: DatasetFormat, where: str, default_id: str) -> Problem:
    """One row as a `Problem`; `where` names the row in errors."""
    for name in fmt.required:
        if row.get(name) is None:
            raise ConfigError(f"{where}: field {name!r} is missing or null")
    prompt, messages = _prompt(row, fmt, where)
    answer = row[fmt.answer_field]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ConfigError(f"{where}: field {fmt.answer_field!r} must be a string or number, "
                          f"got {type(answer).__name__}")
    task_id = row.get(fmt.id_field)
    return Problem(task_id=default_id if task_id is None else str(task_id), prompt=prompt,
                   answer=str(answer), messages=messages)


def _prompt(row: Mapping, fmt: DatasetFormat, where: str) -> tuple[str, Conversation | None]:
    """A row's prompt text and, for a conversation, its messages."""
    if fmt.prompt_template is not None:
        try:
            return fmt.prompt_template.format_map(row), None
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as err:
            raise ConfigError(f"{where}: prompt_template failed: {type(err).__name__}: "
                              f"{err}") from None
    prompt = row.get(fmt.prompt_field)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: field {fmt.prompt_field!r} must be a string, "
                              f"got {type(prompt).__name__}")
        return prompt, None
    if row.get(fmt.messages_field) is None:
        raise ConfigError(f"{where}: field {fmt.prompt_field!r} is missing or null (or "
                          f"{fmt.messages_field!r} for a conversation)")
    try:
        messages = check_messages(row[fmt.messages_field])
    except ValueError as err:
        raise ConfigError(f"{where}: field {fmt.messages_field!r} {err}") from None
    return messages_text(messages), messages


def read_jsonl(path: str | Path, fmt: DatasetFormat = DatasetFormat()) -> list[Problem]:
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
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{number}: not a JSON object")
        problems.append(to_problem(row, fmt, f"{path}:{number}", f"{path.stem}-{number}"))
    return _nonempty(problems, path)


def read_parquet(path: str | Path, fmt: DatasetFormat = DatasetFormat()) -> list[Problem]:
    path = Path(path)
    pa, pq = _import_pyarrow()
    try:
        names = pq.ParquetFile(path).schema_arrow.names
        return _table_problems(names, lambda columns: pq.read_table(path, columns=columns),
                               fmt, str(path), path.stem)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"{path}: not a readable Parquet file ({err})") from None


def read_saved_dataset(path: str | Path, split: str = "train",
                       fmt: DatasetFormat = DatasetFormat()) -> list[Problem]:
    """A directory written by `Dataset.save_to_disk` (used whole) or `DatasetDict.save_to_disk`
    (its `split`)."""
    path = Path(path)
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = _read_json(splits_file).get("splits", [])
        if split not in splits:
            raise ConfigError(f"{path} has no split {split!r} (splits: {', '.join(splits)})")
        return _read_arrow_dir(path / split, fmt, f"{path.name}-{split}")
    return _read_arrow_dir(path, fmt, path.name)


def load_problems(source: str, split: str = "train", *,
                  fmt: DatasetFormat = DatasetFormat()) -> list[Problem]:
    """A built-in task (`BUILT_IN`), a `.parquet` file, a `save_to_disk` directory or a JSONL file, rows read by `fmt`."""
    if source in BUILT_IN:
        if fmt != DatasetFormat():
            raise ConfigError(f"{source!r} is a built-in task: field mapping and prompt "
                              "templates apply to dataset files")
        return BUILT_IN[source](split)
    path = Path(source)
    if path.is_dir():
        return read_saved_dataset(path, split, fmt)
    if not path.is_file():
        raise ConfigError(f"prompts {source!r} is neither a built-in task "
                          f"({', '.join(BUILT_IN)}) nor an existing file or directory")
    if path.suffix == ".parquet":
        return read_parquet(path, fmt)
    return read_jsonl(path, fmt)


def _read_arrow_dir(path: Path, fmt: DatasetFormat, name: str) -> list[Problem]:
    state_file = path / "state.json"
    if not state_file.is_file():
        raise ConfigError(f"{path} is not a directory written by datasets' save_to_disk "
                          "(no state.json or dataset_dict.json)")
    files = [path / entry["filename"] for entry in _read_json(state_file).get("_data_files", [])]
    pa, _ = _import_pyarrow()
    try:
        tables = []
        for file in files:
            with pa.memory_map(str(file)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        if not tables:
            raise ConfigError(f"{path} holds no prompts (state.json lists no data files)")
        table = pa.concat_tables(tables)
        return _table_problems(table.column_names, table.select, fmt, str(path), name)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"{path}: unreadable Arrow data ({err})") from None


def _table_problems(names: list[str], read: Callable, fmt: DatasetFormat, where: str,
                    name: str) -> list[Problem]:
    """Rows of a columnar source: `read(columns)` gives a pyarrow table of those columns."""
    for field in fmt.required:
        if field not in names:
            raise ConfigError(f"{where}: no field {field!r} (fields: {', '.join(names)})")
    either = fmt.prompt_fields
    if either and not set(either) & set(names):
        raise ConfigError(f"{where}: no field {either[0]!r} or {either[1]!r} "
                          f"(fields: {', '.join(names)})")
    columns = [c for c in dict.fromkeys([*fmt.required, *either, fmt.id_field]) if c in names]
    rows = read(columns).to_pylist()
    return _nonempty([to_problem(row, fmt, f"{where}: row {number}", f"{name}-{number}")
                      for number, row in enumerate(rows, start=1)], where)


def _nonempty(problems: list[Problem], where: str | Path) -> list[Problem]:
    if not problems:
        raise ConfigError(f"{where} holds no prompts")
    return problems


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def _import_pyarrow():
    """(pyarrow, pyarrow.parquet), or a ConfigError naming the extra to install."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("Parquet files and saved datasets need pyarrow: "
                          "pip install 'miles[export]' (or use a JSONL file)") from None
    return pyarrow, pyarrow.parquet
