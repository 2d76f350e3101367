"""Bus throughput: Miles' `KafkaBus` against Kafka's own perf tools, on one broker, in one session.

Run by hand (not a test), from the repository root:

    MILES_KAFKA_LIBS=/path/to/jars python benchmarks/bench_bus.py [--sizes 65536,1048576]
        [--megabytes 256] [--repeats 3] [--uvloop] [--bootstrap HOST:PORT]

For each record size it measures, in MB/s and records/s (MB = 2**20 bytes, as Kafka's tools count):
  miles publish     pipelined `bus.send` of N records, first send to last acknowledgement (acks=all)
  miles consume     a fresh group reading that topic from the start, assignment to last record
  miles end-to-end  publisher and consumer in two processes (as the rollout producer and the
                    trainer are) on a fresh topic, from the first send to the last record consumed
  java producer     `org.apache.kafka.tools.ProducerPerformance`, Miles' producer settings
  java consumer     `org.apache.kafka.tools.ConsumerPerformance` on the topic `miles publish` wrote;
                    its fetch rate, which also leaves out the group join
Miles and Java take turns within each of `--repeats` rounds; the table shows each row's median
round and the range, since a shared machine makes single runs noisy. The target (issue): at 1 MiB
records, miles end-to-end >= 50% of min(java producer, java consumer).

Payload: random trajectory-like bytes, half int32 token ids (uniform over a 151,936 vocab), half
float32 logprobs (-Exp(0.7)), with every byte's top bit cleared and newlines replaced. The clearing
is the one concession: ProducerPerformance reads payloads from a UTF-8 text file split at newlines,
so only 7-bit bytes without '\n' reach the broker unchanged. Both sides draw records uniformly from
the same pool of ~32 MiB of such payloads; the printed zstd ratio shows how compressible they are.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import multiprocessing
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles import broker  # noqa: E402  (after the path insert, so it runs from a checkout)
from miles.bus import open_bus  # noqa: E402
from miles.bus.kafka import COMPRESSION, LINGER_MS, MAX_BATCH_BYTES  # noqa: E402
from miles.protocol.topics import (CONSUMER_FETCH_MAX_BYTES,  # noqa: E402
                                   CONSUMER_MAX_PARTITION_FETCH_BYTES,
                                   PRODUCER_MAX_REQUEST_BYTES, TopicSpec, _base_configs)

MB = 1024 * 1024
VOCAB_SIZE = 151_936
POOL_BYTES = 32 * MB
POLL_RECORDS = 500
STALL_S = 30.0
TOOL_HEAP = "512m"
BROKER_HEAP = "1g"
TOOL_TIMEOUT_S = 300.0
TOOL_LOG4J2 = """\
status = warn
appender.console.type = Console
appender.console.name = STDERR
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = STDERR
"""


@dataclass(frozen=True)
class Row:
    """One measurement: `records` records of `size` bytes (`megabytes` MiB) in `seconds`."""

    size: int
    tool: str
    records: int
    seconds: float
    megabytes: float

    @property
    def mb_per_s(self) -> float:
        return self.megabytes / self.seconds

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds


# ---------------------------------------------------------------------------------------- payload

def make_payloads(size: int, pool_bytes: int = POOL_BYTES, seed: int = 0) -> list[bytes]:
    """Distinct trajectory-like payloads of `size` bytes, 7-bit clean and newline free."""
    rng = np.random.default_rng(seed)
    count = max(1, pool_bytes // size)
    half = size // 8  # int32 ids then float32 logprobs, 4 bytes each
    payloads = []
    for _ in range(count):
        ids = rng.integers(0, VOCAB_SIZE, half, dtype="<i4")
        logprobs = (-rng.exponential(0.7, size // 4 - half)).astype("<f4")
        raw = np.frombuffer(ids.tobytes() + logprobs.tobytes(), np.uint8) & 0x7F
        raw[raw == ord("\n")] = ord("\v")
        payloads.append(raw.tobytes().ljust(size, b"\0"))
    return payloads


def zstd_ratio(payloads: list[bytes]) -> float:
    import cramjam  # aiokafka's zstd backend

    sample = b"".join(payloads[:16])
    return len(bytes(cramjam.zstd.compress(sample, level=3))) / len(sample)


# ------------------------------------------------------------------------------------ miles side

async def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    async with open_bus(f"kafka://{bootstrap}") as bus:
        await bus.create_topics([TopicSpec(name=name, partitions=partitions,
                                           configs=_base_configs(-1))])


async def publish(bootstrap: str, topic: str, payloads: list[bytes], n: int) -> tuple[float, float]:
    """Send `n` pooled payloads pipelined; returns (first send, last ack) monotonic times."""
    pick = random.Random(1)
    async with open_bus(f"kafka://{bootstrap}") as bus:
        start = time.monotonic()
        deliveries = [await bus.send(topic, pick.choice(payloads)) for _ in range(n)]
        await asyncio.gather(*deliveries)
        return start, time.monotonic()


async def consume(bootstrap: str, topic: str, n: int,
                  ready: Callable[[], None] | None = None) -> tuple[float, float, int]:
    """Read `n` records in a fresh group; returns (assigned, last record) times and value bytes."""
    assigned_at: list[float] = []

    async def on_assigned(tps) -> None:
        if tps and not assigned_at:
            assigned_at.append(time.monotonic())
            if ready is not None:
                ready()

    group = f"bench-{uuid.uuid4().hex[:8]}"
    async with (open_bus(f"kafka://{bootstrap}") as bus,
                bus.consumer([topic], group_id=group, on_assigned=on_assigned) as consumer):
        count = nbytes = 0
        last_progress = time.monotonic()
        while count < n:
            records = await consumer.poll(max_records=POLL_RECORDS, timeout_s=1.0)
            now = time.monotonic()
            if records:
                last_progress = now
            elif now - last_progress > STALL_S:
                raise RuntimeError(f"consumer of {topic} stalled at {count}/{n} records")
            count += len(records)
            nbytes += sum(len(r.value) for r in records)
        return assigned_at[0], time.monotonic(), nbytes


def run_async(coro, use_uvloop: bool):
    if use_uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def _consumer_process(bootstrap: str, topic: str, n: int, use_uvloop: bool, conn) -> None:
    """Child of the end-to-end run: says 'ready' once assigned, then sends its timings."""
    result = run_async(consume(bootstrap, topic, n, ready=lambda: conn.send("ready")), use_uvloop)
    conn.send(result)


def miles_rows(bootstrap: str, size: int, n: int, payloads: list[bytes], partitions: int,
               use_uvloop: bool, run_id: str) -> tuple[list[Row], str]:
    """publish, consume and end-to-end rows; also the topic that `publish` wrote."""
    suffix = " (uvloop)" if use_uvloop else ""
    topic = f"bench.{run_id}.{size}" + (".uv" if use_uvloop else "")
    e2e_topic = f"{topic}.e2e"
    for name in (topic, e2e_topic):
        asyncio.run(create_topic(bootstrap, name, partitions))
    mb = n * size / MB

    start, end = run_async(publish(bootstrap, topic, payloads, n), use_uvloop)
    rows = [Row(size, f"miles publish{suffix}", n, end - start, mb)]
    assigned, last, nbytes = run_async(consume(bootstrap, topic, n), use_uvloop)
    rows.append(Row(size, f"miles consume{suffix}", n, last - assigned, nbytes / MB))

    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=_consumer_process, args=(bootstrap, e2e_topic, n, use_uvloop, child))
    process.start()
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError("end-to-end consumer was not assigned its partitions in 120 s")
        start, _ = run_async(publish(bootstrap, e2e_topic, payloads, n), use_uvloop)
        if not parent.poll(TOOL_TIMEOUT_S):
            raise RuntimeError("end-to-end consumer did not finish")
        _, last, nbytes = parent.recv()
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    rows.append(Row(size, f"miles end-to-end{suffix}", n, last - start, nbytes / MB))
    return rows, topic


# ------------------------------------------------------------------------------------- java side

def run_tool(libs: Path, log_config: Path, main_class: str, *args: str) -> str:
    cmd = broker.java_command(libs, main_class, *args, heap=TOOL_HEAP, log_config=log_config)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"{main_class} failed ({result.returncode}):\n{result.stdout}\n"
                           f"{result.stderr}")
    return result.stdout


def java_producer_row(libs: Path, log_config: Path, bootstrap: str, topic: str, size: int,
                      n: int, payload_file: Path) -> Row:
    props = [f"bootstrap.servers={bootstrap}", "acks=all", "enable.idempotence=true",
             f"compression.type={COMPRESSION}", f"linger.ms={LINGER_MS}",
             f"batch.size={MAX_BATCH_BYTES}", f"max.request.size={PRODUCER_MAX_REQUEST_BYTES}"]
    out = run_tool(libs, log_config, "org.apache.kafka.tools.ProducerPerformance",
                   "--topic", topic, "--num-records", str(n), "--throughput", "-1",
                   "--payload-file", str(payload_file), "--producer-props", *props)
    matches = re.findall(r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\)", out)
    if not matches or int(matches[-1][0]) != n:
        raise RuntimeError(f"unexpected ProducerPerformance output:\n{out}")
    records_per_s = float(matches[-1][1])
    return Row(size, "java producer", n, n / records_per_s, n * size / MB)


def java_consumer_row(libs: Path, log_config: Path, bootstrap: str, topic: str, size: int,
                      n: int, config_file: Path) -> Row:
    out = run_tool(libs, log_config, "org.apache.kafka.tools.ConsumerPerformance",
                   "--bootstrap-server", bootstrap, "--topic", topic, "--messages", str(n),
                   "--timeout", str(int(STALL_S * 1000)),
                   "--fetch-size", str(CONSUMER_MAX_PARTITION_FETCH_BYTES),
                   "--consumer.config", str(config_file),
                   "--group", f"bench-java-{uuid.uuid4().hex[:8]}")
    lines = [line for line in out.splitlines() if line.count(",") >= 9]
    stats = {k.strip(): v.strip() for k, v in zip(*csv.reader(lines[-2:]))}
    consumed = int(stats["data.consumed.in.nMsg"])
    if consumed < n:
        raise RuntimeError(f"ConsumerPerformance read {consumed}/{n} records:\n{out}")
    seconds = float(stats["fetch.time.ms"]) / 1000
    return Row(size, "java consumer", consumed, seconds, float(stats["data.consumed.in.MB"]))


# ---------------------------------------------------------------------------------------- report

def machine_facts(payload_note: str, load_before: float) -> list[str]:
    import aiokafka
    import cramjam
    import uvloop

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr
    return [f"- nproc: {os.cpu_count()} ({cpu})",
            f"- python {platform.python_version()}, aiokafka {aiokafka.__version__}, "
            f"cramjam {cramjam.__version__}, uvloop {uvloop.__version__}, numpy {np.__version__}",
            f"- {java.splitlines()[0]}; Kafka {broker.KAFKA_VERSION} (KRaft, one node, broker heap "
            f"{BROKER_HEAP}, tool heap {TOOL_HEAP}), all on this machine",
            f"- producer: acks=all, idempotent, {COMPRESSION}, linger {LINGER_MS} ms, "
            f"batch {MAX_BATCH_BYTES // 1024} KiB; {payload_note}",
            f"- 1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
            "(anything above ~0 before means other work shared the cores)"]


def median_rows(samples: list[Row]) -> dict[tuple[int, str], tuple[Row, float, float]]:
    """Per (size, tool): the median repeat and the lowest and highest MB/s of all repeats."""
    groups: dict[tuple[int, str], list[Row]] = {}
    for row in samples:
        groups.setdefault((row.size, row.tool), []).append(row)
    return {key: (sorted(rows, key=lambda r: r.mb_per_s)[len(rows) // 2],
                  min(r.mb_per_s for r in rows), max(r.mb_per_s for r in rows))
            for key, rows in groups.items()}


def table(samples: list[Row]) -> list[str]:
    summary = median_rows(samples)
    lines = ["| size | tool | records | MB/s | MB/s range | records/s | e2e / min(java) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for (size, tool), (row, low, high) in summary.items():
        ratio = ""
        java = [r.mb_per_s for (s, t), (r, _, _) in summary.items()
                if s == size and t.startswith("java")]
        if "end-to-end" in tool and java:
            ratio = f"{row.mb_per_s / min(java):.0%}"
        label = f"{size // 1024} KiB" if size < MB else f"{size // MB} MiB"
        lines.append(f"| {label} | {tool} | {row.records} | {row.mb_per_s:.1f} | "
                     f"{low:.0f}-{high:.0f} | {row.records_per_s:.0f} | {ratio} |")
    return lines


def progress(rows: list[Row]) -> None:
    for row in rows:
        print(f"  {row.size:>8} {row.tool:<26} {row.mb_per_s:7.1f} MB/s", flush=True)


# ------------------------------------------------------------------------------------------ main

def bench(bootstrap: str, args: argparse.Namespace, workdir: Path) -> tuple[list[Row], list[str]]:
    """Every measurement of every size, `args.repeats` times, Miles and Java interleaved."""
    libs = broker.ensure_kafka_libs()
    log_config = workdir / "tools-log4j2.properties"
    log_config.write_text(TOOL_LOG4J2)
    consumer_config = workdir / "consumer.properties"
    consumer_config.write_text(f"fetch.max.bytes={CONSUMER_FETCH_MAX_BYTES}\n")
    loops = [False, True] if args.uvloop else [False]
    samples, notes = [], []
    for size in args.sizes:
        n = max(1, args.megabytes * MB // size)
        payloads = make_payloads(size)
        notes.append(f"{size // 1024} KiB: {len(payloads)} pooled payloads, zstd-3 ratio "
                     f"{zstd_ratio(payloads):.2f}")
        payload_file = workdir / f"payloads-{size}.txt"
        payload_file.write_bytes(b"\n".join(payloads))
        for repeat in range(args.repeats):
            run_id = uuid.uuid4().hex[:8]
            rows, miles_topic = [], None
            for use_uvloop in loops:
                loop_rows, topic = miles_rows(bootstrap, size, n, payloads, args.partitions,
                                              use_uvloop, run_id)
                rows += loop_rows
                miles_topic = miles_topic or topic
            java_topic = f"bench.{run_id}.{size}.java"
            asyncio.run(create_topic(bootstrap, java_topic, args.partitions))
            rows.append(java_producer_row(libs, log_config, bootstrap, java_topic, size, n,
                                          payload_file))
            rows.append(java_consumer_row(libs, log_config, bootstrap, miles_topic, size, n,
                                          consumer_config))
            print(f"repeat {repeat + 1}/{args.repeats}:")
            progress(rows)
            samples += rows
        payload_file.unlink()
    return samples, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="65536,1048576",
                        type=lambda s: [int(x) for x in s.split(",")],
                        help="record sizes in bytes, comma separated")
    parser.add_argument("--megabytes", type=int, default=256,
                        help="MiB published per size and per measurement")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every measurement; the table shows the median")
    parser.add_argument("--partitions", type=int, default=1, help="partitions per topic")
    parser.add_argument("--uvloop", action="store_true",
                        help="also measure the Miles rows on uvloop")
    parser.add_argument("--bootstrap", help="HOST:PORT of a running broker (default: start one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="miles-bench-bus-") as tmp:
        workdir = Path(tmp)
        if args.bootstrap:
            rows, notes = bench(args.bootstrap, args, workdir)
        else:
            info = broker.start_broker(data_dir=workdir / "broker", port=broker.free_port(),
                                       heap=BROKER_HEAP)
            try:
                rows, notes = bench(info.bootstrap, args, workdir)
            finally:
                broker.stop_broker(data_dir=workdir / "broker")
    print()
    print("`" + " ".join(["python", "benchmarks/bench_bus.py", *(argv or sys.argv[1:])]) + "`")
    print()
    print(*machine_facts("; ".join(notes), load_before), sep="\n")
    print()
    print(*table(rows), sep="\n")
    print(f"\n(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
