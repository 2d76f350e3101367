"""The memory calculator against hand-computed values, transformers' and peft's parameter
counts, and tensors autograd really keeps; the GPU check's no-CUDA exit and its pure helpers."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles.engines.base import LoraSettings
from miles.errors import ConfigError
from miles.rl.algorithm import AlgorithmConfig
from miles.trainer import memory
from miles.trainer.learner import LearnerConfig
from miles.trainer.memory import (GIB, ModelShape, Plan, activation_bytes, check_fits,
                                  estimate_memory, max_tokens)

REPO = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
SMALL = ModelShape(hidden=8, layers=2, intermediate=16, vocab=10, heads=2, kv_heads=2)


def tiny_config(arch: str = "llama", **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, **(TINY | overrides))


def tiny_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def shape_of(config) -> ModelShape:
    """The shape as the trainer reads it: from the JSON `save_pretrained` writes."""
    return ModelShape.from_hf_config(json.loads(config.to_json_string()))


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"tie_word_embeddings": False}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases
    ("qwen2", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
])
def test_parameter_count_equals_the_models(arch, overrides):
    config = tiny_config(arch, **overrides)
    model = tiny_model(config)
    assert shape_of(config).parameters() == sum(p.numel() for p in model.parameters())


def test_llama2_parameter_counts_are_the_published_ones():
    assert memory.MODELS["llama2-7b"].parameters() == 6_738_415_616
    assert memory.MODELS["llama2-70b"].parameters() == 68_976_648_192


@pytest.mark.parametrize("lora", [LoraSettings(),  # the project's default targets
                                  LoraSettings(r=4, target_modules=("q_proj", "v_proj")),
                                  LoraSettings(r=8, target_modules=("down_proj", "lm_head"))])
def test_lora_trainable_count_equals_peft(lora):
    from peft import get_peft_model

    from miles.engines.hf import lora_config

    config = tiny_config(tie_word_embeddings=False)
    model = get_peft_model(tiny_model(config), lora_config(lora))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = shape_of(config)
    assert estimate_memory(shape, Plan(lora=lora)).trainable == trainable
    block, head = shape.lora_parameters(lora)
    assert shape.layers * block + head == trainable


def test_critic_adapter_and_value_head_count_equals_the_learners():
    from peft import get_peft_model

    from miles.engines.hf import lora_config
    from miles.trainer.critic import add_critic

    config = tiny_config(tie_word_embeddings=False)
    model = get_peft_model(tiny_model(config), lora_config(LoraSettings()))
    add_critic(model, LoraSettings())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert estimate_memory(shape_of(config), Plan(critic=True)).trainable == trainable


def test_unknown_lora_target_is_named():
    with pytest.raises(ConfigError, match="mlp.fc1"):
        SMALL.lora_parameters(LoraSettings(target_modules=("mlp.fc1",)))


def test_full_fine_tuning_estimate_by_hand():
    # SMALL: block = 4 * 8*8 (q, k, v, o) + 3 * 8*16 (gate, up, down) + 2 * 8 (norms) = 656;
    # root = 2 * 10*8 (embeddings, head) + 8 (final norm) = 168; parameters = 2 * 656 + 168
    assert (SMALL.block_parameters(), SMALL.root_parameters(), SMALL.parameters()) == \
        (656, 168, 1480)
    e = estimate_memory(SMALL, Plan(lora=None, tokens=4))
    assert e.components == {
        "weights": 1480 * 4, "gradients": 1480 * 4, "optimizer": 1480 * 8,
        # root + 2 blocks unsharded (fp32), and the root's and one block's unsharded grads
        "gathered": (168 + 2 * 656) * 4 + (168 + 656) * 4,
        # per token and block: 8 * hidden + 2 * kv_dim + 4 * intermediate = 64 + 16 + 64
        "activations": 4 * 2 * 144 * 4,
        "logits": 4 * 10 * 4 * 5,
        "runtime": GIB,
    }
    assert e.load == 1480 * 4 + GIB  # one rank: nothing materialised beyond the shards
    assert e.total == e.step == sum(e.components.values())


def test_sharding_divides_the_state_by_the_ranks():
    one = estimate_memory(SMALL, Plan(lora=None, critic=True, reference=True))
    eight = estimate_memory(SMALL, Plan(lora=None, critic=True, reference=True, ranks=8))
    for name in ("weights", "gradients", "optimizer"):
        assert eight.components[name] == one.components[name] // 8
    for name in ("gathered", "activations", "logits", "runtime"):
        assert eight.components[name] == one.components[name]
    # loading materialises one whole copy next to the shards: 7/8 of it beyond its own shard
    assert eight.load == eight.components["weights"] + 1480 * 4 * 7 // 8 + GIB
    meta = estimate_memory(SMALL, Plan(lora=None, ranks=8, meta_init=True))
    assert meta.load == meta.components["weights"] + GIB


def test_bf16_costs_16_bytes_per_trainable_and_2_per_frozen_parameter():
    full = estimate_memory(SMALL, Plan(lora=None, reference=True, dtype="bf16"))
    state = sum(full.components[k] for k in ("weights", "gradients", "optimizer"))
    assert state == 1480 * 16 + 1480 * 2
    fp32 = estimate_memory(SMALL, Plan(lora=None, reference=True))
    assert sum(fp32.components[k] for k in ("weights", "gradients", "optimizer")) == \
        1480 * 16 + 1480 * 4


def test_copies_per_algorithm():
    def state(**plan):
        e = estimate_memory(SMALL, Plan(**plan))
        return e.components["weights"], e.trainable

    lora = LoraSettings(r=2)
    adapter = SMALL.layers * SMALL.lora_parameters(lora)[0]
    assert state(lora=lora, reference=True) == state(lora=lora)  # the disabled adapter: free
    assert state(lora=lora, critic=True)[1] == 2 * adapter + SMALL.hidden + 1
    assert state(lora=None, reference=True)[0] == 2 * state(lora=None)[0]  # a frozen copy
    assert state(lora=None, critic=True)[1] == 2 * 1480 + SMALL.hidden + 1


def test_cpu_offload_moves_the_state_to_the_host():
    plan = Plan(lora=None, ranks=4)
    on_device = estimate_memory(SMALL, plan)
    offloaded = estimate_memory(SMALL, replace(plan, cpu_offload=True))
    moved = sum(on_device.components[k] for k in ("weights", "gradients", "optimizer"))
    assert offloaded.host == moved and offloaded.step == on_device.step - moved


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    shape = memory.MODELS["llama2-7b"]
    full = activation_bytes(shape, 100, "bf16", checkpointing=False)
    kept = activation_bytes(shape, 100, "bf16", checkpointing=True)
    assert kept == 100 * (32 * 4096) * 2 + full // 32


def saved_block_bytes(model, input_ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves inside decoder blocks during a forward (parameters
    excluded, each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = [0]
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, 1)))
        hooks.append(layer.register_forward_hook(lambda *_: inside.__setitem__(0, 0)))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_estimate_matches_what_autograd_keeps(dtype):
    from transformers import AutoModelForCausalLM

    config = tiny_config(hidden_size=128, intermediate_size=344, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16,
        attn_implementation="sdpa")
    ids = torch.randint(0, config.vocab_size, (2, 32))  # [B, T]
    measured = saved_block_bytes(model.train(), ids)
    estimated = activation_bytes(shape_of(config), ids.numel(), dtype, checkpointing=False)
    assert measured == pytest.approx(estimated, rel=0.05)


def test_check_fits_warns_only_above_the_fraction():
    e = estimate_memory(SMALL, Plan(lora=None))
    assert check_fits(e, int(e.total / 0.9) + 1) is None
    warning = check_fits(e, e.total, where="cuda:0")
    assert warning is not None
    assert "cuda:0" in warning and "90%" in warning and "runtime" in warning  # largest part
    assert "a training step" in warning


def test_check_fits_names_the_load_when_loading_is_the_peak():
    shape = memory.MODELS["llama2-70b"]
    e = estimate_memory(shape, Plan(lora=LoraSettings(), ranks=8, tokens=16))
    assert e.load > e.step
    assert "during loading" in check_fits(e, 80 * GIB)


def test_max_tokens_is_the_largest_micro_batch_that_fits():
    shape, plan = memory.MODELS["llama2-7b"], Plan(dtype="bf16", ranks=8)
    device = 80 * GIB
    most = max_tokens(shape, plan, device)
    assert 0 < most < 2**20
    assert check_fits(estimate_memory(shape, replace(plan, tokens=most)), device) is None
    assert check_fits(estimate_memory(shape, replace(plan, tokens=most + 1)), device)
    assert max_tokens(shape, plan, GIB) == 0


def test_trainer_check_reads_config_json_and_warns(tmp_path, monkeypatch, caplog):
    tiny_config(tie_word_embeddings=False).save_pretrained(tmp_path)
    learner = LearnerConfig(algorithm=AlgorithmConfig(estimator="gae"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(memory, "device_memory", lambda: (64 * GIB, "test device"))
    with caplog.at_level(logging.INFO, logger="miles.trainer.memory"):
        assert memory.check_trainer_memory(tmp_path, lora=LoraSettings(), learner=learner) \
            is None
    assert "memory estimate per rank" in caplog.text
    monkeypatch.setattr(memory, "device_memory", lambda: (GIB // 2, "test device"))
    warning = memory.check_trainer_memory(tmp_path, lora=None, learner=learner)
    assert warning and "test device" in warning


def test_trainer_check_without_config_logs_and_returns_none(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="miles.trainer.memory"):
        assert memory.check_trainer_memory(tmp_path, lora=None, learner=LearnerConfig()) is None
    assert "no memory estimate" in caplog.text


def test_device_memory_on_cpu_divides_ram_by_local_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one, _ = memory.device_memory()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four, where = memory.device_memory()
    assert four == one // 4 and "4 local rank" in where


def test_tables_command_prints_every_setup(capsys):
    assert memory.main(["llama2-7b", "--ranks", "8"]) == 0
    out = capsys.readouterr().out
    for setup in memory.SETUPS:
        assert f"| {setup} | 8 |" in out


# -- benchmarks/gpu_check.py ------------------------------------------------------------------

def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_without_cuda_exits_with_a_message():
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr


def test_gpu_check_peak_lookup_and_mfu():
    gpu = load_gpu_check()
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu.peak_flops("NVIDIA H200") == 989e12
    assert gpu.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu.peak_flops("NVIDIA L40S") == 362e12
    assert gpu.peak_flops("Tesla T4") is None
    per_token = gpu.flops_per_token(matmul_params=1_000, layers=2, hidden=8, seq=16)
    assert per_token == 6 * 1_000 + 12 * 2 * 8 * 16
    assert gpu.mfu(1e6, 1e8, 1e15) == pytest.approx(0.1)
    assert gpu.mfu(1e6, 1e8, None) is None


def test_gpu_check_runs_the_learner_end_to_end_on_the_cpu():
    """`--cpu`: the script's whole path (model written, Learner built sharded, steps,
    checkpoint round trip) on a tiny shape; its last line is the JSON report."""
    tiny = ["--hidden", "64", "--layers", "2", "--intermediate", "128", "--heads", "4",
            "--kv-heads", "2", "--vocab", "128", "--groups", "2", "--samples", "2", "--prompt",
            "8", "--response", "8", "--warmup", "1", "--steps", "1", "--no-compile"]
    result = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--cpu",
                             "--lora", *tiny], capture_output=True, text=True, timeout=240,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["lora"] and report["packing"]
    assert report["restored"] is True and report["tokens_per_step"] == 2 * 2 * 16
    assert report["step_s"] > 0 and math.isfinite(report["loss_last"])
