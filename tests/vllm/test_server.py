"""The external-server engine (engine "vllm-server") against a real vLLM server started by the
session: the start-up probe, logprobs against the trainer's, adapter load and unload."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("vllm")

from miles.engines.vllm_server import VLLMServerEngine  # noqa: E402
from tests.factories import mean_logprob_gap  # noqa: E402
from tests.vllm.conftest import PARAMS, TIER, random_adapter, trainer_model  # noqa: E402


def served_models(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as reply:
        return {card["id"] for card in json.load(reply)["data"]}


def test_the_server_engine_probes_samples_and_swaps_adapters(vllm_server, vllm_model_dir,
                                                             tmp_path):
    engine = VLLMServerEngine(vllm_server.url, "", vllm_model_dir, lora=True, timeout_s=300.0,
                              adapter_prefix="t-swap")  # the probe runs here
    prompts = [engine.encode("2+2="), engine.encode("The answer:")]
    groups = engine.generate(prompts, PARAMS)
    assert [len(g) for g in groups] == [4, 4]
    assert {c.policy_version for g in groups for c in g} == {0}
    assert mean_logprob_gap(trainer_model(vllm_model_dir), prompts, groups,
                            PARAMS) <= TIER.logprob_tolerance
    for version in (1, 2):
        adapter = random_adapter(vllm_model_dir, tmp_path / f"v{version}", seed=version)
        engine.load_version(adapter, version, "lora")
        groups = engine.generate(prompts, PARAMS)
        assert {c.policy_version for g in groups for c in g} == {version}
        gap = mean_logprob_gap(trainer_model(vllm_model_dir, adapter), prompts, groups, PARAMS)
        assert gap <= TIER.logprob_tolerance, (version, gap)
        assert {m for m in served_models(vllm_server.url) if m.startswith("t-swap")} == {
            f"t-swap-v{version}"}  # the previous version was unloaded
