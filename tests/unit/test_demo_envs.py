"""`miles demo --env NAME`: the built-in multi-turn demo's settings (which `--set` overrides),
and its warm start: the tool format's pairs with the environment, the answers without it, each
cached under a key of its own, while the arithmetic demo keeps its cache key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace

import pytest
from transformers import AutoTokenizer

from miles import warm_start as warm
from miles.config import load_with_preset
from miles.errors import ConfigError
from miles.demo import DemoConfig, env_overrides
from miles.warm_start import warm_start
from miles.rl.algorithm import preset_layers
from miles.tasks.datasets import load_problems
from miles.tasks.multiplication import warm_start_problems


def demo_config(*overrides: str, env: str | None = None) -> DemoConfig:
    return load_with_preset(DemoConfig, preset_layers(), "learner.algorithm",
                            overrides=[*env_overrides(env), *overrides])


def test_env_names_a_built_in_demo_or_the_producers_environment():
    config = demo_config(env="multiplication")
    assert (config.prompts, config.env) == ("multiplication", "calculator")
    assert config.sampling.max_new_tokens == 32 and config.sampling.n == 8
    assert config.episodes.max_total_tokens == 58
    assert demo_config("sft.steps=7", "env=", env="multiplication").env == ""
    assert demo_config("sft.steps=7", env="multiplication").sft.steps == 7
    other = demo_config(env="tests.envs:SecondTry")
    assert (other.env, other.prompts) == ("tests.envs:SecondTry", "arithmetic")
    assert demo_config().env == ""


def test_the_producer_batch_is_one_step_unless_set():
    assert demo_config().rollout().prompts_per_batch == 32
    small = demo_config("prompts_per_batch=4")
    assert (small.rollout().prompts_per_batch, small.rollout().groups_per_step) == (4, 32)
    with pytest.raises(ConfigError, match="prompts_per_batch"):
        demo_config("prompts_per_batch=-1")


@pytest.fixture
def sft_calls(tmp_path, monkeypatch):
    """`warm_start` under a temporary cache, with a stand-in for the SFT that records what it
    was given."""
    monkeypatch.setattr(warm, "CACHE", tmp_path)
    calls = []

    def fake_sft(base, out, problems, config, *, probe=None, should_stop=None):
        calls.append((AutoTokenizer.from_pretrained(base), problems, probe))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(warm, "supervised_warm_start", fake_sft)
    return calls


def test_the_multiplication_warm_start_teaches_the_tool_format_with_the_env(sft_calls):
    with_tool = demo_config("sft.steps=3", env="multiplication")
    single_turn = replace(with_tool, env="")
    tool_dir, plain_dir = warm_start(with_tool), warm_start(single_turn)
    assert tool_dir != plain_dir
    train = load_problems("multiplication", "train")
    (tool_tokenizer, tool_pairs, _), (plain_tokenizer, plain_pairs, _) = sft_calls
    kept = train[warm.PROBE_PROBLEMS:]  # the demo stops its SFT at a success: 200 held back
    assert tool_pairs == warm_start_problems(kept) and plain_pairs == kept
    assert "<" in tool_tokenizer.get_vocab() and "<" in plain_tokenizer.get_vocab()  # chat
    assert warm_start(with_tool) == tool_dir and len(sft_calls) == 2  # cached
    assert warm_start(replace(with_tool, sft=replace(with_tool.sft, steps=4))) != tool_dir


def test_the_arithmetic_warm_start_keeps_its_cache_key(sft_calls, tmp_path):
    config = demo_config("sft.steps=3")
    key = hashlib.sha256(json.dumps({**asdict(config.sft), "task": "arithmetic"},
                                    sort_keys=True).encode()).hexdigest()[:12]
    assert warm_start(config) == tmp_path / f"sft-{key}"
    # an environment's tags need the chat tokenizer: its warm start is another (chat) model
    with_env = warm_start(replace(config, env="tests.envs:SecondTry"))
    chat_key = hashlib.sha256(json.dumps({**asdict(config.sft), "task": "arithmetic", "env": "",
                                          "chat": True}, sort_keys=True).encode()
                              ).hexdigest()[:12]
    assert with_env == tmp_path / f"sft-{chat_key}"


def test_a_success_target_holds_problems_back_from_the_sft_to_probe_them(sft_calls):
    """With `sft.stop_at_success` the first PROBE_PROBLEMS training problems are not trained
    on; the probe measures them as whole episodes (a problem counts when both of its pairs,
    the call and the answer, are reproduced)."""
    config = demo_config("sft.steps=3", env="multiplication")
    assert config.sft.stop_at_success > 0  # the built-in demo stops at a success, not a step
    warm_start(config)
    train = load_problems("multiplication", "train")
    (_, pairs, probe), = sft_calls
    assert pairs == warm_start_problems(train[warm.PROBE_PROBLEMS:]) and probe is not None
    warm_start(replace(config, sft=replace(config.sft, stop_at_success=0.0)))
    (_, all_pairs, no_probe) = sft_calls[1]
    assert all_pairs == warm_start_problems(train) and no_probe is None
