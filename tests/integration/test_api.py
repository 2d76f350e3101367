"""`miles.train(...)`: the run from Python with an in-memory dataset and a reward callable,
the same implementation as `miles run`."""

from __future__ import annotations

import datasets
import pytest
from transformers import AutoModelForCausalLM

import miles
from miles.errors import ConfigError
from miles.tasks.datasets import load_problems


def reward_last_digit(response: str, reference: str) -> float:
    """Importable by name, so it would also reach Kafka's producer processes."""
    return float(response.strip()[:1] == reference.strip()[:1])


def small_dataset(count: int) -> datasets.Dataset:
    rows = load_problems("arithmetic", "train")[:count]
    return datasets.Dataset.from_list([{"question": p.prompt, "answer": p.answer}
                                       for p in rows])


def test_train_runs_a_dataset_with_a_reward_callable_and_returns_the_result(model_dir, tmp_path,
                                                                            capsys):
    result = miles.train(model=model_dir, dataset=small_dataset(40), reward=reward_last_digit,
                         out_dir=tmp_path / "out", max_steps=2, groups_per_step=4,
                         eval_problems=8, dataset_format={"prompt_field": "question"},
                         lora={"r": 4, "alpha": 8}, sampling={"n": 4, "max_new_tokens": 5},
                         settings={"learner.lr": 1e-3})
    assert (result.metrics["ended_by"], result.metrics["steps"]) == ("max_steps", 2)
    assert result.out_dir == tmp_path / "out" and (result.out_dir / "ledger.jsonl").exists()
    assert result.metrics["held_out_problems"] == 40  # a file serves every split
    AutoModelForCausalLM.from_pretrained(result.policy_dir)
    assert "2/2" in capsys.readouterr().err  # the progress bar


def test_a_lambda_reward_runs_embedded_and_is_refused_for_kafka(model_dir, tmp_path):
    seen = []

    def counting(response, reference):
        seen.append(response)
        return 0.0

    result = miles.train(model=model_dir, dataset=small_dataset(20), reward=counting,
                         out_dir=tmp_path / "out", max_steps=1, groups_per_step=2,
                         eval_problems=4, progress=False, export_policy=False,
                         dataset_format={"prompt_field": "question"}, sampling={"n": 2})
    assert result.metrics["steps"] == 1 and result.policy_dir is None and seen
    with pytest.raises(ConfigError, match="not importable by name"):
        miles.train(model=model_dir, dataset=small_dataset(4), reward=lambda r, a: 0.0,
                    bus="kafka://127.0.0.1:9", out_dir=tmp_path / "k")
