"""`miles demo`: `miles run` with the demo's settings (`DemoConfig`), the 3-minute showcase that
learns for real on CPUs: two minutes of RL from the built-in warm start, in a fresh out_dir
(runs/demo), evaluated every 10 s, no checkpoint until the end (the run machinery, the report
and the buses: `miles.run`).

With `trackers.report_to` (docs/trackers.md) the trainer, the producers and the evaluator each
log to their own tracker run, `demo-trainer`, `demo-producer-0`, `demo-evaluator` (on Kafka,
the daemons through their settings), under out_dir/trackers unless `trackers.dir` is set.

Multi-turn (`env`, `miles demo --env multiplication`): the producer plays episodes through the
environment (both buses; the daemons' settings carry `env` and `episodes`), the warm start is
the task's format pairs (`miles.warm_start.WARM_STARTS`), and held-out success is one greedy episode
per problem through the same environment (`miles.evaluation.EpisodeEval`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles.run import RunConfig, main_run

ENV_DEMOS: dict[str, dict[str, str]] = {
    "multiplication": {"prompts": "multiplication", "env": "calculator",
                       "sampling.max_new_tokens": "32", "episodes.max_turns": "4",
                       "episodes.max_total_tokens": "58", "sft.steps": "1500",
                       "sft.stop_at_success": "0.2", "sft.check_every": "5", "lora": "null",
                       "learner.lr": "2e-4", "eval_every_s": "20"},
}
"""`miles demo --env NAME`: the settings of each built-in multi-turn demo (`--set` overrides
them). multiplication: two-digit products with the calculator; a turn has room for the call
(28 tokens), an episode for call, result and answer within the tiny model's 64 positions. The
copying is learnt abruptly in SFT (0.0 to 0.85 held-out success within a few dozen steps, at a
step that depends on the machine's numerics), so the warm start stops once 20% of 200 held-back
problems are reproduced (`sft.stop_at_success`; measured: step 355 and held-out 0.164 on one
machine, step 500 and 0.244 on another), leaving RL room. RL trains the full model at lr 2e-4
(+50.6 points in 180 s, +25 after 107 s; lr 4e-4: +33 in 180 s; LoRA at 1e-3 or 4e-3 learnt
3-5 points in 120-180 s; full fine-tuning at 1e-3 collapsed) and evaluates every 20 s."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig(RunConfig):
    """`RunConfig` with the demo's defaults."""

    out_dir: Path = Path("runs/demo")
    max_seconds: float = 120.0
    epochs: int = 6  # more prompts than two minutes use (on a 2-vCPU Xeon with AMX two passes
    # ran out after 75 s at 7.5 steps/s, four after 100 s at 11.3)
    eval_every_s: float = 5.0  # a version taken every 5 s of RL ...
    eval_after_run: bool = True  # ... and measured after the run (off the critical path)
    checkpoint_every: int = 0
    export_policy: bool = False


def env_overrides(name: str | None) -> list[str]:
    """`--env NAME` as settings, before the other flags and `--set` (which win): a built-in
    demo's (`ENV_DEMOS`), or `env=NAME` for the producer's environment."""
    if name is None:
        return []
    if name in ENV_DEMOS:
        return [f"{key}={value}" for key, value in ENV_DEMOS[name].items()]
    return [f"env={name}"]


def main_demo(config: DemoConfig) -> int:
    """The demo always starts from its warm start: what an earlier demo left in out_dir goes."""
    main_run(config, fresh=True)
    return 0
