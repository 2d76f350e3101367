"""Rollout producer daemon: `python -m producers.rollout --config producer.toml [--set k=v ...]`.

Wires an engine, a reward function (and, with `env`, an environment: multi-turn episodes, see
docs/environments.md) and the bus into a `RolloutWorker` and runs it until SIGTERM (drain: the
batch in hand is published and its prompts committed) or a `stop` command.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path

from miles.bus.security import KafkaSecurity
from miles.engines.base import LoraSettings, RolloutEngine
from miles.engines.vllm_engine import VLLMEngineSettings
from miles.engines.vllm_server import VLLMServerSettings
from miles.envs import SandboxLimits, ToolSettings
from miles.episodes import EpisodeSettings
from miles.errors import ConfigError
from miles.rollout import RolloutConfig, RolloutWorker
from miles.service import daemon_main
from miles.trackers import TrackerSettings


@dataclass(frozen=True, kw_only=True)
class ProducerSettings:
    bus: str = "kafka://127.0.0.1:9092"  # kafka://HOST:PORT (MILES_BUS)
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS/SASL (MILES_KAFKA__*)
    model_dir: Path = Path("model")  # Hugging Face model directory (from_pretrained)
    engine: str = "hf"  # rollout engine: hf, vllm-server (a running `vllm serve`) or vllm
    device: str = "cpu"
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full weights
    reward: str = "exact_match"  # exact_match, math, format[:REGEX], rm:PATH or module:function
    reward_timeout_s: float = 10.0  # per reward call; a timed-out sample gets 0.0 and an error
    torch_threads: int = 0  # 0 leaves torch's default
    vllm_server: VLLMServerSettings = field(default_factory=VLLMServerSettings)  # vllm-server
    vllm: VLLMEngineSettings = field(default_factory=VLLMEngineSettings)  # engine vllm (GPU or CPU)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: str = ""  # environment: a built-in (single_turn, calculator, python) or module:Name
    episodes: EpisodeSettings = field(default_factory=EpisodeSettings)  # limits when env is set
    tools: ToolSettings = field(default_factory=ToolSettings)  # a tool environment's limits
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)  # the python env's sandbox
    trackers: TrackerSettings = field(default_factory=TrackerSettings)  # TensorBoard, W&B, MLflow

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self.episodes.check_engine(self.engine)
        self.rollout.check_streaming(self.engine, self.env)


def _hf_engine(settings: ProducerSettings) -> RolloutEngine:
    import torch

    from miles.engines.hf import HFEngine

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    return HFEngine(settings.model_dir, device=settings.device, lora=settings.lora)


def _vllm_server_engine(settings: ProducerSettings) -> RolloutEngine:
    """The server samples; model_dir only provides the tokenizer and the vocabulary size."""
    from miles.engines.vllm_server import VLLMServerEngine

    return VLLMServerEngine.from_settings(settings.vllm_server, settings.model_dir,
                                          lora=settings.lora is not None)


def _vllm_engine(settings: ProducerSettings) -> RolloutEngine:
    """vLLM in this process, on the GPU(s) it sees; `device` and `torch_threads` do not apply."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine 'vllm' needs vLLM: pip install 'miles[vllm]' (or use engine "
                          "'vllm-server' with a running `vllm serve`)")
    from miles.engines.vllm_engine import VLLMEngine

    return VLLMEngine(settings.model_dir, settings.vllm, lora=settings.lora)


ENGINES = {"hf": _hf_engine, "vllm-server": _vllm_server_engine, "vllm": _vllm_engine}


def build_engine(settings: ProducerSettings) -> RolloutEngine:
    """The rollout engine named by `settings.engine`."""
    return ENGINES[settings.engine](settings)  # the name was checked with the settings


async def run_producer(settings: ProducerSettings, stop) -> dict:
    from miles.bus import open_bus
    from miles.envs import load_environment
    from miles.tasks.rewards import resolve_reward
    from miles.trackers import open_trackers
    from miles.weights.store import base_model_id

    scorer = resolve_reward(settings.reward, timeout_s=settings.reward_timeout_s)
    env = load_environment(settings.env, reward=scorer, tools=settings.tools,
                           sandbox=settings.sandbox) if settings.env else None
    engine = build_engine(settings)
    rollout = settings.rollout
    if not rollout.base_model:  # reject versions trained on another base
        rollout = replace(rollout, base_model=base_model_id(settings.model_dir))
    try:
        with open_trackers(settings.trackers, role=rollout.producer_id, run=rollout.run,
                           default_dir=Path("runs") / rollout.run / "trackers",
                           config=settings) as trackers:
            async with open_bus(settings.bus, settings.kafka) as bus:
                worker = RolloutWorker(bus, engine, scorer, rollout, env=env,
                                       episodes=settings.episodes, trackers=trackers)
                await worker.run(stop)
    finally:
        engine.close()
    return {**worker.counts, "load_latency_p50_s": worker.follower.load_latency_p50()}


def main(argv=None) -> int:
    return daemon_main(ProducerSettings, argv, prog="producers.rollout", doc=__doc__,
                       run=run_producer)


if __name__ == "__main__":
    raise SystemExit(main())
