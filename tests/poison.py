"""Groups that pass every check at the trainer's door but still break a train step.

Validation cannot know how a model reacts to an input, so the failure is planted in the model:
a forward hook on the input embeddings that, for a batch holding `POISON_ID`, returns NaN (a
model whose activations overflow on that input: a non-finite step), raises `IndexError` (a data
error), or raises `TypeError` (a bug, which must not be isolated). The groups themselves are
valid wire records (ids below their `vocab_size`, finite values).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tests.factories import make_group

POISON_ID = 77  # the tiny character tokenizer has 78 ids; good groups use ids below 70
VOCAB = 78


def poisoned(group):
    """`group` with `POISON_ID` in its prompt (a valid record: the id is below `vocab_size`)."""
    prompt = np.array(group.prompt_token_ids, dtype=np.int32)
    prompt[0] = POISON_ID
    return replace(group, prompt_token_ids=prompt, vocab_size=VOCAB)


def good_groups(count: int, first: int = 0) -> list:
    """Valid groups the trainer admits at version 0: ids below 70 in the model's vocabulary,
    every token sampled by version 0."""
    return [admissible(make_group(4, 5, prompt_tokens=4, vocab_size=70, policy_version=0,
                                  seed=s, group_id=f"group-{s:03d}"))
            for s in range(first, first + count)]


def admissible(group):
    samples = [replace(s, versions=np.zeros_like(s.versions)) for s in group.samples]
    return replace(group, vocab_size=VOCAB, samples=samples)


def plant(model: torch.nn.Module, mode: str = "nan"):
    """Make `model`'s forward fail (`mode`: nan, raise or bug) on batches holding POISON_ID;
    returns the hook handle."""

    def hook(module, args, output):
        if not bool((args[0] == POISON_ID).any()):
            return output
        if mode == "nan":
            return output * float("nan")
        if mode == "raise":
            raise IndexError(f"id {POISON_ID} hits a broken embedding row")
        raise TypeError("a bug in the model code")

    return model.get_input_embeddings().register_forward_hook(hook)
