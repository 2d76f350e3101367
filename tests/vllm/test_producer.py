"""The producer daemon on real vLLM over the real broker: `engine=vllm` and `engine=vllm-server`
producers feed a trainer process for a few steps and hot-load the versions it announces; a
vLLM server killed mid-run and started again is retried through, and the run goes on."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from miles.bus import open_bus  # noqa: E402
from miles.feeder import feed  # noqa: E402
from miles.protocol import TrajectoryGroup, decode  # noqa: E402
from miles.protocol.topics import run_topics, topic_name  # noqa: E402
from miles.tasks.arithmetic import arithmetic_problems  # noqa: E402
from miles.weights.signing import generate_key_pair  # noqa: E402
from tests.accounting import ledger  # noqa: E402
from tests.conftest import unique_run  # noqa: E402
from tests.kafka.test_rl_processes import spawn, trainer_settings, wait_exit  # noqa: E402
from tests.vllm.conftest import MAX_MODEL_LEN, TIER  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
STEP_WAIT_S = 400.0  # a producer's vLLM start-up takes a minute or two on a busy 2-core machine


def engine_settings(engine: str, server=None) -> list[str]:
    if engine == "vllm-server":
        return ["engine=vllm-server", f"vllm_server.base_url={server.url}",
                "vllm_server.adapter_prefix=producer-test", "vllm_server.timeout_s=60"]
    s = TIER.settings
    return ["engine=vllm", f"vllm.dtype={s.dtype}", f"vllm.max_model_len={MAX_MODEL_LEN}",
            "vllm.enforce_eager=true", f"vllm.kv_cache_gib={s.kv_cache_gib}",
            f"vllm.gpu_memory_utilization={s.gpu_memory_utilization}"]


async def start_run(kafka_broker, model_dir: Path, tmp_path: Path, engine: list[str],
                    steps: int, rollout: tuple[str, ...] = ("rollout.prompts_per_batch=4",)):
    run = unique_run()
    async with open_bus(kafka_broker.url) as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        await feed(bus, run, arithmetic_problems("train")[:400])
    _, public_key = generate_key_pair(tmp_path / "out" / "keys")
    producer = spawn("producers.rollout", [
        f"bus={kafka_broker.url}", f"model_dir={model_dir}", *engine,
        "reward=tests.rewards:starts_with_digit", f"rollout.run={run}",
        *rollout, "rollout.groups_per_step=4", "rollout.max_staleness=1",
        "rollout.sampling.n=4", "rollout.sampling.max_new_tokens=4", "rollout.heartbeat_s=0.5",
        f"rollout.weights.store={tmp_path / 'out' / 'weights'}",
        f"rollout.weights.public_key={public_key}"], tmp_path / "producer.log")
    trainer = spawn("consumers.trainer", trainer_settings(
        kafka_broker.url, run, model_dir, tmp_path / "out", groups_per_step=4, max_steps=steps,
        max_staleness=1), tmp_path / "trainer.log")
    return run, producer, trainer


def stop(producer, log: Path) -> str:
    producer.send_signal(signal.SIGTERM)
    assert producer.wait(timeout=120) == 0, log.read_text()[-3000:]
    return log.read_text()


async def trained_groups(kafka_broker, run: str, count: int) -> list[TrajectoryGroup]:
    async with open_bus(kafka_broker.url) as bus:
        async with bus.consumer([topic_name(run, "trajectories")], group_id="audit") as audit:
            records, deadline = [], time.monotonic() + 60
            while len(records) < count and time.monotonic() < deadline:
                records += await audit.poll(timeout_s=0.5)
    return [decode(r.value, TrajectoryGroup) for r in records]


async def test_an_in_process_vllm_producer_trains_with_the_trainer(kafka_broker, vllm_model_dir,
                                                                   tmp_path):
    run, producer, trainer = await start_run(kafka_broker, vllm_model_dir, tmp_path,
                                             engine_settings("vllm"), steps=3)
    try:
        wait_exit(trainer, tmp_path / "trainer.log", STEP_WAIT_S)
    finally:
        log = stop(producer, tmp_path / "producer.log")
    assert "loaded policy version 2" in log or "loaded policy version 3" in log, log[-3000:]
    assert [e["step"] for e in ledger(tmp_path / "out")] == [1, 2, 3]
    groups = await trained_groups(kafka_broker, run, 12)
    assert {g.engine for g in groups} == {"vllm"}
    assert max(int(s.versions.max()) for g in groups for s in g.samples) >= 1


async def test_a_streaming_server_producer_trains_with_the_trainer(kafka_broker, vllm_server,
                                                                   vllm_model_dir, tmp_path):
    """`rollout.max_in_flight=4` on the server engine: one request per group, up to four at
    once; versions load while requests run (`finish`: those end on their adapter)."""
    run, producer, trainer = await start_run(
        kafka_broker, vllm_model_dir, tmp_path, engine_settings("vllm-server", vllm_server),
        steps=4, rollout=("rollout.max_in_flight=4", "rollout.weight_update=finish"))
    try:
        wait_exit(trainer, tmp_path / "trainer.log", STEP_WAIT_S)
    finally:
        log = stop(producer, tmp_path / "producer.log")
    assert "loaded policy version 2" in log or "loaded policy version 3" in log, log[-3000:]
    assert [e["step"] for e in ledger(tmp_path / "out")] == [1, 2, 3, 4]
    groups = await trained_groups(kafka_broker, run, 16)
    assert {g.engine for g in groups} == {"vllm-server"}
    assert all(s.versions.min() == s.versions.max() for g in groups for s in g.samples)
    assert max(int(s.versions.max()) for g in groups for s in g.samples) >= 1


async def test_a_server_producer_survives_a_server_restart(kafka_broker, vllm_server,
                                                           vllm_model_dir, tmp_path):
    """Kill -9 the server once the trainer has taken two steps, start it again on the same
    port: the producer sees the outage (a failed batch or a version that does not load yet),
    loads its adapter into the new server, and the trainer reaches its last step on versions
    announced after the restart. Ten steps, so the kill lands well before the end: the tiny
    trainer takes a step in a fraction of a second, and with four steps it could finish on
    groups already published before the kill (CI of 7eb1d7b)."""
    steps = 10
    run, producer, trainer = await start_run(kafka_broker, vllm_model_dir, tmp_path,
                                             engine_settings("vllm-server", vllm_server), steps)
    try:
        deadline = time.monotonic() + STEP_WAIT_S
        while len(ledger(tmp_path / "out")) < 2:
            assert trainer.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "trainer.log").read_text()[-3000:]
            time.sleep(0.1)
        vllm_server.kill()
        killed_at_step = len(ledger(tmp_path / "out"))
        log_before = (tmp_path / "producer.log").stat().st_size
        time.sleep(5.0)  # the producer's batches or weight loads fail meanwhile
        vllm_server.start()
        wait_exit(trainer, tmp_path / "trainer.log", STEP_WAIT_S)
    finally:
        log = stop(producer, tmp_path / "producer.log")
    after = log.encode()[log_before:].decode(errors="replace")
    assert "generation failed, retrying" in after or "does not load" in after, log[-3000:]
    assert "loaded policy version" in after, log[-3000:]
    assert killed_at_step <= steps - 4, f"the trainer was at step {killed_at_step} at the kill"
    assert [e["step"] for e in ledger(tmp_path / "out")] == list(range(1, steps + 1))
    groups = await trained_groups(kafka_broker, run, 4 * steps)
    assert {g.engine for g in groups} == {"vllm-server"}
    # versions up to killed_at_step (+1 for a step taken during the kill) were announced before
    # the kill; anything newer was generated by the restarted server
    assert max(int(s.versions.max()) for g in groups for s in g.samples) >= killed_at_step + 2
