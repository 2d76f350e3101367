"""Trainer daemon: `torchrun --nproc_per_node N -m consumers.trainer --config trainer.toml`.

Also runs without torchrun (one rank). Rank 0 talks to the bus; the other ranks follow its
steps. Stops on SIGTERM (after the step in hand, with a final checkpoint) or after
`loop.max_steps`. Exits with 2 when checkpoints exist but none can be loaded, and with 3 when a
newer trainer generation took over the run's out_dir (this one was fenced).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from miles.bus.security import KafkaSecurity
from miles.config import log_config, parse_config_args
from miles.engines.base import LoraSettings
from miles.rl.algorithm import preset_layers
from miles.service import configure_logging, run_service
from miles.trackers import TrackerSettings
from miles.trainer.learner import LearnerConfig
from miles.trainer.loop import LoopConfig

log = logging.getLogger("consumers.trainer")
EXIT_NO_CHECKPOINT = 2
EXIT_FENCED = 3


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    bus: str = "kafka://127.0.0.1:9092"  # kafka://HOST:PORT (MILES_BUS)
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS/SASL (MILES_KAFKA__*)
    model_dir: Path = Path("model")  # Hugging Face model directory (from_pretrained)
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full fine-tuning
    torch_threads: int = 0  # 0 leaves torch's default
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    trackers: TrackerSettings = field(default_factory=TrackerSettings)  # TensorBoard, W&B, MLflow


def parse_args(argv=None) -> TrainerSettings:
    return parse_config_args(TrainerSettings, argv, prog="consumers.trainer",
                             description=__doc__.splitlines()[0], presets=preset_layers(),
                             algo_at="learner.algorithm")


def build_runner(settings: TrainerSettings):
    import torch

    from miles.trainer.memory import check_trainer_memory
    from miles.trainer.runner import StepRunner

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one estimate per host; never refuses
        warning = check_trainer_memory(settings.model_dir, lora=settings.lora,
                                       learner=settings.learner)
        if warning:
            log.warning(warning)
    return StepRunner.build(settings.model_dir, settings.loop, learner=settings.learner,
                            lora=settings.lora)


async def run_trainer(settings: TrainerSettings, runner, stop) -> dict:
    from miles.bus import open_bus
    from miles.trackers import open_trackers
    from miles.trainer.loop import TrainerLoop

    with open_trackers(settings.trackers, role="trainer", run=settings.loop.run,
                       default_dir=settings.loop.out_dir / "trackers", config=settings) as trackers:
        async with open_bus(settings.bus, settings.kafka) as bus:
            loop = TrainerLoop(bus, runner, trackers)
            return await loop.run(stop)


def main(argv=None) -> int:
    from miles.errors import CheckpointError, FencedError
    from miles.trainer import distributed

    configure_logging()
    settings = parse_args(argv)
    runner = build_runner(settings)
    try:
        if distributed.is_main():
            log_config(settings)
            summary = run_service(lambda stop: run_trainer(settings, runner, stop))
            log.info("trainer stopped: %s", json.dumps(summary))
        else:
            runner.follow()
        distributed.barrier()  # gloo aborts if a rank tears down while another still talks
    except FencedError as err:
        log.error("fenced: %s", err)
        return EXIT_FENCED
    except CheckpointError as err:
        log.error("cannot resume: %s", err)
        return EXIT_NO_CHECKPOINT
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
