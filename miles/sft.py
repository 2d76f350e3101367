"""`miles sft`: a short supervised warm start, so RL starts from a policy that sometimes succeeds.

Full fine-tuning with cross-entropy on the answer tokens (and the end-of-sequence token) of
`prompt + answer`; the prompt tokens are context only. It stops after `steps` steps: the point is
a policy whose held-out greedy accuracy is low but above zero, which gives GRPO groups with mixed
rewards to learn from. The result is saved with `save_pretrained` next to its tokenizer, so it
loads like any checkpoint.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.tasks.arithmetic import Problem

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0


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
                          config: SFTConfig = SFTConfig()) -> Path:
    """Fine-tune the model at `model_dir` on `problems` and save it to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    examples = encode_examples(tokenizer, problems)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / config.warmup_steps))
    model.train()
    began = time.perf_counter()
    for step in range(config.steps):
        input_ids, mask, labels = collate(rng.sample(examples, config.batch_size),
                                          tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == config.steps - 1:
            log.info("sft step %d/%d loss %.4f (%.0f s)", step + 1, config.steps, loss.item(),
                     time.perf_counter() - began)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
