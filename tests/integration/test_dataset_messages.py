"""Conversational datasets end to end: rows with `messages` (JSONL and a saved `datasets`
dataset) are fed as prompt tasks carrying the conversation, and a producer with a chat
tokenizer starts each episode (and each single-turn group) from the chat template's rendering;
a conversation that breaks the rules on the wire is dead-lettered, not played."""

from __future__ import annotations

import json
import time

import pytest

from miles.feeder import feed
from miles.protocol import DeadLetter, PromptTask, decode, encode
from miles.protocol.topics import topic_name
from miles.tasks.datasets import load_problems
from tests.integration.test_episode_producer import chat_tokenizer_dir, produce  # noqa: F401
from tests.scripted import ScriptedEngine

ROWS = [{"messages": [{"role": "system", "content": "Add."},
                      {"role": "user", "content": f"{a}+{b}="}], "answer": a + b, "id": f"q{a}"}
        for a, b in ((2, 3), (4, 4), (1, 7))]


def rendered(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(params=["jsonl", "dataset"])
def source(request, tmp_path):
    if request.param == "jsonl":
        path = tmp_path / "chat.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
        return str(path)
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "chat")
    return str(tmp_path / "chat")


@pytest.mark.parametrize("env", ["single_turn", ""])
async def test_a_conversation_starts_from_the_chat_rendering(bus, run, chat_tokenizer_dir,
                                                             source, env):
    engine = ScriptedEngine(chat_tokenizer_dir, lambda prompt: "5")
    assert await feed(bus, run, load_problems(source), shuffle=False) == 3
    _, published, _ = await produce(bus, run, engine, env=env, groups=3)
    assert sorted(g.task_id for g in published) == ["q1", "q2", "q4"]
    for group in published:
        row = next(r for r in ROWS if r["id"] == group.task_id)
        expected = rendered(engine.tokenizer, row["messages"])
        assert engine.decode(expected).endswith("=\n<assistant>")
        assert group.prompt_token_ids.tolist() == expected
    first_prompts = {tuple(p) for prompts, _ in engine.calls for p in prompts}
    assert first_prompts == {tuple(rendered(engine.tokenizer, r["messages"])) for r in ROWS}


@pytest.mark.parametrize("env", ["single_turn", ""])
async def test_a_bad_conversation_on_the_wire_is_dead_lettered(bus, run, chat_tokenizer_dir,
                                                               env):
    engine = ScriptedEngine(chat_tokenizer_dir, lambda prompt: "5")
    good = json.dumps(ROWS[0]["messages"])
    for task_id, raw in (("bad", json.dumps([{"role": "robot", "content": "x"}])),
                         ("good", good)):
        await bus.publish(topic_name(run, "prompts"), encode(PromptTask(
            task_id=task_id, prompt="2+3=", reference="5", metadata={"messages": raw},
            created_at=time.time())), key=task_id.encode())
    _, published, _ = await produce(bus, run, engine, env=env, groups=1)
    assert [g.task_id for g in published] == ["good"]
    async with bus.consumer([topic_name(run, "dlq")], group_id="audit-dlq") as dlq:
        letters = []
        deadline = time.monotonic() + 30
        while not letters and time.monotonic() < deadline:
            letters += [decode(r.value, DeadLetter) for r in await dlq.poll(timeout_s=0.2)]
    assert len(letters) == 1 and "message 0 must be a mapping with a role" in letters[0].reason
