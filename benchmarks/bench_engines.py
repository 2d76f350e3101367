"""The vLLM tax: engine start-up, first-generate latency and per-batch latency across batch sizes
for the Hugging Face engine and both vLLM engines, on the same models.

    ~/.cache/miles/vllm-cpu-env/bin/python benchmarks/bench_engines.py \
        [--engines hf,vllm,vllm-server] [--models tiny,100m] [--batches 1,4,16,64,256] \
        [--n 4] [--max-new-tokens 32] [--repeats 3] [--out runs/bench-engines]

Run it with a python that has vLLM (scripts/vllm_cpu_env.py builds one on CPUs). Models are
built from configs: `tiny` is the demo's (hidden 128, 4 layers, ~0.8M parameters), `100m` a
Llama of hidden 768 and 12 layers (~113M parameters with the character tokenizer). Each
engine generates arithmetic prompts x n samples with temperature 1 and no EOS stop bias, so
lengths follow the model; the table reports the median seconds per batch over `repeats` and the
generated tokens per second. Start-up: `hf` loads the checkpoint; `vllm` builds AsyncLLM and runs
its warm-up; `vllm-server` starts the server process until /health answers, then the engine's
probe. Engines run one after another, each alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from miles.broker import free_port
from miles.engines.base import LoraSettings
from miles.rl.sampling import SamplingParams
from miles.tasks.arithmetic import arithmetic_problems
from miles.tasks.tiny_model import build_tiny_model

MODELS = {"tiny": {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": 2},
          "100m": {"hidden_size": 768, "layers": 12, "heads": 12, "kv_heads": 12}}
MAX_MODEL_LEN = 256
LORA = LoraSettings(r=16, alpha=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf,vllm,vllm-server")
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (the HF engine: fp32)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-engines"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for model in args.models.split(","):
        model_dir = args.out / f"model-{model}"
        if not (model_dir / "config.json").exists():
            build_tiny_model(model_dir, max_positions=MAX_MODEL_LEN, **MODELS[model])
        for name in args.engines.split(","):
            row = measure(name, model_dir, params, batches, args)
            rows.append({"model": model, **row})
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "engines.json").write_text(json.dumps(rows, indent=2))
    print(table(rows, batches, args.n))


def measure(name: str, model_dir: Path, params: SamplingParams, batches: list[int],
            args) -> dict:
    began = time.monotonic()
    engine, server = build(name, model_dir, args)
    start_s = time.monotonic() - began
    try:
        prompts = [engine.encode(p.prompt) for p in arithmetic_problems("train")[:max(batches)]]
        began = time.monotonic()
        engine.generate(prompts[:1], params)
        first_s = time.monotonic() - began
        per_batch = {}
        for batch in batches:
            times, tokens = [], 0
            for _ in range(args.repeats):
                began = time.monotonic()
                groups = engine.generate(prompts[:batch], params)
                times.append(time.monotonic() - began)
                tokens += sum(len(c.token_ids) for g in groups for c in g)
            median = statistics.median(times)
            per_batch[batch] = {"seconds": round(median, 4),
                                "tokens_per_s": round(tokens / sum(times), 1)}
    finally:
        close(engine, server)
    return {"engine": name, "start_s": round(start_s, 2), "first_generate_s": round(first_s, 3),
            "batches": per_batch}


def build(name: str, model_dir: Path, args):
    """The engine (LoRA, as producers run by default) and the server process it talks to."""
    if name == "hf":
        from miles.engines.hf import HFEngine

        return HFEngine(model_dir, lora=LORA), None
    if name == "vllm":
        from miles.engines.vllm_engine import VLLMEngine, VLLMEngineSettings

        settings = VLLMEngineSettings(dtype=args.dtype, enforce_eager=True,
                                      max_model_len=MAX_MODEL_LEN, kv_cache_gib=1.0)
        return VLLMEngine(model_dir, settings, lora=LORA), None
    from miles.engines.vllm_launch import ServerProcess, serve_command
    from miles.engines.vllm_server import VLLMServerEngine

    port = free_port()
    flags = ["--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
             "--kv-cache-memory-bytes", str(2**30)]
    server = ServerProcess(serve_command(model_dir, port, flags=flags), port,
                           args.out / f"server-{model_dir.name}.log")
    server.start()
    return VLLMServerEngine(server.url, "", model_dir, lora=True), server


def close(engine, server) -> None:
    if hasattr(engine, "close"):
        engine.close()
    if server is not None:
        server.kill()


def table(rows: list[dict], batches: list[int], n: int) -> str:
    head = "| model | engine | start-up s | first generate s | " + " | ".join(
        f"{b}x{n}: s (tok/s)" for b in batches) + " |"
    lines = [head, "|" + " --- |" * (4 + len(batches))]
    for row in rows:
        cells = [f"{row['batches'][b]['seconds']} ({row['batches'][b]['tokens_per_s']:.0f})"
                 for b in batches]
        lines.append(f"| {row['model']} | {row['engine']} | {row['start_s']} | "
                     f"{row['first_generate_s']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
