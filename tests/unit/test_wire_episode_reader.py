"""A foreign client reads an episode: a group Miles encodes (schema 1.4, episode fields,
`sampling.turn_tokens`, `episode.truncated`, a prompt task's `metadata.messages`) decoded with
plain `msgpack` and numpy, following only docs/wire-format.md: no Miles decoder involved."""

from __future__ import annotations

import json

import msgpack
import numpy as np

from miles.feeder import prompt_task
from miles.protocol import encode
from miles.tasks.arithmetic import Problem
from tests.factories import make_episode, make_group

DOC_DTYPES = {"response_token_ids": "<i4", "logprobs": "<f4", "versions": "<i4",
              "token_rewards": "<f4", "loss_mask": "|u1", "turn_ends": "<i4"}
"""The sample arrays and their dtypes, as the doc's sample table lists them."""


def array(field: dict, dtype: str) -> np.ndarray:
    """An array map as the doc describes it: {dtype, length, data} of raw little-endian bytes."""
    assert field["dtype"] == dtype
    values = np.frombuffer(field["data"], dtype=np.dtype(field["dtype"]))
    assert len(values) == field["length"]
    return values


def test_an_episode_group_reads_by_the_documented_layout():
    turns = [(3, 2), (2, 0)]
    sample = make_episode(turns, episode={"turns": 2, "tool_calls": 1, "tool_errors": 0,
                                          "env_s": 0.5, "truncated": "max_turns"},
                          finish_reason="length")
    group = make_group(samples=[sample], sampling={"temperature": 1.0, "max_new_tokens": 58,
                                                   "turn_tokens": 32})
    record = msgpack.unpackb(encode(group), raw=False)
    assert record["type"] == "trajectory_group" and record["schema"] == [1, 4]
    assert record["sampling"]["turn_tokens"] == 32 and record["sampling"]["max_new_tokens"] == 58
    (wire,) = record["samples"]
    arrays = {name: array(wire[name], dtype) for name, dtype in DOC_DTYPES.items()
              if wire.get(name) is not None}
    assert {"response_token_ids", "logprobs", "versions", "loss_mask", "turn_ends"} <= set(arrays)
    mask, ends = arrays["loss_mask"], arrays["turn_ends"]
    assert mask.tolist() == [1, 1, 1, 0, 0, 1, 1] and ends.tolist() == [5, 7]
    # the doc's reading: turn k is [ends[k-1], ends[k]); mask 1 the model's, 0 the observation's
    starts = [0, *ends[:-1]]
    spans = [(int(np.sum(mask[a:b] == 1)), int(np.sum(mask[a:b] == 0)))
             for a, b in zip(starts, ends)]
    assert spans == turns
    assert (arrays["versions"][mask == 0] == -1).all() and (arrays["logprobs"][mask == 0] == 0).all()
    assert wire["finish_reason"] == "length"
    assert wire["episode"]["truncated"] == "max_turns" and wire["episode"]["turns"] == 2


def test_a_conversation_reads_from_the_prompt_tasks_metadata():
    messages = ({"role": "system", "content": "Add."}, {"role": "user", "content": "2+3="})
    task = prompt_task(Problem(task_id="q", prompt="Add.\n2+3=", answer="5", messages=messages))
    record = msgpack.unpackb(encode(task), raw=False)
    assert record["type"] == "prompt_task" and record["prompt"] == "Add.\n2+3="
    assert json.loads(record["metadata"]["messages"]) == list(messages)
