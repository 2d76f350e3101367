"""Rollout producer daemon: `python -m producers.rollout --config producer.toml [--set k=v ...]`.

Wires an engine, a reward function and the bus into a `RolloutWorker` and runs it until SIGTERM
(drain: the batch in hand is published and its prompts committed) or a `stop` command.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from miles.config import log_config, parse_config_args
from miles.engines.base import LoraSettings
from miles.rollout import RolloutConfig, RolloutWorker
from miles.service import run_service

log = logging.getLogger("producers.rollout")


@dataclass(frozen=True, kw_only=True)
class ProducerSettings:
    bus: str = "kafka://127.0.0.1:9092"  # kafka://HOST:PORT (MILES_BUS)
    model_dir: Path = Path("model")  # Hugging Face model directory (from_pretrained)
    engine: str = "hf"  # rollout engine: hf
    device: str = "cpu"
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full weights
    reward: str = "exact_match"  # exact_match, math, format[:REGEX], rm:PATH or module:function
    reward_timeout_s: float = 10.0  # per reward call; a timed-out sample gets 0.0 and an error
    torch_threads: int = 0  # 0 leaves torch's default
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def parse_args(argv=None) -> ProducerSettings:
    return parse_config_args(ProducerSettings, argv, prog="producers.rollout", description=__doc__.splitlines()[0])


async def run_producer(settings: ProducerSettings, stop) -> dict:
    import torch

    from miles.bus import open_bus
    from miles.engines.hf import HFEngine
    from miles.tasks.rewards import resolve_reward

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    scorer = resolve_reward(settings.reward, timeout_s=settings.reward_timeout_s)
    engine = HFEngine(settings.model_dir, device=settings.device, lora=settings.lora)
    async with open_bus(settings.bus) as bus:
        worker = RolloutWorker(bus, engine, scorer, settings.rollout)
        await worker.run(stop)
    log.info("producer stopped: %s", worker.counts)
    return dict(worker.counts)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_args(argv)
    log_config(settings)
    run_service(lambda stop: run_producer(settings, stop))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
