"""Builders of wire records for tests and benchmarks (`from tests.factories import make_group`).

`make_*` build valid records, deterministic for a given seed, arrays already in the wire dtypes;
override any field with keyword arguments. `wire_map`/`pack_map`/`array_map` build raw msgpack
the codec never would, to test what a decoder does with bad input.
"""

import hashlib
from pathlib import Path

import msgpack
import numpy as np

from miles.protocol import (Command, DeadLetter, Heartbeat, PromptTask, Sample, TrajectoryGroup,
                            WeightVersion, WireRecord, encode)

CREATED_AT = 1_700_000_000.0
VOCAB_SIZE = 32_000


def make_sample(n_tokens: int = 8, *, vocab_size: int = VOCAB_SIZE, policy_version: int = 3,
                seed: int = 0, **overrides) -> Sample:
    """A sample of `n_tokens` tokens, the last quarter generated one policy version later."""
    rng = np.random.default_rng(seed)
    versions = np.full(n_tokens, policy_version, dtype=np.int32)
    versions[n_tokens - n_tokens // 4:] += 1  # the response spans a weight update
    fields = dict(
        response_token_ids=rng.integers(0, vocab_size, n_tokens, dtype=np.int32),
        logprobs=-rng.exponential(1.0, n_tokens).astype(np.float32),
        versions=versions,
        reward=float(rng.random()),
        finish_reason="stop",
    )
    return Sample(**(fields | overrides))


def make_episode(turns: list[tuple[int, int]], *, vocab_size: int = VOCAB_SIZE,
                 policy_version: int = 3, seed: int = 0, **overrides) -> Sample:
    """A multi-turn episode (1.4): one (policy tokens, observation tokens) pair per turn, the
    policy's tokens of turn k generated under `policy_version + k`; observation tokens carry
    mask 0, version -1 and logprob 0.0."""
    rng = np.random.default_rng(seed)
    mask = np.concatenate([np.r_[np.ones(p, np.uint8), np.zeros(o, np.uint8)]
                           for p, o in turns])
    versions = np.concatenate([np.r_[np.full(p, policy_version + k, np.int32),
                                     np.full(o, -1, np.int32)]
                               for k, (p, o) in enumerate(turns)])
    n = len(mask)
    fields = dict(
        response_token_ids=rng.integers(0, vocab_size, n, dtype=np.int32),
        logprobs=np.where(mask == 1, -rng.exponential(1.0, n), 0.0).astype(np.float32),
        versions=versions, reward=float(rng.random()), finish_reason="stop", loss_mask=mask,
        turn_ends=np.cumsum([p + o for p, o in turns]).astype(np.int32),
        episode={"turns": len(turns), "tool_calls": len(turns) - 1, "tool_errors": 0,
                 "env_s": 0.25},
    )
    return Sample(**(fields | overrides))


def version_zero_sample(n: int, reward: float, seed: int, *, vocab_size: int = 78) -> Sample:
    """A sample of `n` tokens (ids from 4, below the tiny tokenizer's 78) that version 0 drew,
    with behaviour logprobs in [-6, -2]: what the trainer's door admits at its first step."""
    rng = np.random.default_rng(seed)
    return Sample(response_token_ids=rng.integers(4, vocab_size, n, dtype=np.int32),
                  logprobs=(-rng.uniform(2.0, 6.0, n)).astype(np.float32),
                  versions=np.zeros(n, dtype=np.int32), reward=reward, finish_reason="stop")


def make_group(n_samples: int = 4, n_tokens: int = 8, *, prompt_tokens: int = 6,
               vocab_size: int = VOCAB_SIZE, policy_version: int = 3, seed: int = 0,
               **overrides) -> TrajectoryGroup:
    """A group of `n_samples` samples of `n_tokens` tokens each for one prompt."""
    rng = np.random.default_rng(seed)
    fields = dict(
        group_id=f"g-{seed}",
        task_id=f"t-{seed}",
        prompt_token_ids=rng.integers(0, vocab_size, prompt_tokens, dtype=np.int32),
        samples=[make_sample(n_tokens, vocab_size=vocab_size, policy_version=policy_version,
                             seed=seed * 10_007 + i) for i in range(n_samples)],
        producer_id="producer-0",
        engine="hf",
        vocab_size=vocab_size,
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": n_tokens},
        reference="42",
        timings={"generate_s": 0.5, "reward_s": 0.01},
        created_at=CREATED_AT,
    )
    return TrajectoryGroup(**(fields | overrides))


def small_batch(*, vocab_size: int = 78) -> list[TrajectoryGroup]:
    """Three groups of four samples (3-6 tokens, rewards 0 and 1 alternating): a batch a tiny
    learner trains in a fraction of a second, the same at every call."""
    return [make_group(vocab_size=vocab_size, seed=g, sampling={"max_new_tokens": 8}, samples=[
        make_sample(3 + i, vocab_size=vocab_size, seed=10 * g + i, reward=float(i % 2))
        for i in range(4)]) for g in range(3)]


def make_prompt_task(**overrides) -> PromptTask:
    fields = dict(task_id="t-0", prompt="What is 6 * 7?",
                  prompt_token_ids=np.array([5, 6, 7, 8], dtype=np.int32), reference="42",
                  epoch=1, metadata={"source": "gsm8k", "level": 2, "hard": False, "w": 0.5},
                  created_at=CREATED_AT)
    return PromptTask(**(fields | overrides))


def make_weight_version(**overrides) -> WeightVersion:
    fields = dict(policy_version=7, step=7, uri="file:///tmp/run/weights/v7.safetensors",
                  format="lora", sha256=hashlib.sha256(b"weights").hexdigest(), bytes=1234,
                  base_model="tiny-llama", created_at=CREATED_AT)
    return WeightVersion(**(fields | overrides))


def make_command(**overrides) -> Command:
    fields = dict(command="pause", target="*", reason="maintenance", created_at=CREATED_AT)
    return Command(**(fields | overrides))


def make_heartbeat(**overrides) -> Heartbeat:
    fields = dict(producer_id="producer-0", role="producer", engine="hf", policy_version=3,
                  in_flight=2, tokens_per_s=1234.5, extra={"gpu": "cpu", "queue": 3},
                  created_at=CREATED_AT)
    return Heartbeat(**(fields | overrides))


def make_dead_letter(**overrides) -> DeadLetter:
    fields = dict(reason="samples[0].logprobs: logprob nan at index 0 is not finite",
                  source_topic="miles.run.trajectories", source_partition=2, source_offset=41,
                  payload=b"\x82\xa4type", payload_size=6, created_at=CREATED_AT)
    return DeadLetter(**(fields | overrides))


def make_records() -> list[WireRecord]:
    """One valid record of every top-level type."""
    return [make_prompt_task(), make_group(), make_weight_version(), make_command(),
            make_heartbeat(), make_dead_letter()]


def wire_map(record: WireRecord) -> dict:
    """The raw msgpack map of a valid record, to tamper with in tests (bypasses the codec)."""
    return msgpack.unpackb(encode(record), raw=False)


def pack_map(value: object) -> bytes:
    """msgpack bytes of any value, unchecked: how a buggy or hostile writer would send it."""
    return msgpack.packb(value, use_bin_type=True)


def array_map(values, dtype: str) -> dict:
    """A wire array map `{dtype, length, data}` of `values` in `dtype` (any dtype, unchecked)."""
    data = np.asarray(values, dtype=dtype).tobytes()
    return {"dtype": dtype, "length": len(values), "data": data}


def tokenizer_folder(out: Path, *, vocab_size: int) -> Path:
    """What a producer that does not sample itself needs of a model: the character tokenizer
    and a config.json naming the (padded) vocabulary size."""
    import json

    from miles.tasks.tiny_model import build_char_tokenizer

    build_char_tokenizer().save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": "llama",
                                                 "vocab_size": vocab_size}))
    return out


def mean_logprob_gap(model, prompts: list[list[int]], groups: list, params) -> float:
    """Mean |engine logprob - trainer logprob| over the completions `groups` (one list per
    prompt) of an engine, the trainer's being `sampled_logprobs` under `model` (on its device)
    of the same tokens. Checks each completion's finish reason on the way (the real-engine tests)."""
    import torch

    from miles.engines.base import FINISH_REASONS
    from miles.rl.sampling import sampled_logprobs

    gaps, device = [], next(model.parameters()).device
    for prompt, group in zip(prompts, groups):
        for completion in group:
            assert completion.finish_reason in FINISH_REASONS  # the engine contract's
            ids = torch.tensor([prompt + completion.token_ids.tolist()], device=device)
            with torch.inference_mode():
                logits = model(ids).logits[0, len(prompt) - 1:-1]  # [T, V]
            ours = sampled_logprobs(logits, ids[0, len(prompt):], temperature=params.temperature,
                                    top_k=params.top_k, top_p=params.top_p)
            gaps.append((ours.cpu() - torch.from_numpy(completion.logprobs)).abs().mean().item())
    return float(np.mean(gaps))
