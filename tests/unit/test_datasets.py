"""Dataset sources for `miles feed`: JSONL, Parquet and `datasets` save_to_disk directories,
field mapping, prompt templates, and the errors a user preparing data sees."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import miles.feeder
from miles.cli import main
from miles.errors import ConfigError
from miles.protocol.topics import run_topics
from miles.tasks.arithmetic import Problem
from miles.tasks.datasets import DatasetFormat, load_problems

ROWS = [{"key": "q1", "question": "2+2", "solution": 4, "meta": {"topic": "sums"}},
        {"key": "q2", "question": "3+5", "solution": 8, "meta": {"topic": "sums"}},
        {"key": "q3", "question": "9-7", "solution": 2, "meta": {"topic": "differences"}}]
HELD_OUT = [{"key": "t1", "question": "1+1", "solution": 2, "meta": {"topic": "sums"}}]
FORMAT = DatasetFormat(prompt_template="Question: {question}\nAnswer:", answer_field="solution",
                       id_field="key")
EXPECTED = [Problem(task_id="q1", prompt="Question: 2+2\nAnswer:", answer="4"),
            Problem(task_id="q2", prompt="Question: 3+5\nAnswer:", answer="8"),
            Problem(task_id="q3", prompt="Question: 9-7\nAnswer:", answer="2")]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def hf_datasets():
    datasets = pytest.importorskip("datasets")  # in the dev extra; reading needs only pyarrow
    datasets.disable_progress_bars()
    return datasets


@pytest.fixture
def sources(tmp_path, hf_datasets):
    """The same rows as JSONL, Parquet, a saved Dataset and the train split of a DatasetDict."""
    hf_datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    hf_datasets.DatasetDict(train=hf_datasets.Dataset.from_list(ROWS),
                            test=hf_datasets.Dataset.from_list(HELD_OUT)
                            ).save_to_disk(tmp_path / "splits")
    return {"jsonl": write_jsonl(tmp_path / "data.jsonl", ROWS),
            "parquet": write_parquet(tmp_path / "data.parquet", ROWS),
            "dataset": tmp_path / "saved", "dataset_dict": tmp_path / "splits"}


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset", "dataset_dict"])
def test_every_source_gives_the_same_problems(sources, kind):
    assert load_problems(str(sources[kind]), "train", fmt=FORMAT) == EXPECTED


def test_dataset_dict_splits_and_default_ids(sources):
    plain = DatasetFormat(prompt_field="question", answer_field="solution", id_field="absent")
    assert load_problems(str(sources["dataset_dict"]), "test", fmt=plain) == [
        Problem(task_id="splits-test-1", prompt="1+1", answer="2")]
    with pytest.raises(ConfigError, match=r"no split 'validation' \(splits: train, test\)"):
        load_problems(str(sources["dataset_dict"]), "validation", fmt=plain)
    # Files and a single saved Dataset serve every split; ids are <source name>-<row number>.
    for kind, name in (("jsonl", "data"), ("parquet", "data"), ("dataset", "saved")):
        problems = load_problems(str(sources[kind]), "test", fmt=plain)
        assert [p.task_id for p in problems] == [f"{name}-1", f"{name}-2", f"{name}-3"]
        assert [p.prompt for p in problems] == ["2+2", "3+5", "9-7"]


def test_template_reaches_nested_fields_and_keeps_literal_braces(tmp_path):
    fmt = DatasetFormat(prompt_template="{{{meta[topic]}}} {question}=", answer_field="solution")
    problems = load_problems(str(write_jsonl(tmp_path / "nested.jsonl", ROWS)), fmt=fmt)
    assert [p.prompt for p in problems] == ["{sums} 2+2=", "{sums} 3+5=", "{differences} 9-7="]
    assert [p.task_id for p in problems] == ["nested-1", "nested-2", "nested-3"]


def test_defaults_read_prompt_answer_id(tmp_path):
    rows = [{"prompt": "2+2=", "answer": 4, "id": 7}, {"prompt": "1+1=", "answer": 2}]
    expected = [Problem(task_id="7", prompt="2+2=", answer="4"),
                Problem(task_id="data-2", prompt="1+1=", answer="2")]
    assert load_problems(str(write_jsonl(tmp_path / "data.jsonl", rows))) == expected
    assert load_problems(str(write_parquet(tmp_path / "data.parquet",
                                           [{**r, "id": r.get("id")} for r in rows]))) == expected


@pytest.mark.parametrize("rows, fmt, message", [
    ([{"question": "a", "solution": 1}, {"question": "b", "solution": None}], FORMAT,
     "row 2: field 'solution' is missing or null"),
    ([{"question": "a", "solution": 1}, {"question": None, "solution": 2}], FORMAT,
     "row 2: field 'question' is missing or null"),
    ([{"question": "a", "solution": 1}], DatasetFormat(prompt_template="{query}",
                                                       answer_field="solution"),
     r"no field 'query' \(fields: question, solution\)"),
    ([{"prompt": 3, "answer": 1}], DatasetFormat(), "row 1: field 'prompt' must be a string"),
    ([{"prompt": "a", "answer": [1, 2]}], DatasetFormat(),
     "row 1: field 'answer' must be a string or number, got list"),
])
def test_parquet_errors_name_the_row_and_field(tmp_path, rows, fmt, message):
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ConfigError, match=f"bad.parquet: {message}"):
        load_problems(str(path), fmt=fmt)


@pytest.mark.parametrize("line, fmt, message", [
    ('{"question": "b", "solution": 2}', DatasetFormat(prompt_template="{query}",
                                                       answer_field="solution"),
     "field 'query' is missing"),
    ('{"question": "b", "solution": 2, "meta": {}}',
     DatasetFormat(prompt_template="{meta[topic]}", answer_field="solution"),
     "prompt_template failed: KeyError: 'topic'"),
    ('{"question": "b"}', FORMAT, "field 'solution' is missing"),
    ('["b", 2]', FORMAT, "not a JSON object"),
])
def test_jsonl_errors_name_the_line_and_field(tmp_path, line, fmt, message):
    path = tmp_path / "bad.jsonl"
    first = {"question": "a", "query": "a", "solution": 1, "meta": {"topic": "t"}}
    path.write_text(json.dumps(first) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: {message}"):
        load_problems(str(path), fmt=fmt)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_template": "{} + {}"}, "fields must be named, got {}"),
    ({"prompt_template": "{0}"}, "fields must be named, got {0}"),
    ({"prompt_template": "no fields"}, "names no field"),
    ({"prompt_template": "{unclosed"}, "not a str.format template"),
    ({"answer_field": ""}, "answer_field must not be empty"),
])
def test_format_is_checked_when_built(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DatasetFormat(**kwargs)


def test_source_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="'arithmetic' is a built-in task"):
        load_problems("arithmetic", fmt=FORMAT)
    with pytest.raises(ConfigError, match="neither a built-in task .* nor an existing file"):
        load_problems(str(tmp_path / "missing.parquet"))
    with pytest.raises(ConfigError, match="not a directory written by datasets' save_to_disk"):
        load_problems(str(tmp_path))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="empty.jsonl holds no prompts"):
        load_problems(str(tmp_path / "empty.jsonl"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="broken.parquet: not a readable Parquet file"):
        load_problems(str(tmp_path / "broken.parquet"))
    path = write_parquet(tmp_path / "data.parquet", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'miles\[export\]'"):
        load_problems(str(path), fmt=FORMAT)


def test_feed_command_maps_fields(tmp_path, monkeypatch, capsys):
    fed = []
    real_feed = miles.feeder.feed

    async def recording_feed(bus, run, problems, **kwargs):
        fed.append(problems)
        await bus.create_topics(run_topics(run))  # the embedded bus lives in this process only
        return await real_feed(bus, run, problems, **kwargs)

    monkeypatch.setattr(miles.feeder, "feed", recording_feed)
    path = write_parquet(tmp_path / "data.parquet", ROWS)
    assert main(["feed", "--bus", "embedded://", "--run", "r", "--prompts", str(path),
                 "--template", "Question: {question}\nAnswer:", "--answer-field", "solution",
                 "--id-field", "key", "--epochs", "2"]) == 0
    assert fed == [EXPECTED]
    assert capsys.readouterr().out.strip() == "published 6 prompts to miles.r.prompts"

    assert main(["feed", "--bus", "embedded://", "--run", "r", "--prompts", str(path),
                 "--prompt-field", "question", "--answer-field", "missing"]) == 2
    assert "data.parquet: no field 'missing'" in capsys.readouterr().err
    assert len(fed) == 1  # the dataset is checked before anything is published


CHAT_ROWS = [{"messages": [{"role": "system", "content": "Add."},
                           {"role": "user", "content": "2+2="}], "answer": 4, "id": None},
             {"messages": [{"role": "user", "content": "3+5="}], "answer": 8, "id": "c2"}]
CHAT_EXPECTED = [
    Problem(task_id="chat-1", prompt="Add.\n2+2=", answer="4",
            messages=({"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="})),
    Problem(task_id="c2", prompt="3+5=", answer="8",
            messages=({"role": "user", "content": "3+5="},))]


def test_conversations_are_read_from_every_source(tmp_path, hf_datasets):
    hf_datasets.Dataset.from_list(CHAT_ROWS).save_to_disk(tmp_path / "chat")
    for path in (write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS),
                 write_parquet(tmp_path / "chat.parquet", CHAT_ROWS), tmp_path / "chat"):
        assert load_problems(str(path)) == CHAT_EXPECTED
    # a row with a prompt keeps it; a named messages field is read like the default one
    rows = [{"prompt": "1+1=", "answer": 2}, {"conv": CHAT_ROWS[1]["messages"], "answer": 8}]
    problems = load_problems(str(write_jsonl(tmp_path / "mixed.jsonl", rows)),
                             fmt=DatasetFormat(messages_field="conv"))
    assert [(p.prompt, p.messages) for p in problems] == [("1+1=", None),
                                                          ("3+5=", CHAT_EXPECTED[1].messages)]


@pytest.mark.parametrize("messages, message", [
    ([], "must be a non-empty list of messages"),
    ("hi", "must be a non-empty list of messages, got str"),
    ([{"role": "user"}], r"message 0 must be .* string content"),
    ([{"role": "user", "content": 3}], r"message 0 must be .* string content"),
    ([{"role": "robot", "content": "x"}], r"message 0 must be .* role in"),
    ([{"role": "user", "content": "x"}] * 1025, "has more than 1024 messages"),
    ([{"role": "user", "content": "x" * (1 << 20)}], "is longer than"),
])
def test_bad_conversations_name_the_row(tmp_path, messages, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [CHAT_ROWS[0], {"messages": messages,
                                                               "answer": 1}])
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: field 'messages' {message}"):
        load_problems(str(path))


def test_a_row_needs_a_prompt_or_messages(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"answer": 1}])
    with pytest.raises(ConfigError, match="bad.jsonl:1: field 'prompt' .*or 'messages'"):
        load_problems(str(path))
    path = write_parquet(tmp_path / "bad.parquet", [{"question": "q", "answer": 1}])
    with pytest.raises(ConfigError, match=r"no field 'prompt' or 'messages' \(fields: question"):
        load_problems(str(path))
