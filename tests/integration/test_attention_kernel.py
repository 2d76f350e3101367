"""The learner's attention: short lines in bf16 on a CPU run `short_line_attention`.

torch's fused CPU attention is slow in bf16 on short lines (`attention.SHORT_LINE_WIDTH`). The
rule must pick the short-line attention there and only there, and the logprobs it gives must be
as close to fp32's as the fused kernel's are. One rank, the tiny Llama of `model_dir`.
"""

from dataclasses import replace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from miles.trainer import attention
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.integration.conformance import process_group  # noqa: F401
from tests.integration.test_shared_prompts import groups, scored

FUSED = "aten::_scaled_dot_product_flash_attention_for_cpu"
SHORT = "aten::_softmax"  # the short-line attention's softmax (the fused kernel has its own)
MATH = "aten::_safe_softmax"  # torch's math kernel's (which the short-line attention replaces)
CONFIG = LearnerConfig(lr=1e-3, max_tokens_per_micro_batch=256, seed=0)
LORA = LoraSettings(r=4, alpha=8)


def attention_ops(learner: Learner) -> set[str]:
    """The attention ops a training step runs (forward and backward)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        learner.train_step(groups())
    return {e.key for e in prof.key_averages()} & {FUSED, SHORT, MATH}


@pytest.mark.parametrize("precision, width, kernel", [
    ("bf16", attention.SHORT_LINE_WIDTH, SHORT),  # the rule: short lines, bf16
    ("bf16", 0, FUSED),  # the same step with the rule off
    ("fp32", attention.SHORT_LINE_WIDTH, FUSED),  # fp32 keeps the fused kernel
])
def test_short_bf16_lines_run_the_short_line_attention(model_dir, monkeypatch, precision, width,
                                                       kernel):
    monkeypatch.setattr(attention, "SHORT_LINE_WIDTH", width)
    learner = Learner(model_dir, replace(CONFIG, precision=precision), lora=LORA)
    assert max(b.input_ids.shape[1] for b in learner.micro_batches(groups())) <= 64
    assert attention_ops(learner) == {kernel}


def test_the_short_line_attention_is_as_close_to_fp32_as_the_fused_kernel(model_dir, monkeypatch):
    exact = scored(Learner(model_dir, replace(CONFIG, precision="fp32"), lora=LORA), groups())
    errors = {}
    for width in (0, attention.SHORT_LINE_WIDTH):
        monkeypatch.setattr(attention, "SHORT_LINE_WIDTH", width)
        bf16 = scored(Learner(model_dir, replace(CONFIG, precision="bf16"), lora=LORA), groups())
        errors[width] = max((bf16[k] - exact[k]).abs().max().item() for k in exact)
    assert errors[attention.SHORT_LINE_WIDTH] < 0.02
    assert errors[attention.SHORT_LINE_WIDTH] <= 1.5 * errors[0] + 1e-3
