"""The TRL side of `benchmarks/vs_trl.py`: TRL's `GRPOTrainer` on the demo's task, measured the
way Miles measures itself. Run with the TRL environment's python (`scripts/trl_env.py`):

    ~/.cache/miles/trl-env/bin/python benchmarks/trl_side.py --model-dir WARM_START \
        --seconds 120 --seed 0 --out runs/vs-trl/trl-seed0.json [--set KEY=VALUE ...]

What is the same as `miles demo` (embedded): the warm-started checkpoint (passed in), the train
prompts (`load_problems("arithmetic", "train")`, the demo's passes), the reward (Miles'
`exact_match` on the decoded completion, cut at EOS, against the answer), LoRA
(`miles.engines.hf.lora_config` of r=16, alpha=32 on all seven projections), the learning rate and
AdamW settings, 32 prompts x 8 samples per optimizer step, 5 new tokens at temperature 1, no KL
term, group-normalised advantages, token-mean loss, bf16 compute where Miles' `precision=auto`
picks it (fp32 weights and optimizer), torch's default threads. Every other GRPOConfig field keeps
TRL's default; `TRL_SETTINGS` lists each field set here and why (`--set` overrides any).

Held-out evaluation is Miles' own and happens after the run (`heldout_curve`): a copy of
the adapter is kept at each step's end with its second of RL; afterwards a Miles `HFEngine` on
the same checkpoint with the same LoRA shape measures the newest copy at each point of the
curve's grid (`miles.evaluation.greedy_accuracy`: greedy, 8 new tokens, `exact_match`, all
1,000 test problems), as the Miles sides' versions are. The clock starts at `on_train_begin`
(model, trainer and optimizer built; Miles starts it once engines and learner are built) and
the run stops at the first step end past the budget.

Throughput: the trainer's `_generate` is timed (a subclass that only wraps it), so each step
splits into generation (producer tokens/s: completion tokens / generation seconds) and the rest
(trainer tokens/s: the same completion tokens / (step seconds - generation seconds)), the
counterparts of Miles' `producer/tokens` / `producer/generate_s` and `trainer/tokens_per_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from heldout_curve import evaluate, grid, newest_at
from miles.engines.base import LoraSettings
from miles.engines.hf import HFEngine, adapter_parameters, lora_config
from miles.evaluation import greedy_accuracy
from miles.demo import DemoConfig
from miles.run import RunConfig
from miles.tasks.datasets import load_problems
from miles.tasks.rewards import exact_match
from miles.trainer.precision import compute_dtype

DEMO = RunConfig()  # the demo's RL settings (`miles.demo.DemoConfig` adds only run bounds)
TRL_SETTINGS: dict[str, object] = {
    "learning_rate": DEMO.learner.lr,  # TRL default 1e-6 (full fine-tuning of large models);
    # Miles' LoRA rate 1e-3 here, so the optimizer is the same on both sides
    "lr_scheduler_type": "constant",  # TRL default linear decay to 0 over the planned steps,
    # a horizon a wall-clock budget makes arbitrary; Miles' learning rate is constant
    "gradient_checkpointing": False,  # TRL default True: recomputation that saves memory this
    # 1M-parameter model does not need; Miles runs without it
    "use_cpu": True,  # TRL default False; transformers refuses bf16 on a machine without a
    # GPU unless set (`bf16` itself is set in `settings`: Miles' auto precision on this CPU)
    "max_completion_length": DEMO.sampling.max_new_tokens,  # 512 by default; the task's 5
    "num_generations": DEMO.sampling.n,  # 8 (TRL's default too)
    "per_device_train_batch_size": DEMO.groups_per_step * DEMO.sampling.n,  # completions per
    # step: 32 prompts x 8 = Miles' groups_per_step x n (TRL default 8); generation batch and
    # gradient accumulation (1) keep their defaults, so one generation feeds one update
    "temperature": DEMO.sampling.temperature,  # 1.0 (TRL's default too)
    "num_train_epochs": DemoConfig().epochs,  # the passes the demo feeds (the budget ends
    # first)
    "max_grad_norm": DEMO.learner.grad_clip,  # 1.0 (TRL's default too)
    "logging_steps": 1,  # TRL default 10; every step's reward kept for the run's record
    "save_strategy": "no",  # no checkpoints (the demo writes none during the run either)
    "report_to": "none",  # no experiment trackers
    "use_vllm": False,  # TRL's default: generation with transformers, like Miles' HF engine
}
"""GRPOConfig fields set here; all others are TRL's defaults (beta 0.0: no KL; loss_type
"dapo": token mean over the batch; scale_rewards "group"; epsilon 0.2; num_iterations 1; top_p
1.0, top_k 0; AdamW betas (0.9, 0.999), eps 1e-8, weight_decay 0; warmup 0)."""


def auto_bf16() -> bool:
    """GRPOConfig's `bf16` (TRL default True): kept where Miles' `learner.precision=auto`
    computes in bf16 on this CPU (`miles.trainer.precision`: bf16 dot-product instructions, a
    faster and close enough bf16 matmul), False elsewhere, so both sides compute alike."""
    return compute_dtype("auto", torch.device("cpu")) == torch.bfloat16


def parse_value(text: str) -> object:
    """A `--set` value: JSON where it parses (numbers, true/false, null), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class HeldOut:
    """Miles' held-out measurement of the TRL model: an adapter copy at each step's end (with
    its second of RL), evaluated after the run on `heldout_curve`'s grid."""

    def __init__(self, model_dir: Path, lora: LoraSettings):
        self.engine = HFEngine(model_dir, lora=lora)
        self.held_out = load_problems("arithmetic", "test")
        self.snapshots: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}
        self._folder = Path(tempfile.mkdtemp(prefix="trl-side-"))
        lora_config(lora).save_pretrained(self._folder)  # adapter_config.json
        self.started = 0.0

    def measure(self) -> float:
        return asyncio.run(greedy_accuracy(self.engine, self.held_out))

    def start(self) -> None:
        self.started = time.monotonic()

    def offer(self, step: int, adapter: dict[str, torch.nn.Parameter]) -> None:
        """From the training loop at a step's end: a copy of the adapter (a few hundred
        thousand floats; no model walk)."""
        copy = {key: param.detach().to("cpu", copy=True) for key, param in adapter.items()}
        self.snapshots[step] = (time.monotonic() - self.started, copy)

    def folder(self, step: int) -> Path:
        save_file(self.snapshots[step][1], str(self._folder / "adapter_model.safetensors"))
        return self._folder

    def curve(self, seconds: float) -> list[dict]:
        chosen = newest_at([(t, step) for step, (t, _) in self.snapshots.items()], grid(seconds))
        return evaluate(self.engine, chosen, self.folder, "lora", self.held_out)


def build_trainer(model_dir: Path, seconds: float, seed: int, overrides: dict, out: Path,
                  held_out: HeldOut):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation is timed; nothing else changes."""

        generate_s = 0.0
        generated_tokens = 0

        def _generate(self, prompts):
            began = time.perf_counter()
            result = super()._generate(prompts)
            self.generate_s += time.perf_counter() - began
            self.generated_tokens += sum(len(ids) for ids in result[1])
            return result

    class Budget(TrainerCallback):
        """The wall clock, per-step timings and the adapter snapshots for evaluation."""

        def __init__(self):
            self.steps: list[dict] = []
            self.adapter = None
            self.trainer = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.adapter = adapter_parameters(model)
            held_out.start()

        def on_step_begin(self, args, state, control, **kwargs):
            self._began = time.perf_counter()
            self._generate_s = self.trainer.generate_s
            self._tokens = self.trainer.generated_tokens

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"step": state.global_step,
                               "step_s": time.perf_counter() - self._began,
                               "generate_s": self.trainer.generate_s - self._generate_s,
                               "tokens": self.trainer.generated_tokens - self._tokens})
            held_out.offer(state.global_step, self.adapter)
            if time.monotonic() - held_out.started >= seconds:
                control.should_training_stop = True

    problems = load_problems("arithmetic", "train")
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def exact_match_reward(completions, answer, **kwargs) -> list[float]:
        return [exact_match(text, ref) for text, ref in zip(completions, answer)]

    settings = {**TRL_SETTINGS, "bf16": auto_bf16(), "seed": seed,
                "output_dir": str(out.with_suffix("")), **overrides}
    budget = Budget()
    trainer = TimedGRPOTrainer(model=str(model_dir), reward_funcs=exact_match_reward,
                               args=GRPOConfig(**settings), train_dataset=dataset,
                               peft_config=lora_config(DEMO.lora), callbacks=[budget])
    budget.trainer = trainer
    return trainer, budget, settings


def run(model_dir: Path, seconds: float, seed: int, overrides: dict, out: Path) -> dict:
    began = time.monotonic()
    held_out = HeldOut(model_dir, DEMO.lora)
    initial = held_out.measure()
    trainer, budget, settings = build_trainer(model_dir, seconds, seed, overrides, out, held_out)
    trainer.train()
    rl_seconds = time.monotonic() - held_out.started
    began_eval = time.monotonic()
    curve = held_out.curve(rl_seconds)
    eval_seconds = time.monotonic() - began_eval
    held_out.engine.load_adapter(held_out.folder(trainer.state.global_step),
                                 trainer.state.global_step)
    final = held_out.measure()
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return {
        "side": "trl", "seed": seed, "model_dir": str(model_dir),
        "initial_accuracy": initial, "final_accuracy": final,
        "held_out_problems": len(held_out.held_out), "curve": curve,
        "steps": trainer.state.global_step, "rl_seconds": round(rl_seconds, 2),
        "wall_seconds": round(time.monotonic() - began, 1),
        "eval_seconds_after": round(eval_seconds, 2),
        "generate_s": round(trainer.generate_s, 3), "generated_tokens": trainer.generated_tokens,
        "step_times": budget.steps, "reward_per_step": rewards,
        "torch_threads": torch.get_num_threads(), "settings": settings,
        "versions": versions(),
    }


def versions() -> dict[str, str]:
    import accelerate
    import datasets
    import peft
    import transformers
    import trl

    return {"trl": trl.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "accelerate": accelerate.__version__, "datasets": datasets.__version__,
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="the warm start")
    parser.add_argument("--seconds", type=float, default=120.0, help="wall-clock budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="the run's JSON")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a GRPOConfig field")
    args = parser.parse_args(argv)
    overrides = {key: parse_value(value) for key, value in
                 (item.split("=", 1) for item in args.sets)}
    result = run(args.model_dir, args.seconds, args.seed, overrides, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    gain = result["final_accuracy"] - result["initial_accuracy"]
    print(f"trl: held-out accuracy {result['initial_accuracy']:.3f} -> "
          f"{result['final_accuracy']:.3f} ({gain * 100:+.1f} points) in {result['steps']} "
          f"steps, {result['rl_seconds']:.0f} s; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
