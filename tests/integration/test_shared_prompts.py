"""`learner.share_prompts`: a group's samples share one line and one copy of their prompt.

Each response attends to the prompt and to itself (a custom 4D mask); each sample's targets are
gathered from its own positions. The logprobs, and so a step, must be those of the samples laid
out one per sequence; the forward must be smaller. One rank, fp32, the tiny Llama of `model_dir`.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from miles.trainer.batching import _Row, sharing_pays
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings, shared_prompts_supported
from tests.integration.conformance import process_group, trained_weights  # noqa: F401
from tests.factories import make_episode, make_group, make_sample

VOCAB = 78
LORA = LoraSettings(r=4, alpha=8)
# adam_eps 1: the update is ~ lr x momentum, linear in the gradients (see test_skip_zero_advantage)
CONFIG = LearnerConfig(lr=0.5, adam_eps=1.0, max_tokens_per_micro_batch=256, seed=0,
                       precision="fp32")


def groups() -> list:
    """Four groups of four: prompts of 12 tokens, responses of 1-4 (one an episode)."""
    out = []
    for g in range(4):
        samples = [make_sample(1 + (g + i) % 4, vocab_size=VOCAB, seed=g * 10 + i,
                               reward=float((g + i) % 3 == 0)) for i in range(4)]
        if g == 3:
            samples[0] = make_episode([(1, 2), (1, 0)], vocab_size=VOCAB, seed=99, reward=1.0)
        out.append(make_group(vocab_size=VOCAB, seed=g, samples=samples, prompt_tokens=12,
                              sampling={"temperature": 1.0, "max_new_tokens": 4}))
    return out


def scored(learner: Learner, batch_groups) -> dict:
    out = {}
    for batch in learner.micro_batches(batch_groups):
        logp = learner.score(batch)
        for row, sample_id in enumerate(batch.sample_ids):
            out[sample_id] = logp[row][batch.response_mask[row]]
    return out


def learners(model_dir) -> tuple[Learner, Learner]:
    return (Learner(model_dir, replace(CONFIG, share_prompts=True), lora=LORA),
            Learner(model_dir, replace(CONFIG, share_prompts=False), lora=LORA))


def test_samples_sharing_a_prompt_score_as_they_do_alone_in_a_smaller_forward(model_dir):
    sharing, alone = learners(model_dir)
    assert sharing.share_width == 64 and alone.share_width == 0
    batches = sharing.micro_batches(groups())
    assert all(b.sample_targets is not None and b.attention_mask.dim() == 4 for b in batches)
    tokens = sum(b.input_ids.numel() for b in batches)
    assert tokens < 0.6 * sum(b.input_ids.numel() for b in alone.micro_batches(groups()))
    shared, separate = scored(sharing, groups()), scored(alone, groups())
    assert shared.keys() == separate.keys() and len(shared) == 16
    assert_close(shared, separate, rtol=1e-5, atol=1e-5)


def test_a_step_on_shared_prompts_is_the_step_on_separate_samples(model_dir):
    sharing, alone = learners(model_dir)
    for _ in range(3):  # LoRA's B starts at 0: later steps move A as well
        a, b = sharing.train_step(groups()), alone.train_step(groups())
        assert a["trainer/tokens"] == b["trainer/tokens"]
        assert a["trainer/loss"] == pytest.approx(b["trainer/loss"], abs=1e-6)
        assert a["trainer/entropy"] == pytest.approx(b["trainer/entropy"], rel=1e-5)
    assert_close(trained_weights(sharing), trained_weights(alone), rtol=1e-5, atol=1e-6)


def test_a_model_that_ignores_the_mask_does_not_share(model_dir):
    from transformers import AutoModelForCausalLM

    for attention, honoured in (("sdpa", True), ("eager", False)):  # eager adds a bool mask
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention)
        assert shared_prompts_supported(model.eval(), torch.device("cpu")) is honoured


def row(prompt: int, response: int, group: str = "g", index: int = 0) -> _Row:
    sample = make_sample(response, vocab_size=VOCAB, seed=index)
    return _Row((group, index), np.zeros(prompt, dtype=np.int32), sample, 0.0, 1.0, True)


@pytest.mark.parametrize("prompt, response, hidden, shares", [
    (6, 4, 128, True),  # the demo: short answers to a prompt
    (500, 1000, 4096, True),  # a long prompt, long answers, a wide model
    (100, 2000, 4096, False),  # a short prompt under long answers: the extra attention costs more
    (100, 2000, 64, False),
])
def test_sharing_is_chosen_where_it_saves_compute(prompt, response, hidden, shares):
    rows = [row(prompt, response, index=i) for i in range(8)]
    assert sharing_pays(rows, hidden) is shares
