"""A scripted rollout engine on a real tokenizer: for episode tests whose model must say
particular things (a tool call, a reply a chat template rewrites) that a random model says
only by chance. It honours stop strings like the real engines (the string kept, finish reason
"stop_string"); otherwise a reply ends with EOS."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from transformers import AutoTokenizer

from miles.engines import Completion
from miles.engines.base import TokenizedEngine

SCRIPTED_LOGPROB = -0.5


class ScriptedEngine(TokenizedEngine):
    """`reply(prompt_text)` is the text the model says next."""

    name = "scripted"

    def __init__(self, tokenizer_dir, reply: Callable[[str], str], *,
                 spell: Callable[[str], list[int]] | None = None):
        """`spell(text)`: the ids a reply is sampled as; default the tokenizer's own encoding
        (a model may sample another tokenization of the same text)."""
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.spell = spell or self.encode
        self._vocab_size, self._eos_token_id = len(self.tokenizer), self.tokenizer.eos_token_id
        self.reply = reply
        self.calls: list[tuple[list[list[int]], tuple[str, ...]]] = []

    def generate(self, prompts, params, *, seed=None, stop_strings=()):
        self._check_prompts(prompts)
        self.calls.append(([list(p) for p in prompts], tuple(stop_strings)))
        return [[self._completion(self.reply(self.decode(p)), params.max_new_tokens,
                                  stop_strings) for _ in range(params.n)] for p in prompts]

    def _completion(self, text: str, budget: int, stop_strings) -> Completion:
        ends = [text.index(s) + len(s) for s in stop_strings if s in text]
        if ends:
            ids, reason = self.spell(text[:min(ends)]), "stop_string"
        else:
            ids, reason = self.spell(text) + [self._eos_token_id], "stop"
        if len(ids) > budget:
            ids, reason = ids[:budget], "length"
        return Completion(token_ids=np.asarray(ids, dtype=np.int32),
                          logprobs=np.full(len(ids), SCRIPTED_LOGPROB, dtype=np.float32),
                          finish_reason=reason, policy_version=self._policy_version)

    def load_adapter(self, adapter_dir, policy_version, *, new_lineage=False):
        raise NotImplementedError("a scripted engine has no weights")
