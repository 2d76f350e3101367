"""Episodes whose turns stream through the HF engine's continuous batcher
(`episodes.stream_turns`): the same episodes as rounds make (exact ids, masks, the model's
logprobs), a turn whose tool returned joins while other turns are mid-generation, a weight load
mid-turn is recorded per token, and a failed batch leaves nothing in the engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from miles.engines import HFEngine, LoraSettings
from miles.envs import Environment
from miles.episodes import EpisodeRunner, EpisodeSettings
from miles.errors import ConfigError, EngineError
from miles.rl.sampling import SamplingParams
from tests import envs
from tests.integration.test_episodes import prompt_task, run_episodes, trainer_logprobs
from tests.integration.test_hf_engine import save_adapter
from tests.integration.test_hf_stream import LORA

STREAM = EpisodeSettings(stream_turns=True, max_total_tokens=200)
LONG = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)  # 3 turns fit 64 positions


@pytest.fixture(autouse=True)
def fresh_counters():
    envs.Counter.seen, envs.Counter.closed = [], 0


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(model_dir)


class Timeline:
    """The sampler's steps as seen from outside: at which step each request was submitted and
    at which it finished."""

    def __init__(self, sampler, monkeypatch):
        self.sampler, self.submitted, self.finished = sampler, {}, {}
        submit, step = sampler.submit, sampler.step

        def timed_submit(*args, **kwargs):
            request = submit(*args, **kwargs)
            self.submitted[request] = sampler.steps
            return request

        def timed_step():
            done = step()
            for request in done:
                self.finished[request] = sampler.steps
            return done

        monkeypatch.setattr(sampler, "submit", timed_submit)
        monkeypatch.setattr(sampler, "step", timed_step)

    def joined_mid_flight(self) -> int:
        """Requests submitted while another was part-way through its generation."""
        return sum(any(self.submitted[o] < at < self.finished[o] - 1 for o in self.finished
                       if o is not r) for r, at in self.submitted.items())


async def test_streamed_episodes_are_the_episodes_rounds_make(engine, model_dir):
    records, runner = await run_episodes(engine, envs.Counter,
                                         [prompt_task("a"), prompt_task("b", "7*8=")],
                                         settings=STREAM)
    for record in [r for group in records for r in group]:
        sample = record.sample()
        assert len(record.turns) == 3 and record.failure is None
        assert [t.observation for t in record.turns] == [engine.encode("n=1."),
                                                         engine.encode("n=2."), []]
        mask = sample.loss_mask
        np.testing.assert_array_equal(sample.versions, np.where(mask == 1, 0, -1))
        scored = trainer_logprobs(model_dir, record.prompt, sample.response_token_ids)
        np.testing.assert_allclose(sample.logprobs[mask == 1], scored[mask == 1], atol=1e-4)
    for _, _, action in envs.Counter.seen:
        assert engine.decode(action.token_ids) == action.text
    sampler = engine.streaming_sampler()
    assert runner.rounds == sampler.steps > 3  # decoding steps, not rounds of whole turns
    assert sampler.rows_in_flight == 0 and sampler.requests_pending == 0


async def test_a_turn_whose_tool_returned_joins_while_others_generate(engine, monkeypatch):
    """The slow prompt's steps wait on a gate the test opens while the fast episodes' turns
    are part-way through: their next turns join the running batch at once (with rounds they
    would wait for the whole round to end)."""
    sampler = engine.streaming_sampler()
    timeline = Timeline(sampler, monkeypatch)
    envs.Gated.gate = asyncio.Event()

    async def open_gate_mid_turn():
        while not (envs.Counter.seen and sampler.rows_in_flight
                   and any(sampler.steps - at >= 3 for r, at in timeline.submitted.items()
                           if r not in timeline.finished)):
            await asyncio.sleep(0.001)
        envs.Gated.gate.set()

    opener = asyncio.create_task(open_gate_mid_turn())
    records, _ = await run_episodes(engine, envs.Gated,
                                    [prompt_task("slow", slow=True), prompt_task("fast")],
                                    settings=STREAM, sampling=LONG)
    await opener
    assert all(r.failure is None and len(r.turns) == 3 for g in records for r in g)
    assert timeline.joined_mid_flight() >= 1, (timeline.submitted, timeline.finished)


async def test_a_weight_load_mid_turn_is_recorded_per_token(model_dir, tmp_path, monkeypatch):
    engine = HFEngine(model_dir, lora=LORA)
    save_adapter(model_dir, tmp_path / "v1", LORA, seed=3)
    sampler = engine.streaming_sampler()
    step = sampler.step

    def step_then_load():
        done = step()
        if engine.policy_version == 0 and sampler.steps >= 3 and sampler.rows_in_flight:
            engine.load_adapter(tmp_path / "v1", 1)  # the rows in flight are part-way through
        return done

    monkeypatch.setattr(sampler, "step", step_then_load)
    records, _ = await run_episodes(engine, envs.Counter, [prompt_task("a")], settings=STREAM,
                                    sampling=LONG)
    straddling = 0
    for record in records[0]:
        policy = record.sample().versions[record.sample().loss_mask == 1]
        old = int((policy == 0).sum())
        assert 1 <= old < len(policy) and (policy[old:] == 1).all(), policy
        for turn in record.turns:
            assert turn.completion.policy_version == turn.versions[0]  # its first token's
            straddling += len(set(turn.versions.tolist())) == 2
    assert straddling >= 1  # a row in flight at the load: its turn has tokens of both


async def test_a_failed_batch_leaves_no_turn_in_the_engine(engine, monkeypatch):
    sampler = engine.streaming_sampler()
    step = sampler.step

    fail_at = sampler.steps + 5  # the engine is the module's: count from here

    def failing_step():
        if sampler.steps == fail_at:
            raise EngineError("the engine fell over")
        return step()

    monkeypatch.setattr(sampler, "step", failing_step)
    with pytest.raises(EngineError, match="fell over"):
        await run_episodes(engine, envs.Counter, [prompt_task("a"), prompt_task("b")],
                           settings=STREAM, sampling=LONG)
    assert sampler.rows_in_flight == 0 and sampler.requests_pending == 0
    assert envs.Counter.closed == 4


def test_stream_turns_needs_a_continuous_batcher_or_vllm(engine):
    class Batchless:
        name = "scripted"

    with pytest.raises(ConfigError, match="stream_turns needs the hf, vllm or vllm-server"):
        EpisodeRunner(Batchless(), Environment, STREAM, LONG, generate_in_engine=None)


async def test_a_turn_that_leaves_the_batch_unfinished_fails_the_batch(engine, monkeypatch):
    """A turn aborted behind the runner's back (another user of the engine's batcher) can never
    finish: the batch fails with an EngineError instead of stepping an empty batch forever."""
    sampler = engine.streaming_sampler()
    submit, step = sampler.submit, sampler.step
    submitted = []

    def remembered_submit(*args, **kwargs):
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    def step_then_abort_all():
        done = step()
        for request in submitted:
            sampler.abort(request)
        return done

    monkeypatch.setattr(sampler, "submit", remembered_submit)
    monkeypatch.setattr(sampler, "step", step_then_abort_all)
    with pytest.raises(EngineError, match="neither in the engine's batch nor finished"):
        await run_episodes(engine, envs.Counter, [prompt_task("a")], settings=STREAM,
                           sampling=LONG)
    assert sampler.rows_in_flight == 0 and envs.Counter.closed == 2
