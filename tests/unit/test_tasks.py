"""Built-in task, datasets and rewards."""

import json

import pytest

from miles.errors import ConfigError
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.datasets import load_problems, read_jsonl
from miles.tasks.rewards import exact_match, resolve_reward


def test_arithmetic_splits_are_disjoint_deterministic_and_correct():
    train, test = arithmetic_problems("train"), arithmetic_problems("test")
    assert len(test) == 1000 and len(train) == 100 * 100 - 1000
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert arithmetic_problems("test") == test
    plain = arithmetic_problems("test", reverse=False)
    assert [p.prompt for p in plain] == [p.prompt for p in test]
    for p, q in zip(test[:50], plain[:50]):
        a, b = p.prompt.rstrip("=").split("+")
        assert int(q.answer) == int(a) + int(b)
        assert p.answer == q.answer[::-1]  # least-significant digit first
    assert any(p.answer != p.answer[::-1] for p in test)
    assert load_problems("arithmetic-plain", "test") == plain
    with pytest.raises(ValueError):
        arithmetic_problems("dev")


def test_exact_match():
    assert exact_match(" 85", "85") == 1.0
    assert exact_match("58", "85") == 0.0
    with pytest.raises(ValueError):
        exact_match("1", None)


def test_resolve_reward():
    assert resolve_reward("exact_match").fn is exact_match
    assert resolve_reward("miles.tasks.rewards:exact_match").fn is exact_match
    for bad in ("nope", "miles.tasks.rewards:missing", "no.such.module:f"):
        with pytest.raises(ConfigError):
            resolve_reward(bad)


def test_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "2+2=", "answer": 4}),
                               json.dumps({"id": "x", "prompt": "1+1=", "answer": "2"}), ""]))
    problems = read_jsonl(path)
    assert [(p.task_id, p.prompt, p.answer) for p in problems] == [
        ("data-1", "2+2=", "4"), ("x", "1+1=", "2")]
    assert load_problems(str(path), "test") == problems


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"), ('{"answer": 1}', "prompt"), ('{"prompt": "x"}', "answer")])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "answer": 1}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: .*{message}"):
        read_jsonl(path)
