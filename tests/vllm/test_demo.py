"""`miles demo` with vLLM producers, short, on both buses: versions flow from the trainer to the
vLLM engine and back, and the report states the engine's start-up apart from the RL clock
(`miles demo --set engine=vllm` learning +25 points is a benchmark: docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from miles.config import load_config  # noqa: E402
from miles.demo import DemoConfig, main_demo  # noqa: E402
from tests.vllm.conftest import MAX_MODEL_LEN, TIER  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("bus", ["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def test_a_short_demo_on_the_in_process_vllm_engine(bus, kafka_broker, vllm_model_dir,
                                                    tmp_path):
    s = TIER.settings
    overrides = [f"model_dir={vllm_model_dir}", f"out_dir={tmp_path}", "max_seconds=15",
                 "eval_every_s=2", "eval_problems=16", "groups_per_step=4", "lora.r=4",
                 "lora.alpha=8", "engine=vllm", "vllm.enforce_eager=true",
                 f"vllm.dtype={s.dtype}", f"vllm.max_model_len={MAX_MODEL_LEN}",
                 f"vllm.kv_cache_gib={s.kv_cache_gib}",
                 f"vllm.gpu_memory_utilization={s.gpu_memory_utilization}"]
    if bus == "kafka":
        overrides.append(f"bus={kafka_broker.url}")
    assert main_demo(load_config(DemoConfig, env={}, overrides=overrides)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["engine"] == "vllm" and report["engine_start_seconds"] > 0
    assert report["steps"] >= 2 and report["max_lag_seen"] <= 1
    assert report["curve"] and max(p["policy_version"] for p in report["curve"]) >= 1
    if bus == "kafka":
        log = (tmp_path / "producer-0.log").read_text()
        assert "loaded policy version 2" in log, log[-3000:]


@pytest.mark.slow
def test_a_short_demo_on_a_running_server(vllm_server, vllm_model_dir, tmp_path):
    """`miles demo --set engine=vllm-server --set vllm_server.base_url=URL`: the demo's model is
    the one the server serves; each version reaches the server as an adapter."""
    overrides = [f"model_dir={vllm_model_dir}", f"out_dir={tmp_path}", "max_seconds=10",
                 "eval_every_s=2", "eval_problems=16", "groups_per_step=4", "lora.r=4",
                 "lora.alpha=8", "engine=vllm-server", f"vllm_server.base_url={vllm_server.url}",
                 "vllm_server.adapter_prefix=demo-test"]
    assert main_demo(load_config(DemoConfig, env={}, overrides=overrides)) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["engine"] == "vllm-server" and report["steps"] >= 2
    assert max(p["policy_version"] for p in report["curve"]) >= 1
