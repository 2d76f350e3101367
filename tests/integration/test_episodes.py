"""The episode runner on the real HF engine and the tiny model: token-in/token-out contexts,
masks, versions, turn ends and rewards; limits; scheduling (a slow environment holds nobody);
failures recorded; single-turn tasks give exactly today's samples."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engines import HFEngine
from miles.envs import SingleTurn, load_environment
from miles.episodes import EpisodeRunner, EpisodeSettings
from miles.protocol import PromptTask, TrajectoryGroup, decode, encode
from miles.rl.sampling import SamplingParams
from miles.tasks.rewards import resolve_reward
from tests import envs

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=5)
WAIT_S = 120.0  # bound on any wait of these tests (a stalled runner fails, never hangs)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(model_dir)


@pytest.fixture(autouse=True)
def fresh_counters():
    envs.Counter.seen, envs.Counter.closed = [], 0


def prompt_task(name: str, prompt: str = "2+3=", **metadata) -> PromptTask:
    return PromptTask(task_id=name, prompt=prompt, reference="5",
                      metadata={"name": name, **metadata}, created_at=0.0)


async def run_episodes(engine, factory, tasks, *, settings=EpisodeSettings(),
                       sampling=SAMPLING, seed=0, calls=None):
    async def generate(prompts, params, **kwargs):
        if calls is not None:
            calls.append((prompts, params, kwargs, time.monotonic()))
        return await asyncio.to_thread(engine.generate, prompts, params, **kwargs)

    runner = EpisodeRunner(engine, factory, settings, sampling, generate_in_engine=generate)
    prompts = [(t, engine.encode(t.prompt)) for t in tasks]
    records = await asyncio.wait_for(runner.run(prompts, seed), WAIT_S)
    return records, runner


def trainer_logprobs(model_dir, prompt: list[int], response: np.ndarray) -> np.ndarray:
    """Logprobs of every response token under one forward over prompt + response ([T])."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt + response.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [T, V]
    return logits.log_softmax(-1).gather(-1, torch.from_numpy(response).long()[:, None])[:, 0] \
        .numpy()


async def test_an_episode_is_its_sampled_tokens_and_its_observations_once(engine, model_dir):
    calls = []
    records, runner = await run_episodes(engine, envs.Counter,
                                         [prompt_task("a"), prompt_task("b", "7*8=")],
                                         calls=calls)
    assert [len(group) for group in records] == [2, 2]
    assert runner.rounds == 3  # every episode's turn k in one engine call
    assert [len(prompts) for prompts, *_ in calls] == [4, 4, 4]
    for group, task in zip(records, ["2+3=", "7*8="]):
        for record in group:
            sample = record.sample()
            turns = record.turns
            assert len(turns) == 3 and record.failure is None
            # a last turn cut by its token budget truncates the episode ("length")
            cut = turns[-1].completion.finish_reason == "length"
            assert record.truncated == ("max_new_tokens" if cut else None)
            assert record.prompt == engine.encode(task)
            expected_obs = [engine.encode("n=1."), engine.encode("n=2."), []]
            assert [t.observation for t in turns] == expected_obs
            ids = np.concatenate([np.concatenate([t.completion.token_ids,
                                                  np.asarray(t.observation, dtype=np.int32)])
                                  for t in turns])
            np.testing.assert_array_equal(sample.response_token_ids, ids)
            lengths = [len(t.completion.token_ids) for t in turns]
            mask = np.concatenate([[1] * n + [0] * len(o) for n, o in zip(lengths, expected_obs)])
            np.testing.assert_array_equal(sample.loss_mask, mask)
            np.testing.assert_array_equal(sample.versions, np.where(mask == 1, 0, -1))
            assert (sample.logprobs[mask == 0] == 0.0).all()
            ends = np.cumsum([n + len(o) for n, o in zip(lengths, expected_obs)])
            np.testing.assert_array_equal(sample.turn_ends, ends)
            last_policy = ends - np.asarray([len(o) for o in expected_obs]) - 1
            rewards = np.zeros(len(ids), dtype=np.float32)
            rewards[last_policy] = [0.25, 0.25, 1.0]
            np.testing.assert_array_equal(sample.token_rewards, rewards)
            assert sample.reward == pytest.approx(1.5)  # the return: the sum of step rewards
            assert sample.finish_reason == ("length" if cut else "stop") and sample.error is None
            assert sample.episode["turns"] == 3 and sample.episode["tool_calls"] == 4
            assert sample.episode["tool_errors"] == 1
            # what the trainer scores is what was sampled: one forward over the whole episode
            # gives the behaviour logprobs at every policy token
            scored = trainer_logprobs(model_dir, record.prompt, sample.response_token_ids)
            np.testing.assert_allclose(sample.logprobs[mask == 1], scored[mask == 1], atol=1e-4)
    # each turn's prompt was the previous context plus the observation, never re-tokenized
    for (prompts, *_), (later, *_) in zip(calls, calls[1:]):
        for before, after in zip(prompts, later):
            assert after[:len(before)] == before
    # the environment saw each turn's exact ids and their text
    for _, _, action in envs.Counter.seen:
        assert engine.decode(action.token_ids) == action.text
    assert envs.Counter.closed == 4
    group = TrajectoryGroup(group_id="g", task_id="a", prompt_token_ids=np.asarray(
        records[0][0].prompt, dtype=np.int32), samples=[r.sample() for r in records[0]],
        producer_id="p", engine="hf", vocab_size=engine.vocab_size, created_at=0.0)
    decoded = decode(encode(group))  # the 1.4 rules hold both ways
    np.testing.assert_array_equal(decoded.samples[1].loss_mask, group.samples[1].loss_mask)


@pytest.mark.parametrize("limits, reason", [
    ({"max_turns": 2}, "max_turns"),
    ({"max_total_tokens": 8}, "max_total_tokens"),
    ({"max_observation_tokens": 3}, "max_observation_tokens"),
])
async def test_limits_truncate_episodes(engine, limits, reason):
    records, _ = await run_episodes(engine, envs.Counter, [prompt_task("a")],
                                    settings=EpisodeSettings(**limits))
    for record in records[0]:
        sample = record.sample()
        assert record.truncated == reason
        assert sample.finish_reason == "length" and sample.episode["truncated"] == reason
        assert not record.turns[-1].observation  # the cut observation is not appended
        if reason == "max_turns":
            assert len(record.turns) == 2
        if reason == "max_total_tokens":
            assert len(sample.response_token_ids) <= 8
        if reason == "max_observation_tokens":
            assert len(record.turns) == 1  # "n=1." is 4 tokens
    unlimited, _ = await run_episodes(engine, envs.Counter, [prompt_task("a")])
    # the knob made the difference: without it every episode plays its 3 turns
    assert all(r.truncated in (None, "max_new_tokens") and len(r.turns) == 3
               for r in unlimited[0])


async def test_a_turn_never_samples_past_the_episodes_token_budget(engine):
    settings = EpisodeSettings(max_total_tokens=12)
    records, _ = await run_episodes(engine, envs.Counter, [prompt_task("a", turns=9)],
                                    settings=settings,
                                    sampling=SamplingParams(n=4, max_new_tokens=5))
    for record in records[0]:
        assert record.length <= 12 and record.truncated is not None


async def test_a_slow_environment_does_not_hold_the_others(engine):
    """The slow prompt's steps wait on a gate the test opens only once the fast prompt's
    episodes have finished all their turns: a runner that waited for every episode before the
    next round would never get there (bounded by WAIT_S)."""
    envs.Gated.gate = asyncio.Event()
    calls = []

    async def open_gate_when_fast_done():
        while sum(1 for name, k, _ in envs.Counter.seen if name == "fast" and k == 3) < 2:
            await asyncio.sleep(0.01)
        envs.Gated.gate.set()

    opener = asyncio.create_task(open_gate_when_fast_done())
    records, runner = await run_episodes(
        engine, envs.Gated, [prompt_task("slow", slow=True), prompt_task("fast")], calls=calls)
    await opener
    assert all(r.failure is None and len(r.turns) == 3 for g in records for r in g)
    # rounds 2 and 3 of the fast episodes ran without the slow ones
    assert [len(prompts) for prompts, *_ in calls][:3] == [4, 2, 2]
    assert runner.rounds == 5


async def test_failing_and_timed_out_environments_are_recorded(engine):
    tasks = [prompt_task("crash", fail_at=2), prompt_task("stuck", delay=5),
             prompt_task("fine")]
    records, _ = await run_episodes(engine, envs.Gated, tasks,
                                    settings=EpisodeSettings(env_step_timeout_s=0.5))
    crash, stuck, fine = records
    for record in crash:
        sample = record.sample()
        assert record.failure_kind == "env_error" and len(record.turns) == 2
        assert "the simulator crashed" in sample.error and sample.finish_reason == "abort"
        assert sample.episode["failed"] == "env_error"
    for record in stuck:
        assert record.failure_kind == "env_timeout" and "0.5 s" in record.failure
    assert all(r.failure is None and len(r.turns) == 3 for r in fine)
    assert envs.Counter.closed == 6  # closed after a failure too


async def test_single_turn_through_the_runner_is_todays_sample(engine):
    scorer = resolve_reward("tests.rewards:starts_with_digit")
    factory = load_environment("single_turn", reward=scorer)
    tasks = [prompt_task("a"), prompt_task("b", "7*8=")]
    sampling = SamplingParams(n=3, max_new_tokens=6)
    records, _ = await run_episodes(engine, factory, tasks, sampling=sampling, seed=11)
    prompts = [engine.encode(t.prompt) for t in tasks]
    today = engine.generate(prompts, sampling, seed=11)
    rewards = set()
    for group, completions in zip(records, today):
        for record, completion in zip(group, completions):
            sample = record.sample(compact=True)
            np.testing.assert_array_equal(sample.response_token_ids, completion.token_ids)
            # the same tokens; logprobs to fp32 rounding: the runner asks for 6 prompts of one
            # sample each, this call for 2 prompts of 3, and a CPU's matmul need not give the
            # same bits for other shapes (5e-7 apart on a Xeon with AMX)
            np.testing.assert_allclose(sample.logprobs, completion.logprobs, rtol=1e-6,
                                       atol=1e-6)
            np.testing.assert_array_equal(sample.versions, np.zeros(len(completion.token_ids)))
            assert sample.finish_reason == completion.finish_reason
            text = engine.decode(completion.token_ids)
            (scored,) = await scorer.score([text], ["5"], ["x"])
            assert sample.reward == scored.reward
            rewards.add(sample.reward)
            assert (sample.loss_mask, sample.turn_ends, sample.token_rewards) == (None,) * 3
            assert sample.episode == {}
    assert isinstance(factory(), SingleTurn) and rewards == {0.0, 1.0}


async def test_max_concurrent_bounds_the_episodes_in_flight(engine):
    calls = []
    await run_episodes(engine, envs.Counter, [prompt_task("a"), prompt_task("b")],
                       settings=EpisodeSettings(max_concurrent=1), calls=calls)
    assert [len(prompts) for prompts, *_ in calls] == [1] * 12  # 4 episodes x 3 turns, alone
    calls.clear()
    await run_episodes(engine, envs.Counter, [prompt_task("a"), prompt_task("b")], calls=calls)
    assert [len(prompts) for prompts, *_ in calls] == [4, 4, 4]


async def test_an_episodes_time_is_split_into_environment_and_producer_work(engine, monkeypatch):
    """Each step sleeps 30 ms in the environment, each decode 20 ms in the producer: env_s
    counts the first and never the second, work_s the second and never the first."""
    decode = engine.decode

    def slow_decode(ids):
        time.sleep(0.02)
        return decode(ids)

    monkeypatch.setattr(engine, "decode", slow_decode)
    records, _ = await run_episodes(engine, envs.Gated, [prompt_task("a", delay=0.03)],
                                    sampling=SamplingParams(n=1, max_new_tokens=3))
    (record,) = records[0]
    assert len(record.turns) == 3 and record.failure is None
    assert 0.09 <= record.env_s < 0.09 + 0.05
    assert 0.06 <= record.work_s < 0.06 + 0.05
