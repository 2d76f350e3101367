"""The long-tail workload (`miles.tasks.long_tail`): the saved model, loaded like any checkpoint,
stops with the probability its prompt's difficulty digit sets, so easy prompts get short responses,
hard ones long, and the prompt mix a heavy tail."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from miles.engines import HFEngine
from miles.rl.sampling import SamplingParams
from miles.tasks.long_tail import (
    build_long_tail_model,
    length_percentiles,
    long_tail_prompts,
    mean_lengths,
)

LOGIT_TOLERANCE = 0.01  # |model's EOS logit - the table's|: the untrained layers' leftover


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(build_long_tail_model(tmp_path_factory.mktemp("long-tail") / "model"))


def next_token_logprobs(engine, text: str) -> torch.Tensor:
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([engine.encode(text)])).logits[0, -1]
    return logits.log_softmax(-1)  # [V]


def test_each_digit_stops_with_its_probability(engine):
    for digit, mean in enumerate(mean_lengths()):
        logprobs = next_token_logprobs(engine, f"q12:{digit}")
        stop = 1.0 / mean
        eos_logit = logprobs[engine.eos_token_id] - logprobs[engine.encode(str(digit))[-1]]
        assert abs(float(eos_logit) - math.log(stop / (1 - stop))) < LOGIT_TOLERANCE
        assert float(logprobs.exp().topk(2).values.sum()) > 1 - 1e-6  # nothing else is ever sampled


def test_difficulty_sets_the_response_length(engine):
    params = SamplingParams(n=64, max_new_tokens=256)
    easy, hard = engine.generate([engine.encode("q1:0"), engine.encode("q2:4")], params, seed=0)
    easy_lengths = [len(c.token_ids) for c in easy]
    hard_lengths = [len(c.token_ids) for c in hard]
    assert statistics.median(easy_lengths) <= 4 < 12 <= statistics.median(hard_lengths)
    for lengths, mean in ((easy_lengths, mean_lengths()[0]), (hard_lengths, mean_lengths()[4])):
        assert abs(statistics.mean(lengths) - mean) < 0.5 * mean  # sd of the mean: mean / 8
    assert engine.decode(hard[0].token_ids).strip("4") == ""  # the prompt's digit, repeated


def test_the_prompt_mix_has_a_heavy_tail(engine):
    sampler = engine.streaming_sampler()
    requests = [sampler.submit(engine.encode(p), SamplingParams(n=2, max_new_tokens=256), seed=i)
                for i, p in enumerate(long_tail_prompts(96, seed=0))]
    while not all(r.done for r in requests):
        sampler.step()
    lengths = [len(c.token_ids) for r in requests for c in r.completions]
    spread = length_percentiles(lengths)
    assert spread["p50"] <= 8 and spread["p99"] >= 15 * spread["p50"]
    assert spread["max"] <= 256


def test_prompts_skew_towards_easy_digits():
    digits = [int(p[-1]) for p in long_tail_prompts(2000, seed=1)]
    counts = np.bincount(digits, minlength=10)
    assert counts[0] > counts[1] > counts[3] > counts[6] and counts[9] > 0
    assert long_tail_prompts(5, seed=1) == long_tail_prompts(5, seed=1)
    uniform = [int(p[-1]) for p in long_tail_prompts(2000, seed=1, skew=1.0)]
    assert statistics.mean(uniform) > statistics.mean(digits) + 2


def test_the_vocabulary_must_fit_the_hidden_size(tmp_path):
    with pytest.raises(ValueError, match="hidden_size >= vocabulary"):
        build_long_tail_model(tmp_path / "m", hidden_size=64, heads=4, kv_heads=2)
