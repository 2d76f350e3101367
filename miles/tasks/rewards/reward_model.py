"""The `rm:PATH` reward: a Hugging Face sequence-classification checkpoint as a scorer.

`AutoTokenizer` and `AutoModelForSequenceClassification.from_pretrained(PATH)` are loaded once,
when the reward is resolved (start-up fails fast on a bad path), on the CPU in eval mode. Each
call scores a group in batches of `batch_size`, without gradients:
- the text scored is `prompt + response`, exactly the characters the policy saw and wrote (no
  chat template: wrap the model in your own plugin if it expects one);
- rows are right-padded; a tokenizer without a pad token pads with its eos (else unk) token, and
  the model's `pad_token_id` is set to it, which is how decoder models find each row's last token;
- texts longer than the model's positions are cut from the left, keeping the response's end;
- the reward is the logit of label 0 when the head has one label (a scalar reward model), else
  the logit of the last label (the "good" class of a binary classifier).
A lock serialises the batches of concurrent calls (a call that timed out is still running in its
thread, and tokenizers are not safe to share between threads).
"""

from __future__ import annotations

import threading
from pathlib import Path

from miles.errors import ConfigError

RM_BATCH_SIZE = 16
NO_LIMIT = 10**9  # tokenizers without a length limit report a huge model_max_length


class RewardModel:
    """Batched reward `(responses, references, *, prompts) -> list[float]` from a checkpoint."""

    batched = True

    def __init__(self, path: str | Path, *, batch_size: int = RM_BATCH_SIZE):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"reward rm:{path}: cannot load a sequence-classification model "
                              f"and tokenizer: {err}") from err
        self.model.eval()
        self._set_padding(path)
        limits = [n for n in (getattr(self.model.config, "max_position_embeddings", None),
                              self.tokenizer.model_max_length) if n and n < NO_LIMIT]
        self.max_length = min(limits, default=None)
        self.batch_size = batch_size
        self._lock = threading.Lock()

    def _set_padding(self, path: str | Path) -> None:
        tokenizer = self.tokenizer
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is None:
            raise ConfigError(f"reward rm:{path}: the tokenizer has no pad, eos or unk token")
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        self.model.config.pad_token_id = tokenizer.pad_token_id

    def __call__(self, responses: list[str], references: list[str | None], *,
                 prompts: list[str]) -> list[float]:
        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        return [score for start in range(0, len(texts), self.batch_size)
                for score in self._forward(texts[start:start + self.batch_size])]

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        with self._lock, torch.inference_mode():
            batch = self.tokenizer(texts, return_tensors="pt", padding=True,
                                   truncation=self.max_length is not None,
                                   max_length=self.max_length)
            logits = self.model(**batch).logits  # [B, num_labels]
        column = 0 if logits.shape[-1] == 1 else -1
        return logits[:, column].float().tolist()
