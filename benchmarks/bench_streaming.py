"""The batch barrier on a long-tail workload: the HF engine's batch path against its continuous
batcher, side by side in one run (same engine, same cores, same prompts x n).

    PYTHONPATH=$PWD python3 benchmarks/bench_streaming.py [--prompts 128] [--n 4] \
        [--prompts-per-batch 8] [--max-in-flight 8] [--max-new-tokens 256] [--skew 0.6] \
        [--repeats 2] [--threads 0] [--modes batch,stream,stream-rows] [--out runs/bench-streaming]

The workload is `miles.tasks.long_tail` (a tiny model whose response length is set by a
difficulty digit in the prompt; most responses short, a few 10-50x longer). Modes:

- `batch`: the batch producer's way: `HFEngine.generate` on consecutive batches of
  `prompts-per-batch` prompts; each batch runs until its longest row ends.
- `stream`: `StreamingSampler`: up to `max-in-flight` prompts (x n rows) in flight, a new prompt
  submitted as soon as one finishes, stepped until all are done.
- `stream-rows`: the same, but a prompt is admitted whenever its n rows fit in
  `max-in-flight x n` rows in flight: a group whose other rows ended holds one row, not n.

Per mode, the median over `repeats` of: wall s, tokens generated (kept: each response's tokens,
EOS included), tokens/s (kept tokens / wall s), CPU seconds of this process and tokens per CPU
second (on a shared machine wall time measures the neighbours too; with `--threads 1` the CPU
time is the engine's work), decoding steps and CPU ms per step (a streaming step also prefills
its joiners and samples per request), `useful` = kept tokens / row-steps
computed (a row-step is one row of one decoding step; a batch computes rows x its longest
length, so rows that ended keep being computed; the continuous batcher computes only rows in
flight, so its share is 1 by construction), `occupancy` = kept tokens / (max rows x steps) (how
full the engine's batch was kept: the streaming run pays for its own drain at the end), and the
length distribution of the responses (p50/p90/p99/max). Sampling differs between the modes
(one generator per batch vs per request), so their lengths are two draws of the same mix;
tokens/s is per kept token either way. The tokens/s ratios to the first mode are printed per
repeat (paired: the modes of one repeat run back to back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from miles.engines.hf import HFEngine
from miles.rl.sampling import SamplingParams
from miles.tasks.long_tail import build_long_tail_model, length_percentiles, long_tail_prompts

MODEL = {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": 2}  # the demo's tiny model
SEED_STRIDE = 10_007  # seeds of repeat r start at r * SEED_STRIDE


def run_batch(engine: HFEngine, prompts: list[list[int]], params: SamplingParams,
              args, repeat: int) -> dict:
    lengths, row_steps, steps = [], 0, 0
    began, cpu = time.perf_counter(), time.process_time()
    for b in range(0, len(prompts), args.prompts_per_batch):
        batch = prompts[b:b + args.prompts_per_batch]
        groups = engine.generate(batch, params, seed=repeat * SEED_STRIDE + b)
        batch_lengths = [len(c.token_ids) for group in groups for c in group]
        lengths += batch_lengths
        steps += max(batch_lengths)  # the loop samples until its longest row ends
        row_steps += len(batch_lengths) * max(batch_lengths)
    return summary(time.perf_counter() - began, time.process_time() - cpu, lengths, row_steps,
                   steps, args.prompts_per_batch * params.n)


def run_stream(engine: HFEngine, prompts: list[list[int]], params: SamplingParams,
               args, repeat: int, *, by_rows: bool = False) -> dict:
    """Keep `max_in_flight` prompts in flight (`by_rows`: admit a prompt whenever its n rows fit
    in `max_in_flight * n` rows in flight, so rows that ended free their slots before their
    group does)."""
    sampler = engine.streaming_sampler()
    waiting = list(enumerate(prompts))[::-1]  # popped from the end: prompt order
    max_rows, in_flight, lengths = args.max_in_flight * params.n, 0, []
    tokens_before, steps_before = sampler.tokens_generated, sampler.steps
    began, cpu = time.perf_counter(), time.process_time()
    while waiting or in_flight:
        while waiting and (sampler.rows_in_flight + sampler.requests_pending * params.n
                           + params.n <= max_rows if by_rows else in_flight < args.max_in_flight):
            i, prompt = waiting.pop()
            sampler.submit(prompt, params, seed=repeat * SEED_STRIDE + i)
            in_flight += 1
        for request in sampler.step():
            lengths += [len(c.token_ids) for c in request.completions]
            in_flight -= 1
    return summary(time.perf_counter() - began, time.process_time() - cpu, lengths,
                   sampler.tokens_generated - tokens_before, sampler.steps - steps_before, max_rows)


def run_stream_rows(engine: HFEngine, prompts: list[list[int]], params: SamplingParams,
                    args, repeat: int) -> dict:
    return run_stream(engine, prompts, params, args, repeat, by_rows=True)


def summary(wall: float, cpu: float, lengths: list[int], row_steps: int, steps: int,
            max_rows: int) -> dict:
    tokens = sum(lengths)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu, "steps": steps, "cpu_ms_per_step": 1000 * cpu / steps,
            "useful": tokens / row_steps, "occupancy": tokens / (max_rows * steps),
            **length_percentiles(lengths)}


COLUMNS = [("mode", "mode", "s"), ("max rows", "max_rows", "d"), ("wall s", "wall_s", ".1f"),
           ("cpu s", "cpu_s", ".1f"), ("tokens", "tokens", ".0f"),
           ("tokens/s", "tokens_per_s", ".0f"), ("tokens/cpu-s", "tokens_per_cpu_s", ".0f"),
           ("steps", "steps", ".0f"), ("cpu ms/step", "cpu_ms_per_step", ".1f"),
           ("useful", "useful", ".2f"), ("occupancy", "occupancy", ".2f"), ("p50", "p50", ".0f"),
           ("p90", "p90", ".0f"), ("p99", "p99", ".0f"), ("max", "max", ".0f")]


def markdown_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """`rows` as a Markdown table; each column is (header, key, format spec)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(format(r[key], spec) for _, key, spec in columns) + " |"
              for r in rows]
    return "\n".join(lines)


def add_workload_arguments(parser: argparse.ArgumentParser, *, prompts: int, out: str) -> None:
    """The long-tail workload's options (shared with bench_stream_producer.py)."""
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompts-per-batch", type=int, default=8)
    parser.add_argument("--max-in-flight", type=int, default=8, help="prompts (x n rows)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--skew", type=float, default=0.6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path(out))


def workload_engine(args) -> HFEngine:
    """The long-tail model (built into `args.out` once) in an HF engine."""
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    if not (model_dir / "config.json").exists():
        build_long_tail_model(model_dir, max_positions=args.max_new_tokens + 64, **MODEL)
    return HFEngine(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, prompts=128, out="runs/bench-streaming")
    parser.add_argument("--modes", default="batch,stream,stream-rows")
    args = parser.parse_args()
    engine = workload_engine(args)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    prompts = [engine.encode(p) for p in long_tail_prompts(args.prompts, skew=args.skew)]
    warm = SamplingParams(n=2, max_new_tokens=4)
    engine.generate(prompts[:2], warm)
    sampler = engine.streaming_sampler()
    request = sampler.submit(prompts[0], warm)
    while not request.done:
        sampler.step()
    runners = {"batch": run_batch, "stream": run_stream, "stream-rows": run_stream_rows}
    max_rows = {"batch": args.prompts_per_batch * args.n, "stream": args.max_in_flight * args.n,
                "stream-rows": args.max_in_flight * args.n}
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):  # modes interleaved, so a drift in load hits both
        for mode in modes:
            runs[mode].append(runners[mode](engine, prompts, params, args, repeat))
            print(json.dumps({"mode": mode, "repeat": repeat, **runs[mode][-1]}), flush=True)
    rows = []
    for mode in modes:
        row = {key: statistics.median(run[key] for run in runs[mode]) for key in runs[mode][0]}
        rows.append({"mode": mode, "max_rows": max_rows[mode], "threads": torch.get_num_threads(),
                     **{k: round(v, 4) for k, v in row.items()}})
    for mode in modes[1:]:  # paired per repeat, so a drift in load between repeats cancels
        for key in ("tokens_per_s", "tokens_per_cpu_s"):
            ratios = [run[key] / first[key] for run, first in zip(runs[mode], runs[modes[0]])]
            print(f"{mode} / {modes[0]} {key} per repeat: "
                  + ", ".join(f"{r:.2f}x" for r in ratios)
                  + f" (median {statistics.median(ratios):.2f}x)")
    (args.out / "streaming.json").write_text(json.dumps(rows, indent=2))
    print(markdown_table(COLUMNS, rows))


if __name__ == "__main__":
    main()
