"""`miles tail --model-dir`: an episode group printed as a transcript a person reads (each
turn's model text apart from the environment's, its reward and finish), golden output; without
a tokenizer, the one-line summary of before."""

from __future__ import annotations

import numpy as np

from miles.experience.tail import tail
from miles.protocol import Sample, TrajectoryGroup, encode
from miles.protocol.topics import topic_name
from miles.tasks.tiny_model import build_char_tokenizer
from tests.factories import make_group

TOKENIZER = build_char_tokenizer(chat=True)
GOLDEN = """\
  prompt "12*34="
  sample 0 reward 1 finish stop
    turn 1 model "<tool>calculator: 12*34</tool>" reward 0 finish turn
    turn 1 env   "<result>408</result>"
    turn 2 model "408</s>" reward 1 finish stop
  sample 1 reward 0 finish length truncated max_new_tokens
    turn 1 model "<tool>calc" reward 0 finish length"""


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def episode(parts: list[tuple[str, int]], ends: list[int], reward: float, finish: str,
            **notes) -> Sample:
    tokens, mask = [], []
    for text, policy in parts:
        part = ids(text.removesuffix("</s>"))
        part += [TOKENIZER.eos_token_id] if text.endswith("</s>") else []
        tokens += part
        mask += [policy] * len(part)
    rewards = np.zeros(len(tokens), dtype=np.float32)
    rewards[max(i for i, m in enumerate(mask) if m)] = reward
    return Sample(response_token_ids=np.asarray(tokens, dtype=np.int32),
                  logprobs=np.where(np.asarray(mask) == 1, -0.5, 0.0).astype(np.float32),
                  versions=np.where(np.asarray(mask) == 1, 0, -1).astype(np.int32),
                  reward=reward, token_rewards=rewards, finish_reason=finish,
                  loss_mask=np.asarray(mask, dtype=np.uint8),
                  turn_ends=np.asarray(ends, dtype=np.int32),
                  episode={"turns": len(ends), **notes})


def episode_group() -> TrajectoryGroup:
    call, result = "<tool>calculator: 12*34</tool>", "<result>408</result>"
    solved = episode([(call, 1), (result, 0), ("408</s>", 1)],
                     [len(call) + len(result), len(call) + len(result) + 4], 1.0, "stop")
    cut = episode([("<tool>calc", 1)], [10], 0.0, "length", truncated="max_new_tokens")
    return make_group(prompt_token_ids=np.asarray(ids("12*34="), dtype=np.int32),
                      samples=[solved, cut], vocab_size=len(TOKENIZER))


async def test_tail_prints_an_episode_as_a_transcript(bus, run):
    await bus.publish(topic_name(run, "trajectories"), encode(episode_group()))
    (line,) = [x async for x in tail(bus, run, start="earliest", limit=1, tokenizer=TOKENIZER)]
    head, transcript = line.split("\n", 1)
    assert head.endswith(" turns [2 1] policy [34/54 10/10]"), head
    assert transcript == GOLDEN
    (plain,) = [x async for x in tail(bus, run, start="earliest", limit=1)]
    assert plain == head  # without a tokenizer: the summary line only
