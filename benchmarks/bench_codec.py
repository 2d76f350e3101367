"""Codec throughput: Miles' msgpack wire format against pickle, JSON and a plain memory copy.

Run by hand (not a test), from the repository root:

    python benchmarks/bench_codec.py [--repeat 30] [--samples 16] [--tokens 1024] [--prompt 128]

One realistic `TrajectoryGroup` (default: 16 samples x 1,024 response tokens, each with token ids,
behaviour logprobs and per-token versions; a 128-token prompt) is encoded and decoded, on one
core (the process is pinned to one CPU where the OS allows), `--repeat` times; each repeat times
enough calls to last ~20 ms, and the table shows the median time per group. Time is this thread's
CPU time (`time.thread_time`), so other processes sharing the machine inflate it less than wall
time would; `--clock wall` measures wall time instead. MB = 2**20 bytes.

  miles msgpack   `encode` / `decode`, both with the full validation a consumer runs
  pickle          protocol 5 of the same dataclass (no validation; unsafe on untrusted bytes)
  json            arrays as lists of numbers; decode includes turning the lists back into
                  numpy arrays (no validation)
  memory copy     `bytes(bytearray(buf))` of a buffer the size of the msgpack record: the ceiling

MB/s is each format's own encoded size over its time; "x json" compares time per group.
Targets (issue): decode >= 1 GB/s and encode >= 500 MB/s on one core, >= 10x faster than JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles.protocol import Sample, TrajectoryGroup, decode, encode  # noqa: E402

MB = 1024 * 1024
VOCAB_SIZE = 151_936
TARGET_REPEAT_S = 0.02


def realistic_group(n_samples: int, n_tokens: int, prompt_tokens: int) -> TrajectoryGroup:
    rng = np.random.default_rng(0)
    samples = [Sample(response_token_ids=rng.integers(0, VOCAB_SIZE, n_tokens, dtype=np.int32),
                      logprobs=-rng.exponential(0.7, n_tokens).astype(np.float32),
                      versions=np.repeat(np.array([41, 42], np.int32),
                                         [n_tokens // 2, n_tokens - n_tokens // 2]),
                      reward=float(rng.integers(0, 2)), finish_reason="stop")
               for _ in range(n_samples)]
    return TrajectoryGroup(
        group_id="bench-0", task_id="gsm8k-123",
        prompt_token_ids=rng.integers(0, VOCAB_SIZE, prompt_tokens, dtype=np.int32),
        samples=samples, producer_id="producer-3", engine="vllm", vocab_size=VOCAB_SIZE,
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": n_tokens},
        reference="72", timings={"generate_s": 3.2, "reward_s": 0.01}, created_at=time.time())


def to_json(group: TrajectoryGroup) -> bytes:
    doc = {k: v for k, v in vars(group).items() if k not in ("samples", "prompt_token_ids")}
    doc["prompt_token_ids"] = group.prompt_token_ids.tolist()
    doc["samples"] = [{k: (v.tolist() if isinstance(v, np.ndarray) else v)
                       for k, v in vars(s).items()} for s in group.samples]
    return json.dumps(doc).encode()


def from_json(data: bytes) -> dict:
    doc = json.loads(data)
    doc["prompt_token_ids"] = np.asarray(doc["prompt_token_ids"], dtype=np.int32)
    for s in doc["samples"]:
        s["response_token_ids"] = np.asarray(s["response_token_ids"], dtype=np.int32)
        s["logprobs"] = np.asarray(s["logprobs"], dtype=np.float32)
        s["versions"] = np.asarray(s["versions"], dtype=np.int32)
    return doc


def seconds_per_call(fn: Callable[[], object], repeat: int, clock: Callable[[], float]) -> float:
    """Median over `repeat` rounds of the mean time of one call, each round ~20 ms long."""
    start = clock()
    for _ in range(3):
        fn()
    calls = max(1, int(3 * TARGET_REPEAT_S / max(clock() - start, 1e-7)))
    rounds = []
    for _ in range(repeat):
        start = clock()
        for _ in range(calls):
            fn()
        rounds.append((clock() - start) / calls)
    return statistics.median(rounds)


def pin_to_one_core() -> str:
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned"
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=30, help="timed rounds per measurement")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per sample")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    pinning = pin_to_one_core()
    group = realistic_group(args.samples, args.tokens, args.prompt)
    packed, pickled, jsoned = encode(group), pickle.dumps(group, protocol=5), to_json(group)
    assert decode(packed) == group and pickle.loads(pickled) == group
    copy_source = bytes(len(packed))
    rows = [
        ("miles msgpack (validated)", len(packed), lambda: encode(group), lambda: decode(packed)),
        ("pickle (protocol 5)", len(pickled), lambda: pickle.dumps(group, protocol=5),
         lambda: pickle.loads(pickled)),
        ("json (arrays as lists)", len(jsoned), lambda: to_json(group), lambda: from_json(jsoned)),
        ("memory copy (ceiling)", len(packed), lambda: bytes(bytearray(copy_source)),
         lambda: bytes(bytearray(copy_source))),
    ]
    timed = [(name, size, seconds_per_call(enc, args.repeat, clock),
              seconds_per_call(dec, args.repeat, clock)) for name, size, enc, dec in rows]
    json_enc, json_dec = timed[2][2], timed[2][3]

    print(f"TrajectoryGroup: {args.samples} samples x {args.tokens} tokens, prompt {args.prompt} "
          f"tokens; median of {args.repeat}, {args.clock} time; "
          f"python {platform.python_version()}, numpy {np.__version__}, msgpack "
          f"{'.'.join(map(str, msgpack.version))}, {platform.machine()}, {pinning}\n")
    print("| format | bytes/group | encode µs | encode MB/s | decode µs | decode MB/s "
          "| encode x json | decode x json |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, size, enc_s, dec_s in timed:
        print(f"| {name} | {size:,} | {enc_s * 1e6:,.0f} | {size / enc_s / MB:,.0f} "
              f"| {dec_s * 1e6:,.0f} | {size / dec_s / MB:,.0f} "
              f"| {json_enc / enc_s:.1f} | {json_dec / dec_s:.1f} |")


if __name__ == "__main__":
    main()
