"""Peak memory of one PPO/GRPO training step: LoRA on one base copy against naive full copies.

Run by hand (not a test), from the repository root:

    python benchmarks/bench_memory.py [--layers 20] [--hidden 1024] [--rows 8] [--tokens 64]
                                      [--mini-batches 1]

A Llama-style model (default: hidden 1024, MLP 2560, 20 layers, 16 heads, vocab 32,000, untied
LM head: ~307M parameters, fp32) is built from a config and saved with `save_pretrained` (with
the character tokenizer, which the Learner loads); each setup loads it back with
`from_pretrained`, as users load a checkpoint. Each setup runs in its own child process and
takes one training step on `--rows` x `--tokens` tokens:

  grpo-lora   the real `Learner` (LoRA r=16, FSDP2 over a self-initialised 1-rank gloo group),
              preset "grpo", one `train_step` on 2 synthetic trajectory groups of rows / 2
              samples (prompt: the first half of the tokens, response: the rest; random ids,
              behaviour logprobs -1, rewards 0/1 alternating): one forward+backward over the
              whole batch (proximal logprobs = the detached training logprobs), one AdamW step
  ppo-lora    the same `Learner` with preset "ppo" plus `loss.kl_coef` 0.05: actor and critic
              adapters and a value head on one base copy (`miles.trainer.critic`); before the
              update, no-grad forwards for the reference logprobs (adapters disabled) and the
              old values (GAE); then the actor loss (PPO-clip + k3 KL) and its backward, the
              clipped value loss and its backward, one AdamW step over both adapters and the
              head
  (both LoRA setups split the batch into `--mini-batches` optimizer steps, default 1, so they
  backpropagate the same rows at a time; with more, proximal logprobs are recomputed first)
  naive       hand-written, four full copies: actor (full fine-tune, AdamW), critic (the base
              decoder without LM head + a value head, AdamW), reference and old policy
              (frozen); random tokens (the second half of each row is the "response"), the
              same kinds of forwards, one backward each for actor and critic, two optimizer
              steps over the whole batch

Memory is the process's resident set (`VmHWM`/`VmRSS` in /proc/self/status, GiB = 2**30 bytes):
  import      after importing torch, transformers, peft and the Learner, before any model
              exists
  loaded      after loading the model(s) and before the step; the weights are in the process's
              own memory (naive: `materialise`, otherwise frozen weights are safetensors file
              pages shared between copies; the Learner: FSDP2 copies them into its shards)
  step peak   the peak during the step: the high-water mark is reset after loading
              (`/proc/self/clear_refs` 5), so loading transients (the safetensors mmap) do not
              count; the whole-process peak (`ru_maxrss`) is printed too
The ratios use the step peak, in total and above the import baseline (libraries, same in all).
On one rank the Learner's FSDP2 "shards" are whole parameters, and each unit's all-gather
makes a transient unsharded copy (the root unit, embeddings and LM head, stays gathered through
the forward and backward): the LoRA setups pay that (~0.3 GiB at the default size), the naive
one, plain modules, does not. The step time is wall time on a shared CPU: indicative only.
Targets (issue 4): ppo-lora / grpo-lora <= 1.3 and ppo-lora / naive <= 0.5 (step peak).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 2**30
SETUPS = ("grpo-lora", "ppo-lora", "naive")
IMPORTS = ("transformers", "peft", "miles.trainer.learner", "tests.factories")
CLIP = 0.2  # PPO-clip epsilon (naive)
KL_COEF = 0.05  # weight of the k3 KL to the reference policy (naive and ppo-lora)
LR = 1e-5
GROUPS = 2  # trajectory groups of the Learner setups; --rows are split evenly over them
BEHAVIOUR_LOGPROB = -1.0  # logprob of every sampled token under the (synthetic) rollout policy


def status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def reset_peak() -> bool:
    """Reset the resident high-water mark (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def build_model(out_dir: Path, *, layers: int, hidden: int, mlp: int, vocab: int) -> int:
    """Save a fresh Llama-style model (and a tokenizer, for `load_policy`); its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.tasks.tiny_model import build_char_tokenizer

    config = AutoConfig.for_model(
        "llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, max_position_embeddings=2048,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    build_char_tokenizer().save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def materialise(model: torch.nn.Module) -> torch.nn.Module:
    """Copy every parameter and buffer into the process's own memory. `from_pretrained` leaves
    fp32 weights as a private mmap of the safetensors file, paged in lazily and shared between
    copies of the same file: the copies would not be the separate memory they are on a GPU (or
    after FSDP2 sharding). Tied tensors stay tied."""
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = copies.setdefault(tensor.data_ptr(), tensor.data.clone())
    return model


def token_logprobs(logits, ids):
    """Logprob of each next token, [B, T-1]."""
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def ppo_loss(logp, old_logp, advantages, mask, ref_logp=None):
    """Token-mean PPO-clip loss, plus the k3 KL to the reference when given."""
    ratio = (logp - old_logp).exp()  # [B, T-1]
    terms = -torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    if ref_logp is not None:
        log_ratio = ref_logp - logp
        terms = terms + KL_COEF * (log_ratio.exp() - log_ratio - 1)
    return (terms * mask).sum() / mask.sum()


def make_batch(rows: int, tokens: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, tokens), generator=generator)  # [B, T]
    mask = torch.zeros(rows, tokens - 1)  # [B, T-1]: the response half
    mask[:, tokens // 2:] = 1
    return {"inputs": {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "position_ids": torch.arange(tokens).expand(rows, tokens)},
            "mask": mask, "advantages": torch.randn(rows, 1, generator=generator),
            "returns": torch.randn(rows, tokens - 1, generator=generator)}


def value_loss(values: torch.Tensor, batch: dict) -> torch.Tensor:
    return ((values[:, :-1] - batch["returns"]).pow(2) * batch["mask"]).sum() / batch["mask"].sum()


def make_groups(rows: int, tokens: int, vocab: int) -> list:
    """`GROUPS` trajectory groups of `rows // GROUPS` samples: a prompt of `tokens // 2` random
    ids, a response of the rest, behaviour logprobs `BEHAVIOUR_LOGPROB`, rewards alternating
    0/1 within each group (non-zero GRPO advantages)."""
    from tests.factories import make_group, make_sample

    prompt, response = tokens // 2, tokens - tokens // 2
    per_group = rows // GROUPS
    return [make_group(prompt_tokens=prompt, vocab_size=vocab, seed=g,
                       samples=[make_sample(response, vocab_size=vocab, policy_version=0,
                                            seed=g * per_group + i, reward=float(i % 2),
                                            logprobs=np.full(response, BEHAVIOUR_LOGPROB,
                                                             dtype=np.float32))
                                for i in range(per_group)])
            for g in range(GROUPS)]


def algorithm_config(name: str, mini_batches: int):
    """The preset `name` in `mini_batches` optimizer steps; PPO also gets the KL term (a
    reference forward)."""
    from miles.config import build
    from miles.rl.algorithm import AlgorithmConfig, preset

    config = replace(build(AlgorithmConfig, preset(name)), mini_batches=mini_batches)
    if name == "ppo":
        config = replace(config, loss=replace(config.loss, kl_coef=KL_COEF))
    return config


def learner_setup(algorithm: str, mini_batches: int):
    """Setups (i) and (ii): a `Learner` (FSDP2, one gloo rank) running preset `algorithm`;
    returns a step function that runs `train_step` on the synthetic groups and checks it."""

    def setup(model_dir: Path, rows: int, tokens: int, vocab: int):
        from miles.trainer.learner import Learner, LearnerConfig
        from miles.trainer.model import LoraSettings

        learner = Learner(model_dir, LearnerConfig(
            lr=LR, algorithm=algorithm_config(algorithm, mini_batches)),
            lora=LoraSettings(r=16, alpha=32))
        groups = make_groups(rows, tokens, vocab)

        def step():
            metrics = learner.train_step(groups)
            check_step(algorithm, metrics)
        return step
    return setup


def check_step(algorithm: str, metrics: dict[str, float]) -> None:
    """Fail loudly when the step did not run what the setup claims to measure."""
    expected = {"trainer/loss"} | ({"trainer/kl_ref", "trainer/value_loss"}
                                   if algorithm == "ppo" else set())
    problems = [f"missing {key}" for key in sorted(expected - metrics.keys())]
    if not (math.isfinite(metrics["trainer/grad_norm"]) and metrics["trainer/grad_norm"] > 0):
        problems.append(f"grad norm {metrics['trainer/grad_norm']}")
    if metrics["trainer/policy_version"] != 1:
        problems.append(f"policy_version {metrics['trainer/policy_version']} after one step")
    if problems:
        raise SystemExit(f"{algorithm} train_step: {', '.join(problems)}")


def naive(model_dir: Path, rows: int, tokens: int, vocab: int):
    """Setup (iii): four full copies; actor and critic trained in full with AdamW."""
    from transformers import AutoModel, AutoModelForCausalLM

    batch = make_batch(rows, tokens, vocab)

    def load(cls):
        return materialise(cls.from_pretrained(model_dir, dtype=torch.float32))

    actor, old, reference = (load(AutoModelForCausalLM) for _ in range(3))
    critic = load(AutoModel)  # decoder only: the value head replaces the LM head
    head = torch.nn.Linear(critic.config.hidden_size, 1)
    for frozen in (old, reference):
        frozen.requires_grad_(False).eval()
    actor.train(), critic.train()
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=LR)
    critic_opt = torch.optim.AdamW([*critic.parameters(), *head.parameters()], lr=LR)
    ids = batch["inputs"]["input_ids"]

    def critic_values():
        return head(critic(**batch["inputs"], use_cache=False).last_hidden_state).squeeze(-1)

    def step():
        with torch.no_grad():
            old_logp = token_logprobs(old(**batch["inputs"], use_cache=False).logits, ids)
            ref_logp = token_logprobs(reference(**batch["inputs"], use_cache=False).logits, ids)
            critic_values()
        logp = token_logprobs(actor(**batch["inputs"], use_cache=False).logits, ids)
        ppo_loss(logp, old_logp, batch["advantages"], batch["mask"], ref_logp).backward()
        value_loss(critic_values(), batch).backward()
        for optimizer in (actor_opt, critic_opt):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def child(setup: str, model_dir: Path, rows: int, tokens: int, vocab: int,
          mini_batches: int) -> dict:
    """Load `setup`, take one step; the memory report (KiB read from /proc, seconds)."""
    from miles.trainer import distributed

    for name in IMPORTS:  # counted in the import baseline
        importlib.import_module(name)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    imported = status_kib("VmRSS")
    setups = {"grpo-lora": learner_setup("grpo", mini_batches),
              "ppo-lora": learner_setup("ppo", mini_batches),
              "naive": naive}
    step = setups[setup](model_dir, rows, tokens, vocab)
    loaded = status_kib("VmRSS")
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    was_reset = reset_peak()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    distributed.destroy()  # the Learner's 1-rank group (no-op for naive)
    return {"setup": setup, "import_kib": imported, "loaded_kib": loaded,
            "step_peak_kib": status_kib("VmHWM"), "reset": was_reset,
            "process_peak_kib": max(load_peak,
                                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
            "step_s": seconds}


def run_child(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: list[dict], params: int, args) -> None:
    gib = lambda kib: kib * 1024 / GIB  # noqa: E731
    print(f"model: Llama-style, {params / 1e6:.0f}M parameters (fp32, {params * 4 / GIB:.2f} GiB "
          f"per copy), {args.layers} layers, hidden {args.hidden}, MLP {args.mlp}, vocab "
          f"{args.vocab}; batch {args.rows} x {args.tokens} tokens, {args.mini_batches} "
          f"mini-batch(es) in the LoRA setups; torch threads 2")
    print(f"{'setup':<10} {'import':>8} {'loaded':>8} {'step peak':>10} {'process peak':>13} "
          f"{'step s':>7}   (GiB)")
    for r in results:
        print(f"{r['setup']:<10} {gib(r['import_kib']):>8.2f} {gib(r['loaded_kib']):>8.2f} "
              f"{gib(r['step_peak_kib']):>10.2f} {gib(r['process_peak_kib']):>13.2f} "
              f"{r['step_s']:>7.1f}" + ("" if r["reset"] else "  (peak not reset)"))
    peak = {r["setup"]: r["step_peak_kib"] for r in results}
    net = {r["setup"]: r["step_peak_kib"] - r["import_kib"] for r in results}
    for other, target in (("grpo-lora", 1.3), ("naive", 0.5)):
        if {"ppo-lora", other} <= peak.keys():
            print(f"ppo-lora / {other:<9} = {peak['ppo-lora'] / peak[other]:.2f} step peak, "
                  f"{net['ppo-lora'] / net[other]:.2f} step peak above import "
                  f"(target <= {target})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--mlp", type=int, default=2560)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--mini-batches", type=int, default=1)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows % GROUPS or args.rows < 2 * GROUPS:
        parser.error(f"--rows must be a multiple of {GROUPS} and >= {2 * GROUPS} ({GROUPS} "
                     f"groups of >= 2 samples, so group advantages are not all zero), "
                     f"got {args.rows}")
    shape = {"layers": args.layers, "hidden": args.hidden, "mlp": args.mlp, "vocab": args.vocab}
    if args.build:
        print(json.dumps({"params": build_model(args.model_dir, **shape)}))
        return
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.rows, args.tokens, args.vocab,
                               args.mini_batches)))
        return
    common = [f"--{k}={v}" for k, v in shape.items()] + [
        f"--rows={args.rows}", f"--tokens={args.tokens}", f"--mini-batches={args.mini_batches}"]
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        params = run_child([*common, "--build", f"--model-dir={tmp}"])["params"]
        results = [run_child([*common, f"--child={setup}", f"--model-dir={tmp}"])
                   for setup in args.setups.split(",")]
    report(results, params, args)


if __name__ == "__main__":
    main()
