"""The durable embedded bus (`embedded://PATH`): what one process acknowledged and committed is
there for the next one, after a clean close and after `kill -9`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from miles.bus import TopicPartition, open_bus
from miles.protocol.topics import run_topics, topic_name

WRITER = """
import asyncio, sys
from miles.bus import open_bus
from miles.protocol.topics import run_topics, topic_name

async def main(url):
    async with open_bus(url) as bus:
        await bus.create_topics(run_topics("w", prompt_partitions=2, trajectory_partitions=2))
        topic = topic_name("w", "trajectories")
        async with bus.consumer([topic], group_id="g") as consumer:
            for i in range(10**9):
                delivery = await bus.publish(topic, str(i).encode() * 50, key=str(i).encode())
                await consumer.poll(timeout_s=0)
                await consumer.commit()
                print(delivery.partition, delivery.offset, flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def test_records_offsets_and_topics_outlive_the_bus(tmp_path):
    url = f"embedded://{tmp_path / 'bus'}"
    topic = topic_name("r", "trajectories")
    async with open_bus(url) as bus:
        await bus.create_topics(run_topics("r", prompt_partitions=1, trajectory_partitions=3))
        for i in range(9):
            await bus.publish(topic, f"v{i}".encode(), key=f"k{i}".encode(),
                              headers=[("h", b"x")])
        async with bus.consumer([topic], group_id="g") as consumer:
            first = await consumer.poll(max_records=4, timeout_s=1)
            await consumer.commit()
    async with open_bus(url) as bus:
        assert (await bus.describe_topics([topic]))[topic].partitions == 3
        ends = await bus.topic_offsets([topic])
        assert sum(end for _, end in ends.values()) == 9
        async with bus.consumer([topic], group_id="g") as consumer:
            rest = []
            while batch := await consumer.poll(timeout_s=0.2):
                rest.extend(batch)
        await bus.publish(topic, b"after", key=b"k0")  # appends after the reloaded records
    seen = sorted(r.value for r in first + rest)
    assert seen == sorted(f"v{i}".encode() for i in range(9))
    assert all(r.headers == (("h", b"x"),) for r in rest)
    async with open_bus(url) as bus:
        tp = next(tp for tp in (await bus.topic_offsets([topic]))
                  if any(r.key == b"k0" for r in first + rest if r.tp == tp))
        async with bus.consumer([topic], group_id="other") as consumer:
            consumer.seek(tp, 0)
            values = [r.value for r in await consumer.poll(timeout_s=0.2) if r.tp == tp]
        assert values[-1] == b"after"


async def test_a_torn_tail_is_cut_and_the_log_goes_on(tmp_path):
    url = f"embedded://{tmp_path / 'bus'}"
    topic = topic_name("t", "trajectories")
    async with open_bus(url) as bus:
        await bus.create_topics(run_topics("t", prompt_partitions=1, trajectory_partitions=1))
        for i in range(3):
            await bus.publish(topic, f"v{i}".encode())
    log = tmp_path / "bus" / "topics" / topic / "0.log"
    whole = log.read_bytes()
    log.write_bytes(whole + whole[:7])  # half a frame, as a kill mid-write would leave
    async with open_bus(url) as bus:
        assert (await bus.topic_offsets([topic]))[TopicPartition(topic, 0)] == (0, 3)
        delivery = await bus.publish(topic, b"v3")
        assert delivery.offset == 3
    async with open_bus(url) as bus:  # v3 follows the whole frames, not the torn one
        async with bus.consumer([topic], group_id="g") as consumer:
            values = [r.value for r in await consumer.poll(timeout_s=0.2)]
    assert values == [b"v0", b"v1", b"v2", b"v3"]


async def test_what_a_killed_writer_acknowledged_is_all_there(tmp_path):
    url = f"embedded://{tmp_path / 'bus'}"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    acked = []
    deadline = time.monotonic() + 60
    while len(acked) < 300 and time.monotonic() < deadline:
        acked.append(tuple(int(x) for x in writer.stdout.readline().split()))
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert len(acked) == 300
    topic = topic_name("w", "trajectories")
    async with open_bus(url) as bus:
        ends = {tp.partition: end for tp, (_, end) in (await bus.topic_offsets([topic])).items()}
        committed = (await bus.group_offsets([topic]))["g"]
    for partition, offset in acked:
        assert offset < ends[partition]
    for tp, offset in committed.items():
        assert offset <= ends[tp.partition]
    assert sum(committed.values()) >= len(acked) - 2  # each commit followed its publish
    groups = json.loads((Path(tmp_path) / "bus" / "groups" / "g.json").read_text())
    assert groups["group_id"] == "g"
