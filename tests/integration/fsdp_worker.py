"""Train steps + adapter exports on fixed synthetic groups, for the FSDP rank-count tests.

Run under `torchrun --nproc_per_node N` (N ranks) or plain `python` (one self-initialised rank):
    fsdp_worker.py MODEL_DIR OUT_DIR ALGO [RESUME_CHECKPOINT]
    fsdp_worker.py MODEL_DIR OUT_DIR gradients
    fsdp_worker.py MODEL_DIR OUT_DIR isolation
The groups reach ranks > 0 through `broadcast_bytes` (wire encoding). Without a checkpoint: one
step, OUT_DIR/metrics.json and OUT_DIR/adapter/ (peft format), a checkpoint OUT_DIR/ckpt/, a
second step and OUT_DIR/adapter2/. With one: load it (saved on any number of ranks), take the
second step, write OUT_DIR/adapter2/. `gradients`: for each case of `GRADIENT_CASES` (an algorithm
and loss aggregation, each under packed and padded micro-batches with a small and a large token
budget), the full fine-tuning gradients of the first optimizer step, before clipping, in
OUT_DIR/gradients.safetensors (keys CASE/LAYOUT/BUDGET/PARAMETER), and each run's micro-batch
count in OUT_DIR/micro_batches.json. `isolation`: one `Isolation.train` of six groups, two of
which fail the step in rank 1's share on two ranks (1: NaN planted in the model's forward, 3: a
temperature the trainer cannot re-score, raised while batching); each rank writes what it
decided to OUT_DIR/isolation-RANK.json.
"""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from miles.config import build
from miles.protocol import decode, encode
from miles.rl.algorithm import AlgorithmConfig, preset
from miles.trainer import distributed
from miles.trainer.checkpoint import load_checkpoint, save_checkpoint
from miles.trainer.isolation import Isolation
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group, make_sample
from tests.poison import good_groups, plant, poisoned

FP32 = "fp32"  # rank-count equivalence is exact in fp32 ("auto" is bf16 on some CPUs)


def fixed_groups() -> list:
    """Five groups of ragged lengths: two ranks get 3 and 2 groups, and different numbers of
    micro-batches, so the idle micro-batch path runs too."""
    groups = []
    for g in range(5):
        lengths = [2 + (g * 5 + i * 3) % 7 for i in range(4)]
        samples = [make_sample(n, vocab_size=78, seed=g * 10 + i) for i, n in enumerate(lengths)]
        groups.append(make_group(prompt_tokens=3 + g % 3, vocab_size=78, seed=g, samples=samples))
    return groups


def shipped_groups() -> list:
    """The groups as the trainer daemon ships them: built on rank 0 only, broadcast as wire
    bytes, decoded on every rank."""
    groups = fixed_groups() if distributed.is_main() else [None] * len(fixed_groups())
    received = [decode(distributed.broadcast_bytes(encode(g) if g else None)) for g in groups]
    if received != fixed_groups():
        raise SystemExit(f"rank {distributed.rank()}: broadcast groups differ")
    if distributed.broadcast_bytes(b"" if distributed.is_main() else None) != b"":
        raise SystemExit(f"rank {distributed.rank()}: empty broadcast is not empty")
    return received


def finish() -> None:
    """A clean exit: the barrier first (no rank tears gloo down while a peer still talks),
    then the process group, then out without the interpreter's teardown, where a rank of this
    worker still aborted now and then ('terminate called without an active exception', exit
    -6, after its report was written: CI of 23d696f) while gloo's threads were destroyed."""
    distributed.barrier()
    distributed.destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(model_dir: str, out_dir: str, algo: str, resume: str | None = None) -> None:
    config = LearnerConfig(lr=1e-3, max_tokens_per_micro_batch=40, seed=0, precision=FP32,
                           algorithm=build(AlgorithmConfig, preset(algo)))
    learner = Learner(model_dir, config, lora=LoraSettings(r=4, alpha=8))
    out = Path(out_dir)
    if resume:
        state = learner.state_dict()
        load_checkpoint(Path(resume), state)
        learner.load_state_dict(state)
    else:
        first_step(learner, out)
    learner.train_step(shipped_groups())
    learner.export_weights(out / "adapter2")
    finish()


def first_step(learner: Learner, out: Path) -> None:
    metrics = learner.train_step(shipped_groups())
    learner.export_weights(out / "adapter")
    micro_batches = len(learner.micro_batches(fixed_groups()))  # a collective: every rank
    if distributed.is_main():
        report = {"world_size": distributed.world_size(), "micro_batches": micro_batches,
                  **metrics}
        (out / "metrics.json").write_text(json.dumps(report, indent=2))
    save_checkpoint(out / "ckpt", 1, learner.state_dict(), {"offsets": {}})


GRADIENT_CASES = {  # name: (preset, loss aggregation)
    "token_mean": ("grpo", "token_mean"),
    "seq_mean_token_mean": ("grpo", "seq_mean_token_mean"),
    "seq_sum_constant": ("dr_grpo", "seq_sum_constant"),
    "gspo": ("gspo", "seq_mean_token_mean"),  # sequence-level ratios
    "ppo": ("ppo", "token_mean"),  # critic values and GAE whitening
}
BUDGETS = {"one": 10_000, "many": 40}  # tokens per micro-batch: all rows at once, or ~3 rows


def first_step_gradients(learner: Learner, groups: list) -> dict[str, torch.Tensor]:
    """The gradients the first optimizer step of `learner.train_step(groups)` applies, before
    clipping, unsharded (a collective: every rank calls it)."""
    captured: dict[str, torch.Tensor] = {}
    step = learner._step

    def capture(*args) -> float:
        if not captured:  # the first optimizer step only
            for name, param in learner.trained.named_parameters():
                if param.grad is not None:
                    grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) \
                        else param.grad
                    captured[name] = grad.clone()
        return step(*args)

    learner._step = capture
    learner.train_step(groups)
    return captured


def gradients(model_dir: str, out_dir: str) -> None:
    groups = shipped_groups()
    out, counts = {}, {}
    for case, (algo, aggregation) in GRADIENT_CASES.items():
        overrides = preset(algo)
        overrides["loss"] = {**overrides.get("loss", {}), "aggregation": aggregation}
        for packed in (False, True):
            for budget, max_tokens in BUDGETS.items():
                config = LearnerConfig(max_tokens_per_micro_batch=max_tokens,
                                       sequence_packing=packed, precision=FP32,
                                       algorithm=build(AlgorithmConfig, overrides))
                learner = Learner(model_dir, config, lora=None)
                key = f"{case}/{'packed' if packed else 'padded'}/{budget}"
                assert learner.packing == packed, key
                counts[key] = len(learner.micro_batches(groups))  # a collective
                for name, grad in first_step_gradients(learner, groups).items():
                    out[f"{key}/{name}"] = grad
    if distributed.is_main():
        save_file(out, str(Path(out_dir) / "gradients.safetensors"))
        (Path(out_dir) / "micro_batches.json").write_text(json.dumps(counts, indent=2))
    finish()


def isolation(model_dir: str, out_dir: str) -> None:
    learner = Learner(model_dir, LearnerConfig(lr=1e-3, max_tokens_per_micro_batch=40,
                                               precision=FP32),
                      lora=LoraSettings(r=4, alpha=8))
    plant(learner.model, "nan")
    groups = good_groups(6)
    groups[1] = poisoned(groups[1])
    groups[3] = replace(groups[3], sampling={**groups[3].sampling, "temperature": 0.0})
    outcome = Isolation().train(learner, groups)
    report = {"world_size": distributed.world_size(), "trained": outcome.trained,
              "failed": {str(i): reason for i, reason in outcome.failed.items()},
              "policy_version": learner.policy_version,
              "tokens": outcome.metrics["trainer/tokens"]}
    out = Path(out_dir) / f"isolation-{distributed.rank()}.json"
    out.write_text(json.dumps(report, indent=2))
    finish()


if __name__ == "__main__":
    if sys.argv[3] == "gradients":
        gradients(*sys.argv[1:3])
    elif sys.argv[3] == "isolation":
        isolation(*sys.argv[1:3])
    else:
        main(*sys.argv[1:5])
