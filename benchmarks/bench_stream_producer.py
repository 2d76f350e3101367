"""The batch barrier at the producer: the rollout worker in batches against the same worker
streaming (`rollout.max_in_flight`), side by side in one run (same engine, same cores, same
prompts x n), on the embedded bus.

    PYTHONPATH=$PWD python3 benchmarks/bench_stream_producer.py [--prompts 96] [--n 4] \
        [--prompts-per-batch 8] [--max-in-flight 8] [--max-new-tokens 256] [--skew 0.6] \
        [--repeats 2] [--threads 0] [--out runs/bench-stream-producer]

The workload is `miles.tasks.long_tail` (response length set by a difficulty digit in the prompt;
most responses short, a few 10-50x longer). Both modes run `RolloutWorker` end to end: prompts
polled from the prompts topic, generated, scored (exact match, cheap), published to the
trajectories topic, committed. `benchmarks/bench_streaming.py` measures the engine alone; this
one includes everything the producer does around it.

Per mode, the median over `repeats` of: wall s (worker start to the last group published),
published tokens and tokens/s, the engine's busy fraction (seconds inside generation: the batch
path's `generate` calls, the streaming path's decoding steps; divided by wall s), CPU seconds of
this process, and the published response lengths (p50/p90/p99/max). The tokens/s ratio
stream/batch is printed per repeat (modes of one repeat run back to back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench_streaming import add_workload_arguments, markdown_table, workload_engine

from miles.bus import open_bus
from miles.engines.hf import HFEngine
from miles.feeder import feed
from miles.protocol import TrajectoryGroup, decode
from miles.protocol.topics import run_topics, topic_name
from miles.rl.sampling import SamplingParams
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.arithmetic import Problem
from miles.tasks.long_tail import length_percentiles, long_tail_prompts
from miles.tasks.rewards import resolve_reward

async def run_mode(engine: HFEngine, mode: str, problems: list[Problem], args,
                   repeat: int) -> dict:
    run = f"{mode}-{repeat}"
    config = RolloutConfig(
        run=run, sampling=SamplingParams(n=args.n, temperature=1.0,
                                         max_new_tokens=args.max_new_tokens),
        prompts_per_batch=args.prompts_per_batch,
        max_in_flight=args.max_in_flight if mode == "stream" else 0,
        max_staleness=10**6, groups_per_step=10**6, heartbeat_s=3600, seed=repeat)
    async with open_bus("embedded://") as bus:
        await bus.create_topics(run_topics(run, prompt_partitions=1, trajectory_partitions=1))
        await feed(bus, run, problems, shuffle=False)
        worker = RolloutWorker(bus, engine, resolve_reward("exact_match"), config)
        stop = asyncio.Event()
        cpu, began = time.process_time(), time.perf_counter()
        running = asyncio.create_task(worker.run(stop))
        while worker.counts["producer/groups"] < len(problems):
            await asyncio.sleep(0.005)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        busy = worker.stream.busy_s if worker.stream else worker.counts["producer/generate_s"]
        stop.set()
        await running
        lengths = await published_lengths(bus, run, len(problems))
    tokens = worker.counts["producer/tokens"]
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall,
            "busy_fraction": busy / wall, **length_percentiles(lengths)}


async def published_lengths(bus, run: str, count: int) -> list[int]:
    groups: list[TrajectoryGroup] = []
    async with bus.consumer([topic_name(run, "trajectories")], group_id="bench") as reader:
        while len(groups) < count:
            groups += [decode(r.value, TrajectoryGroup) for r in await reader.poll(timeout_s=1)]
    return [len(s.response_token_ids) for g in groups for s in g.samples]


COLUMNS = [("mode", "mode", "s"), ("rows in engine", "rows", "d"), ("wall s", "wall_s", ".1f"),
           ("cpu s", "cpu_s", ".1f"), ("tokens", "tokens", ".0f"),
           ("tokens/s", "tokens_per_s", ".0f"), ("busy", "busy_fraction", ".2f"),
           ("p50", "p50", ".0f"), ("p90", "p90", ".0f"), ("p99", "p99", ".0f"),
           ("max", "max", ".0f")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, prompts=96, out="runs/bench-stream-producer")
    args = parser.parse_args()
    engine = workload_engine(args)
    problems = [Problem(task_id=f"t{i}", prompt=p, answer="")
                for i, p in enumerate(long_tail_prompts(args.prompts, skew=args.skew))]
    modes = ("batch", "stream")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):  # modes interleaved, so a drift in load hits both
        for mode in modes:
            runs[mode].append(asyncio.run(run_mode(engine, mode, problems, args, repeat)))
            print(json.dumps({"mode": mode, "repeat": repeat, **runs[mode][-1]}), flush=True)
    rows = [{"mode": mode, "rows": (args.max_in_flight if mode == "stream"
                                    else args.prompts_per_batch) * args.n,
             **{key: statistics.median(run[key] for run in runs[mode]) for key in runs[mode][0]}}
            for mode in modes]
    ratios = [s["tokens_per_s"] / b["tokens_per_s"] for s, b in zip(runs["stream"], runs["batch"])]
    print("stream / batch tokens/s per repeat: " + ", ".join(f"{r:.2f}x" for r in ratios)
          + f" (median {statistics.median(ratios):.2f}x)")
    (args.out / "stream_producer.json").write_text(json.dumps(rows, indent=2))
    print(markdown_table(COLUMNS, rows))


if __name__ == "__main__":
    main()
