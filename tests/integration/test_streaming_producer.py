"""The streaming producer (`rollout.max_in_flight`) on the embedded bus with real adapters:
groups leave the engine's running batch as they end and their prompts are committed (out of
order, never past one in flight);
a version announced mid-generation is loaded under each `weight_update` policy, and a
`continue` sample's per-token versions and logprobs are those of the weights that sampled them."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.bus import open_bus
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine
from miles.engines.vllm_server import VLLMServerEngine
from miles import rollout
from miles.errors import BusError, ConfigError, EngineError
from miles.feeder import feed
from miles.protocol import TrajectoryGroup, decode, encode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.status import collect_status, format_status
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.rewards import Scorer
from miles.weights.following import FollowConfig
from miles.weights.store import base_model_id, write_version
from producers.rollout import ProducerSettings
from tests.integration.test_hf_engine import save_adapter
from tests.integration.test_hf_stream import LOGPROB_TOLERANCE, teacher_forced
from tests.factories import tokenizer_folder
from tests.integration.test_weight_loading import wait_for
from tests.rewards import starts_with_digit
from tests.unit.test_vllm_server import VOCAB, FakeVLLM, recorded

LORA = LoraSettings(r=4, alpha=8)
LONG = SamplingParams(n=2, temperature=1.0, max_new_tokens=40)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Version 1 of a weight store: an adapter that changes the model (nonzero lora_B), with
    the peft model that scores under it."""
    store = tmp_path_factory.mktemp("stream-weights")
    models = {}

    def write(folder):
        models[1] = save_adapter(model_dir, folder, LORA, seed=1)

    record = write_version(store, policy_version=1, step=1, base_model=base_model_id(model_dir),
                           write=write)
    return store, record, models[1]


async def start(bus, run: str, model_dir, store, **settings):
    await bus.create_topics(run_topics(run, prompt_partitions=2, trajectory_partitions=1))
    engine = HFEngine(model_dir, lora=LORA)
    worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
        run=run, base_model=base_model_id(model_dir), weights=FollowConfig(store=store),
        **{"heartbeat_s": 60, "max_staleness": 100, **settings}))
    stop = asyncio.Event()
    return worker, stop, asyncio.create_task(worker.run(stop))


async def published(bus, run: str, count: int) -> list[TrajectoryGroup]:
    groups: list[TrajectoryGroup] = []
    async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit:
        while len(groups) < count:
            groups += [decode(r.value, TrajectoryGroup) for r in await audit.poll(timeout_s=1)]
    return groups


async def test_groups_stream_out_as_they_end_and_their_prompts_commit(model_dir, adapters):
    store, _, _ = adapters
    run = "stream-basic"
    fed = arithmetic_problems("train")[:16]
    async with open_bus("embedded://") as bus:
        began = time.monotonic()
        worker, stop, running = await start(bus, run, model_dir, store, max_in_flight=4,
                                            sampling=SamplingParams(n=2, max_new_tokens=12))
        most = 0

        def count_in_flight() -> bool:
            nonlocal most
            most = max(most, worker.commits.in_flight())
            return worker.counts["producer/groups"] == len(fed)

        try:
            await feed(bus, run, fed)
            await wait_for(count_in_flight, timeout_s=60)
            await worker._heartbeat()
            status = await collect_status(bus, run)
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        groups = await published(bus, run, len(fed))
        committed = (await bus.group_offsets([topic_name(run, "prompts")]))[
            f"miles.{run}.producers"]
    assert 1 < most <= 4
    assert sorted(g.task_id for g in groups) == sorted(p.task_id for p in fed)
    assert sum(committed.values()) == len(fed)  # every prompt, on both partitions
    extras = worker.stream.extras()
    assert 0 < extras["busy_fraction"] <= 1 and extras["generated_tokens_per_s"] > 0
    assert extras["length_max"] <= 12 and extras["mixed_sample_share"] == 0
    reported = status["producers"][0]["stream"]  # what `miles status` shows
    assert 0 < reported["busy_fraction"] <= 1 and reported["length_max"] <= 12
    assert "streaming busy_fraction" in format_status(status)
    assert {int(v) for g in groups for s in g.samples for v in s.versions} == {0}
    other_s = worker.counts["producer/other_s"]  # scoring, encoding, publishing, per group
    assert sum(g.timings["reward_s"] for g in groups) < other_s < time.monotonic() - began


@pytest.mark.parametrize("policy", ["continue", "finish", "restart"])
async def test_a_version_announced_mid_generation_under_each_policy(model_dir, adapters, policy):
    store, record, trained = adapters
    run = f"stream-{policy}"
    fed = arithmetic_problems("train")[:6]
    async with open_bus("embedded://") as bus:
        worker, stop, running = await start(bus, run, model_dir, store, max_in_flight=3,
                                            sampling=LONG, weight_update=policy)
        sampler = worker.stream.sampler
        try:
            await feed(bus, run, fed, shuffle=False)
            await wait_for(lambda: sampler.tokens_generated >= 30 and worker.stream.in_flight)
            started = worker.stream.in_flight
            await bus.publish(topic_name(run, "control"), encode(record))
            await wait_for(lambda: worker.counts["producer/groups"] == len(fed), timeout_s=90)
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        groups = await published(bus, run, len(fed))
    samples = [(g.prompt_token_ids.tolist(), s) for g in groups for s in g.samples]
    versions = [s.versions.tolist() for _, s in samples]
    mixed = [v for v in versions if len(set(v)) > 1]
    assert all(v == sorted(v) for v in versions)
    seen = {x for v in versions for x in v}
    assert seen == ({1} if policy == "restart" else {0, 1}) or seen == {0, 1}
    extras = worker.stream.extras()
    assert "first_token_after_version_s" in extras
    if policy == "continue":
        assert mixed and extras["mixed_sample_share"] > 0 and extras["tokens_wasted"] == 0
        base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        for prompt, s in samples:  # each token's logprob under the weights that sampled it
            tokens, at = s.response_token_ids, s.versions
            expected = torch.where(torch.tensor(at) == 0,
                                   teacher_forced(base, prompt, tokens, LONG),
                                   teacher_forced(trained, prompt, tokens, LONG))
            np.testing.assert_allclose(s.logprobs, expected.numpy(), atol=LOGPROB_TOLERANCE)
    else:
        assert not mixed and extras["mixed_sample_share"] == 0
    if policy == "finish":  # the groups running at the announcement ended on version 0
        assert sum(set(v) == {0} for v in versions) >= 2 * started
        assert extras["tokens_wasted"] == 0
    if policy == "restart":  # they were thrown away and generated again under version 1
        assert extras["tokens_wasted"] >= 30 and extras["restarted_groups"] >= 1
        assert worker.counts["producer/groups"] == len(fed)


def test_streaming_is_refused_where_it_cannot_run():
    for engine in ("vllm", "vllm-server"):  # a running vLLM request cannot change weights
        with pytest.raises(ConfigError, match=f"engine '{engine}' cannot continue.*"
                                              f"weight_update=finish"):
            ProducerSettings(engine=engine, rollout=RolloutConfig(max_in_flight=4))
        for policy in ("finish", "restart"):
            ProducerSettings(engine=engine, rollout=RolloutConfig(max_in_flight=4,
                                                                  weight_update=policy))
    with pytest.raises(ConfigError, match="max_in_flight"):
        ProducerSettings(env="calculator", rollout=RolloutConfig(max_in_flight=4))
    with pytest.raises(ConfigError, match="weight_update"):
        RolloutConfig(max_in_flight=4, weight_update="later")
    ProducerSettings(rollout=RolloutConfig(max_in_flight=4))  # hf, single-turn: fine


@pytest.mark.parametrize("policy", ["finish", "restart"])
async def test_a_version_loaded_while_server_requests_run(tmp_path, policy):
    """The vllm-server engine streams requests (against the recorded-reply server; the real one
    is tests/vllm/test_producer.py): a version announced while two groups' requests run loads
    at once; under `finish` they end on the base model, under `restart` they are sent again
    naming the new adapter and their first tokens are counted wasted."""
    fake = FakeVLLM()
    reply = recorded("completion_2x2.json")
    fake.route("POST", "/v1/completions", {**reply, "choices": reply["choices"][:2]}, delay=0.8)
    fake.route("POST", "/v1/load_lora_adapter", "Success")
    fake.route("POST", "/v1/unload_lora_adapter", "Success")
    store = tmp_path / "weights"
    record = write_version(store, policy_version=1, step=1, base_model="tiny",
                           write=lambda folder: [(folder / name).write_text("{}") for name in
                                                 ("adapter_config.json",
                                                  "adapter_model.safetensors")])
    tokenizer = tokenizer_folder(tmp_path / "tok", vocab_size=VOCAB)
    engine = VLLMServerEngine(fake.url, "tiny", tokenizer, timeout_s=5.0,
                              check_logprobs_mode=False)
    run = f"server-{policy}"
    try:
        async with open_bus("embedded://") as bus:
            await bus.create_topics(run_topics(run, prompt_partitions=1,
                                               trajectory_partitions=1))
            worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
                run=run, base_model="tiny", weights=FollowConfig(store=store), heartbeat_s=60,
                max_staleness=100, max_in_flight=2, weight_update=policy,
                sampling=SamplingParams(n=2, max_new_tokens=3)))
            stop = asyncio.Event()
            running = asyncio.create_task(worker.run(stop))
            try:
                await feed(bus, run, arithmetic_problems("train")[:2], shuffle=False)
                await wait_for(lambda: len(fake.posted("/v1/completions")) == 2)
                await bus.publish(topic_name(run, "control"), encode(record))
                await wait_for(lambda: worker.counts["producer/groups"] == 2)
            finally:
                stop.set()
                await asyncio.wait_for(running, 30)
            groups = await published(bus, run, 2)
    finally:
        fake.close()
    models = [body["model"] for body in fake.posted("/v1/completions")]
    versions = {int(v) for g in groups for s in g.samples for v in s.versions}
    extras = worker.stream.extras()
    if policy == "finish":
        assert models == ["tiny", "tiny"] and versions == {0}
        assert extras["restarted_groups"] == 0 and extras["tokens_wasted"] == 0
    else:
        assert models == ["tiny", "tiny", "miles-v1", "miles-v1"] and versions == {1}
        assert extras["restarted_groups"] == 2 and extras["tokens_wasted"] == 2 * 2 * 3
    assert fake.posted("/v1/unload_lora_adapter") == []  # the base model is never unloaded


async def test_the_server_streams_busy_fraction_counts_overlapping_requests_once(tmp_path):
    """Four groups, two at a time, each call answered after 0.5 s: the server is busy about
    1 s of wall time (the calls of a pair overlap; summed they take 2 s), reported as the
    stream's busy_fraction and as generation seconds; scoring and publishing count as
    `other_s`."""
    fake = FakeVLLM()
    reply = recorded("completion_2x2.json")
    fake.route("POST", "/v1/completions", {**reply, "choices": reply["choices"][:2]}, delay=0.5)
    engine = VLLMServerEngine(fake.url, "tiny", tokenizer_folder(tmp_path / "tok", vocab_size=VOCAB),
                              timeout_s=5.0, check_logprobs_mode=False)
    run = "server-busy"
    try:
        async with open_bus("embedded://") as bus:
            await bus.create_topics(run_topics(run, prompt_partitions=1,
                                               trajectory_partitions=1))
            worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
                run=run, heartbeat_s=60, max_staleness=100, max_in_flight=2,
                weight_update="finish", sampling=SamplingParams(n=2, max_new_tokens=3)))
            stop = asyncio.Event()
            running = asyncio.create_task(worker.run(stop))
            try:
                await feed(bus, run, arithmetic_problems("train")[:4], shuffle=False)
                await wait_for(lambda: worker.counts["producer/groups"] == 4)
            finally:
                stop.set()
                await asyncio.wait_for(running, 30)
            groups = await published(bus, run, 4)
    finally:
        fake.close()
    extras, busy_s = worker.stream.extras(), worker.counts["producer/generate_s"]
    assert 0.95 <= busy_s < 1.8, busy_s
    assert 0 < extras["busy_fraction"] <= 1
    assert 0 < sum(g.timings["reward_s"] for g in groups) < worker.counts["producer/other_s"]


@pytest.mark.parametrize("policy", ["finish", "restart"])
async def test_full_weights_wait_for_the_in_process_vllm_requests(tmp_path, monkeypatch,
                                                                  policy):
    """engine=vllm streams its groups as requests (against the fake AsyncLLM of
    tests/unit/test_vllm_engine.py; the real one is tests/vllm/test_stream.py). Full weights
    cannot load under running requests: under `finish` the load waits, holding new groups,
    until both requests in flight have ended (on version 0), and the third group starts on
    version 1; under `restart` the two are aborted at once and generated again on version 1."""
    from safetensors.torch import save_file

    from miles.engines import vllm_engine
    from tests.unit.test_vllm_engine import FAKE_VLLM

    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: FAKE_VLLM)
    engine = vllm_engine.VLLMEngine(tokenizer_folder(tmp_path / "tok", vocab_size=VOCAB),
                                    vllm_engine.VLLMEngineSettings(timeout_s=5.0), lora=None)
    llm, warmed = engine._llm, len(engine._llm.requests)
    record = write_version(tmp_path / "weights", policy_version=1, step=1, base_model="tiny",
                           fmt="full", write=lambda folder: save_file(
                               {"w": torch.zeros(2)}, folder / "model.safetensors"))
    run = f"vllm-full-{policy}"
    try:
        async with open_bus("embedded://") as bus:
            await bus.create_topics(run_topics(run, prompt_partitions=1,
                                               trajectory_partitions=1))
            worker = RolloutWorker(bus, engine, Scorer(starts_with_digit), RolloutConfig(
                run=run, base_model="tiny", weights=FollowConfig(store=tmp_path / "weights"),
                heartbeat_s=60, max_staleness=100, max_in_flight=2, weight_update=policy,
                sampling=SamplingParams(n=2, max_new_tokens=3)))
            stop = asyncio.Event()
            running = asyncio.create_task(worker.run(stop))
            try:
                llm.gate.clear()
                await feed(bus, run, arithmetic_problems("train")[:3], shuffle=False)
                await wait_for(lambda: len(llm.requests) == warmed + 2)
                await bus.publish(topic_name(run, "control"), encode(record))
                if policy == "finish":
                    await wait_for(lambda: worker.stream.holding)
                    await asyncio.sleep(0.3)
                    assert engine.policy_version == 0 and len(llm.requests) == warmed + 2
                else:
                    await wait_for(lambda: engine.policy_version == 1)
                    assert len(llm.cancelled) == 2
                llm.gate.set()
                await wait_for(lambda: worker.counts["producer/groups"] == 3)
            finally:
                stop.set()
                await asyncio.wait_for(running, 30)
            groups = await published(bus, run, 3)
    finally:
        engine.close()
    versions = [{int(v) for s in g.samples for v in s.versions} for g in groups]
    assert versions == ([{0}, {0}, {1}] if policy == "finish" else [{1}, {1}, {1}])
    assert [values["output_kind"] for _, values, _ in llm.requests[warmed:]] == ["DELTA"] * (
        3 if policy == "finish" else 5)


async def test_a_restart_whose_load_fails_generates_its_groups_again(model_dir, adapters,
                                                                     tmp_path):
    """An adapter of another rank passes the store's checks and fails in the engine: the
    groups the restart aborted are generated again under the weights kept, and stop returns."""
    store, _, _ = adapters
    wrong = write_version(tmp_path / "store", policy_version=1, step=1,
                          base_model=base_model_id(model_dir),
                          write=lambda folder: save_adapter(model_dir, folder,
                                                            LoraSettings(r=8, alpha=16), seed=2))
    run = "stream-restart-fails"
    fed = arithmetic_problems("train")[:4]
    async with open_bus("embedded://") as bus:
        worker, stop, running = await start(bus, run, model_dir, tmp_path / "store",
                                            max_in_flight=2, sampling=LONG,
                                            weight_update="restart")
        try:
            await feed(bus, run, fed, shuffle=False)
            await wait_for(lambda: worker.stream.sampler.tokens_generated >= 20)
            await bus.publish(topic_name(run, "control"), encode(wrong))
            await wait_for(lambda: worker.counts["producer/weight_errors"] == 1)
            await wait_for(lambda: worker.counts["producer/groups"] == len(fed), timeout_s=60)
        finally:
            stop.set()
            await asyncio.wait_for(running, 10)
    assert worker.stream.extras()["restarted_groups"] >= 1
    assert worker.engine.policy_version == 0


async def test_stop_gives_failing_groups_a_deadline_and_leaves_them_uncommitted(
        model_dir, adapters, monkeypatch):
    store, _, _ = adapters
    monkeypatch.setattr(rollout, "STOP_WAIT_S", 1.0)
    run = "stream-stop"
    async with open_bus("embedded://") as bus:
        worker, stop, running = await start(bus, run, model_dir, store, max_in_flight=2,
                                            sampling=LONG)
        sampler = worker.stream.sampler
        sample = sampler.step

        def breaks_mid_generation():  # two tokens, then the device is gone for good
            if sampler.steps >= 2:
                raise EngineError("the device is gone")
            return sample()

        monkeypatch.setattr(sampler, "step", breaks_mid_generation)
        try:
            await feed(bus, run, arithmetic_problems("train")[:2], shuffle=False)
            await wait_for(lambda: worker.counts["producer/engine_errors"] >= 1)
        finally:
            stop.set()
            await asyncio.wait_for(running, 10)
        committed = await bus.group_offsets([topic_name(run, "prompts")])
    assert worker.counts["producer/groups"] == 0
    assert sum(committed.get(f"miles.{run}.producers", {}).values()) == 0  # generated again


async def test_on_policy_streaming_takes_one_group_per_trainer_step(model_dir, adapters):
    """max_staleness 0 with one group per step: only the next group is fresh enough, however
    many places are free."""
    store, _, _ = adapters
    run = "stream-admission"
    async with open_bus("embedded://") as bus:
        worker, stop, running = await start(bus, run, model_dir, store, max_in_flight=4,
                                            sampling=SamplingParams(n=2, max_new_tokens=4),
                                            max_staleness=0, groups_per_step=1)
        try:
            await feed(bus, run, arithmetic_problems("train")[:4], shuffle=False)
            await wait_for(lambda: worker.waiting is not None
                           and worker.counts["producer/groups"] == 1)
            await asyncio.sleep(0.5)  # four places are free: a group too many would be out
        finally:
            stop.set()
            await asyncio.wait_for(running, 10)
    assert worker.counts["producer/groups"] == 1
    assert worker.waiting == "policy version >= 1 (loaded 0)"


async def test_a_failing_publish_ends_the_producer_at_once(model_dir, adapters, monkeypatch):
    """A group that raises (here its publish) ends the worker with that error, without the
    revocation waiting for the other groups in flight."""
    store, _, _ = adapters
    run = "stream-crash"
    async with open_bus("embedded://") as bus:
        worker, stop, running = await start(bus, run, model_dir, store, max_in_flight=3,
                                            sampling=LONG)

        async def failing_send(*args, **kwargs):
            raise BusError("the broker is gone")

        await feed(bus, run, arithmetic_problems("train")[:6], shuffle=False)
        await wait_for(lambda: worker.stream.in_flight == 3)
        monkeypatch.setattr(worker.bus, "send", failing_send)
        began = time.monotonic()
        with pytest.raises(BaseExceptionGroup) as ended:
            await asyncio.wait_for(running, 20)
        assert ended.value.subgroup(BusError) is not None
        assert time.monotonic() - began < 10
