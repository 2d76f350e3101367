"""The supervised warm start's stopping rule: `stop_at_success` with a probe stops at the first
check that reaches it, with exactly the weights a run of that many steps gives; the
teacher-forced probe agrees with greedy decoding."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from miles.errors import ConfigError, StoppedError
from miles.sft import SFTConfig, exact_examples, supervised_warm_start, teacher_forced_probe
from miles.tasks.datasets import load_problems
from miles.tasks.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("base") / "model", hidden_size=32, layers=1)


def weights(model_dir):
    return load_file(model_dir / "model.safetensors")


def state(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def sft(base, out, probe=None, should_stop=lambda: False, problems=None, **settings):
    config = SFTConfig(batch_size=8, warmup_steps=2, **settings)
    problems = problems or load_problems("arithmetic", "train")[:64]
    return supervised_warm_start(base, out, problems, config, probe=probe,
                                 should_stop=should_stop)


def test_the_run_stops_at_the_first_check_that_reaches_the_success(base, tmp_path):
    checked = []

    def probe(model, tokenizer):
        assert not model.training and not torch.is_grad_enabled()
        checked.append(state(model))
        return [0.0, 0.1, 0.25, 0.9][len(checked) - 1]

    stopped = sft(base, tmp_path / "stopped", probe, steps=40, stop_at_success=0.2,
                  check_every=3)
    assert len(checked) == 3  # steps 3, 6 and 9; 0.25 >= 0.2 at step 9
    nine_steps = weights(sft(base, tmp_path / "nine", steps=9))
    for name, tensor in weights(stopped).items():
        torch.testing.assert_close(tensor, nine_steps[name], rtol=0, atol=0)
        torch.testing.assert_close(checked[-1][name], tensor, rtol=0, atol=0, check_dtype=False)
    six = weights(sft(base, tmp_path / "six", steps=6))
    assert any(not torch.equal(six[name], t) for name, t in weights(stopped).items())


def test_a_success_never_reached_runs_every_step_and_says_so(base, tmp_path, caplog):
    calls = []
    with caplog.at_level(logging.WARNING, logger="miles.sft"):
        out = sft(base, tmp_path / "all", lambda *_: calls.append(1) or 0.0, steps=8,
                  stop_at_success=0.5, check_every=4)
    assert len(calls) == 2 and "never reached 0.500 in 8 steps" in caplog.text
    eight_steps = weights(sft(base, tmp_path / "eight", steps=8))
    assert all(torch.equal(t, eight_steps[name]) for name, t in weights(out).items())


def test_without_a_probe_or_a_target_nothing_is_checked(base, tmp_path):
    calls = []
    sft(base, tmp_path / "off", lambda *_: calls.append(1) or 1.0, steps=4, check_every=1)
    assert calls == []  # stop_at_success 0: off even with a probe


@pytest.mark.parametrize("field, value, message", [
    ("stop_at_success", 1.5, "sft.stop_at_success must be in [0, 1], got 1.5"),
    ("stop_at_success", -0.1, "sft.stop_at_success must be in [0, 1], got -0.1"),
    ("check_every", 0, "sft.check_every must be >= 1, got 0"),
])
def test_the_settings_are_checked_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SFTConfig(**{field: value})


def test_the_teacher_forced_probe_counts_what_greedy_decoding_reproduces(base, tmp_path):
    """On a model that has memorised 8 problems of 64, a problem set counts as solved exactly
    when greedy generation of each of its examples gives the answer and then EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    memorised = load_problems("arithmetic", "train")[:8]
    model_dir = sft(base, tmp_path / "half", steps=150, problems=memorised, lr=1e-2)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = load_problems("arithmetic", "train")[:64]
    greedy = []
    for p in problems:
        prompt = tokenizer.encode(p.prompt, add_special_tokens=False, return_tensors="pt")
        target = tokenizer.encode(p.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        out = model.generate(prompt, max_new_tokens=len(target), do_sample=False,
                             attention_mask=torch.ones_like(prompt),
                             pad_token_id=tokenizer.eos_token_id)
        greedy.append(out[0, prompt.shape[1]:].tolist() == target)
    assert 0 < sum(greedy) < len(greedy)  # a mix, so the agreement means something
    with torch.no_grad():
        assert exact_examples(model, tokenizer, problems) == greedy
        pairs = [problems[i:i + 2] for i in range(0, 64, 2)]
        expected = sum(greedy[i] and greedy[i + 1] for i in range(0, 64, 2)) / 32
        assert teacher_forced_probe(pairs)(model, tokenizer) == expected


def test_a_stop_ends_the_run_before_the_next_step_and_saves_nothing(base, tmp_path):
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(StoppedError, match="stopped at step 4 of 50; nothing was saved"):
        sft(base, tmp_path / "stopped", steps=50, should_stop=should_stop)
    assert not (tmp_path / "stopped").exists()
