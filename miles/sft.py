"""`miles sft`: a short supervised warm start, so RL starts from a policy that sometimes succeeds.

Full fine-tuning with cross-entropy on the answer tokens (and the end-of-sequence token) of
`prompt + answer`; the prompt tokens are context only. It stops after `steps` steps: the point is
a policy whose held-out greedy accuracy is low but above zero, which gives GRPO groups with mixed
rewards to learn from. The result is saved with `save_pretrained` next to its tokenizer, so it
loads like any checkpoint.

Stopping at a success rate (`stop_at_success`, with a `probe`): some skills are learnt abruptly
(a tiny model copying operands into a tool call goes from 0.03 to 0.85 greedy success within a
few dozen steps, and where it lands after a fixed number of steps depends on the machine's
numerics: thread counts change the float sums), so a fixed step count gives a warm start of
unpredictable quality. With a probe (the model -> its success on problems the SFT does not
train on) the run is checked every `check_every` steps and stops at the first check that
reaches `stop_at_success`; `steps` is then the most it runs. `teacher_forced_probe` is the cheap
one: a problem succeeds when greedy decoding would reproduce every one of its examples exactly
(each answer token and the EOS the argmax given what precedes it), found in one forward pass
instead of generating.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.errors import ConfigError, StoppedError
from miles.tasks.arithmetic import Problem

log = logging.getLogger(__name__)
Probe = Callable[[torch.nn.Module, object], float]  # (model, tokenizer) -> success in [0, 1]


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    steps: int = 300  # optimizer steps (with `stop_at_success`: the most)
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0
    stop_at_success: float = 0.0  # with a probe: stop once its success reaches this (0: off)
    check_every: int = 10  # steps between probes when `stop_at_success` is set

    def __post_init__(self) -> None:
        if not 0.0 <= self.stop_at_success <= 1.0:
            raise ConfigError(f"sft.stop_at_success must be in [0, 1], got "
                              f"{self.stop_at_success}")
        if self.check_every < 1:
            raise ConfigError(f"sft.check_every must be >= 1, got {self.check_every}")


def encode_examples(tokenizer, problems: list[Problem]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + EOS, number of prompt tokens) per problem."""
    out = []
    for p in problems:
        prompt = tokenizer.encode(p.prompt, add_special_tokens=False)
        answer = tokenizer.encode(p.answer, add_special_tokens=False)
        out.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return out


def collate(examples: list[tuple[list[int], int]], pad_id: int):
    """Right-padded `input_ids`, `attention_mask` and `labels` (-100 off the answer)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(examples), width), dtype=torch.long)  # [B, L]
    for row, (ids, prompt_len) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
        mask[row, :len(ids)] = 1
    return input_ids, mask, labels


def supervised_warm_start(model_dir: Path, out_dir: Path, problems: list[Problem],
                          config: SFTConfig = SFTConfig(), *, probe: Probe | None = None,
                          should_stop: Callable[[], bool] = lambda: False) -> Path:
    """Fine-tune the model at `model_dir` on `problems` and save it to `out_dir` (see the
    module docstring for `probe`). StoppedError, with nothing saved, once `should_stop()` (asked
    before every step) is true."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    examples = encode_examples(tokenizer, problems)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / config.warmup_steps))
    out_dir = Path(out_dir)
    checking = probe is not None and config.stop_at_success > 0
    began = time.perf_counter()
    for step in range(1, config.steps + 1):
        if should_stop():
            raise StoppedError(f"the supervised warm start was stopped at step {step} of "
                               f"{config.steps}; nothing was saved")
        model.train()
        loss = _sft_step(model, optimizer, schedule, tokenizer,
                         rng.sample(examples, config.batch_size))
        if step % 50 == 1 or step == config.steps:
            log.info("sft step %d/%d loss %.4f (%.0f s)", step, config.steps, loss,
                     time.perf_counter() - began)
        if checking and step % config.check_every == 0:
            success = _probe(probe, model, tokenizer)
            log.info("sft step %d: success %.3f (stop at %.3f)", step, success,
                     config.stop_at_success)
            if success >= config.stop_at_success:
                break
    else:
        if checking:
            log.warning("sft: success never reached %.3f in %d steps; keeping the last step",
                        config.stop_at_success, config.steps)
    _save(model, tokenizer, out_dir)
    return out_dir


def _probe(probe: Probe, model: torch.nn.Module, tokenizer) -> float:
    model.eval()
    with torch.no_grad():
        return float(probe(model, tokenizer))


def teacher_forced_probe(problem_sets: list[list[Problem]]) -> Probe:
    """A probe: the fraction of `problem_sets` (each problem's supervised examples) whose
    every example greedy decoding reproduces exactly (see the module docstring)."""

    def probe(model: torch.nn.Module, tokenizer) -> float:
        flat = [p for problems in problem_sets for p in problems]
        exact = iter(exact_examples(model, tokenizer, flat))
        solved = [all([next(exact) for _ in problems]) for problems in problem_sets]
        return sum(solved) / max(len(solved), 1)

    return probe


def exact_examples(model: torch.nn.Module, tokenizer, problems: list[Problem],
                   batch_size: int = 256) -> list[bool]:
    """Per problem: whether every answer token and the EOS is the argmax next token given the
    prompt and the answer before it (teacher forcing)."""
    out = []
    examples = encode_examples(tokenizer, problems)
    for start in range(0, len(examples), batch_size):
        input_ids, mask, labels = collate(examples[start:start + batch_size],
                                          tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, attention_mask=mask).logits  # [B, L, V]
        predicted, targets = logits[:, :-1].argmax(-1), labels[:, 1:]  # [B, L-1]
        wrong = (predicted != targets) & (targets != -100)  # [B, L-1]
        out += (~wrong.any(dim=1)).tolist()
    return out


def _sft_step(model, optimizer, schedule, tokenizer, batch) -> float:
    input_ids, mask, labels = collate(batch, tokenizer.pad_token_id)
    loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _save(model, tokenizer, out_dir: Path) -> None:
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
