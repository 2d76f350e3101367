"""The Hugging Face engine on a tiny model: logprobs agree with the trainer's layout, shapes,
determinism, LoRA and full-weight hot-loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from miles.engines import Completion, HFEngine, LoraSettings
from miles.engines.hf import lora_config
from miles.errors import EngineError
from miles.rl.sampling import SamplingParams, sampled_logprobs
from miles.tasks.tiny_model import build_tiny_model

PROMPTS = ["37+48=", "1+2=", "123+456=", "9="]  # different lengths in one batch
LORA = LoraSettings(r=4, alpha=8)
LOGPROB_TOLERANCE = 1e-4  # mean |engine - trainer| in fp32 on CPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, layers=2)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(model_dir)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.encode(text) for text in PROMPTS]


def trainer_logprobs(model, prompts: list[list[int]], groups: list[list[Completion]],
                     params: SamplingParams) -> list[torch.Tensor]:
    """Score responses as the trainer does: one right-padded forward, positions 0..L-1."""
    pairs = [(prompt, c) for prompt, group in zip(prompts, groups) for c in group]
    rows = [prompt + c.token_ids.tolist() for prompt, c in pairs]
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)  # [B, L]
    mask = torch.zeros_like(ids)  # [B, L]
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    positions = torch.arange(width).expand(len(rows), width)  # [B, L]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    logits = out.logits  # [B, L, V]
    scored = []
    for i, (prompt, c) in enumerate(pairs):
        start, length = len(prompt) - 1, len(c.token_ids)  # logits at t predict token t + 1
        tokens = torch.from_numpy(c.token_ids).long()  # [T]
        scored.append(sampled_logprobs(
            logits[i, start:start + length], tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p))  # [T]
    return scored


def mean_abs_gap(engine, prompts, groups, params) -> float:
    scored = trainer_logprobs(engine.model, prompts, groups, params)
    sampled = [torch.from_numpy(c.logprobs) for group in groups for c in group]
    return torch.cat([(a - b).abs() for a, b in zip(scored, sampled)]).mean().item()


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12),
    SamplingParams(n=3, temperature=1.0, max_new_tokens=12),
], ids=["filtered", "plain"])
def test_engine_logprobs_match_trainer_forward(engine, prompts, params):
    groups = engine.generate(prompts, params, seed=1)
    gap = mean_abs_gap(engine, prompts, groups, params)
    print(f"mean |engine - trainer| logprob = {gap:.3e}")
    assert gap <= LOGPROB_TOLERANCE


def test_qwen2_engine_logprobs_match_trainer_forward(tmp_path):
    qwen = HFEngine(build_tiny_model(tmp_path / "qwen2", arch="qwen2", hidden_size=64, layers=2))
    prompts = [qwen.encode(text) for text in PROMPTS]
    params = SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8)
    groups = qwen.generate(prompts, params, seed=1)
    assert mean_abs_gap(qwen, prompts, groups, params) <= LOGPROB_TOLERANCE


def test_positions_count_real_tokens_and_steps_use_the_cache(engine, prompts):
    calls = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        engine.generate(prompts, SamplingParams(n=1, max_new_tokens=3), seed=0)
    finally:
        hook.remove()
    width = max(len(p) for p in prompts)
    expected = [[0] * (width - len(p)) + list(range(len(p))) for p in prompts]
    assert len(calls) > 1
    assert calls[0]["position_ids"].tolist() == expected
    assert calls[0]["attention_mask"].sum(-1).tolist() == [len(p) for p in prompts]
    for step, kwargs in enumerate(calls[1:], start=1):
        assert kwargs["input_ids"].shape == (len(prompts), 1)  # one new token, the rest cached
        assert kwargs["position_ids"].squeeze(-1).tolist() == [len(p) - 1 + step for p in prompts]
        assert kwargs["attention_mask"].shape == (len(prompts), width + step)


def test_completions_shapes_dtypes_and_finish_reasons(engine, prompts):
    params = SamplingParams(n=8, temperature=1.5, max_new_tokens=16)
    groups = engine.generate(prompts, params, seed=3)
    assert len(groups) == len(prompts)
    reasons = set()
    for group in groups:
        assert len(group) == params.n
        for c in group:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.token_ids.shape == c.logprobs.shape
            assert 1 <= len(c.token_ids) <= params.max_new_tokens
            assert np.isfinite(c.logprobs).all() and (c.logprobs <= 0).all()
            assert ((c.token_ids >= 0) & (c.token_ids < engine.vocab_size)).all()
            assert c.policy_version == 0
            eos_at = np.flatnonzero(c.token_ids == engine.eos_token_id).tolist()
            if c.finish_reason == "stop":
                assert eos_at == [len(c.token_ids) - 1]
            else:
                assert c.finish_reason == "length"
                assert eos_at == [] and len(c.token_ids) == params.max_new_tokens
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}  # both paths exercised by this seed


def test_same_seed_same_completions(engine, prompts):
    params = SamplingParams(n=2, temperature=0.9, top_k=30, max_new_tokens=8)
    first, again = (engine.generate(prompts, params, seed=7) for _ in range(2))
    other = engine.generate(prompts, params, seed=8)

    def flat(groups):
        return [(c.token_ids.tolist(), c.logprobs.tolist(), c.finish_reason)
                for group in groups for c in group]

    assert flat(first) == flat(again)
    assert flat(first) != flat(other)


def test_counters_and_edge_cases(engine, prompts, tmp_path):
    before = engine.tokens_generated
    groups = engine.generate(prompts[:1], SamplingParams(n=2, max_new_tokens=4), seed=0)
    assert engine.tokens_generated - before == sum(len(c.token_ids) for c in groups[0])
    assert engine.generate_seconds > 0 and engine.tokens_per_s > 0
    assert engine.generate([], SamplingParams(n=2)) == []
    with pytest.raises(EngineError, match="empty"):
        engine.generate([[]], SamplingParams(n=1))
    with pytest.raises(EngineError, match="outside"):
        engine.generate([[engine.vocab_size]], SamplingParams(n=1))
    assert engine.decode(engine.encode("37+48=")) == "37+48="
    with pytest.raises(EngineError, match="cannot load"):
        HFEngine(tmp_path / "missing")


def save_adapter(model_dir, out_dir, settings: LoraSettings, seed: int):
    """A peft adapter on the same base with nonzero lora_B; returns the peft model (eval)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                lora_config(settings))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_model.save_pretrained(out_dir)
    return peft_model.eval()


def last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1]  # [V]


def test_fresh_lora_engine_equals_base(model_dir, engine, prompts):
    lora_engine = HFEngine(model_dir, lora=LORA)
    params = SamplingParams(n=2, max_new_tokens=6)
    base, with_lora = (e.generate(prompts, params, seed=5) for e in (engine, lora_engine))
    for base_group, lora_group in zip(base, with_lora):
        for a, b in zip(base_group, lora_group):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_lora_adapter_hot_load(model_dir, prompts, tmp_path):
    lora_engine = HFEngine(model_dir, lora=LORA)
    params = SamplingParams(n=1, temperature=1e-3, max_new_tokens=6)
    before = lora_engine.generate(prompts, params, seed=0)
    trained = save_adapter(model_dir, tmp_path / "v1", LORA, seed=1)

    lora_engine.load_adapter(tmp_path / "v1", 1)

    assert lora_engine.policy_version == 1
    assert_close(last_logits(lora_engine.model, prompts[0]), last_logits(trained, prompts[0]))
    after = lora_engine.generate(prompts, params, seed=0)
    assert all(c.policy_version == 1 for group in after for c in group)
    assert [g[0].token_ids.tolist() for g in before] != [g[0].token_ids.tolist() for g in after]
    newer = save_adapter(model_dir, tmp_path / "v2", LORA, seed=2)  # copied over the same params
    lora_engine.load_adapter(tmp_path / "v2", 2)
    assert_close(last_logits(lora_engine.model, prompts[0]), last_logits(newer, prompts[0]))
    assert not torch.allclose(last_logits(newer, prompts[0]), last_logits(trained, prompts[0]))


def test_the_adapter_is_merged_and_reloads_do_not_compound(model_dir, tmp_path):
    from peft.tuners.lora import LoraLayer

    lora_engine = HFEngine(model_dir, lora=LORA)
    layers = [m for m in lora_engine.model.modules() if isinstance(m, LoraLayer)]
    assert layers and all(layer.merged for layer in layers)  # forwards skip the adapter
    save_adapter(model_dir, tmp_path / "v1", LORA, seed=1)
    save_adapter(model_dir, tmp_path / "v2", LORA, seed=2)
    lora_engine.load_adapter(tmp_path / "v1", 1)
    first = [layer.get_base_layer().weight.clone() for layer in layers]
    for version in range(2, 12):  # v2, v1, v2, ..., v1
        lora_engine.load_adapter(tmp_path / ("v2" if version % 2 == 0 else "v1"), version)
    assert all(layer.merged for layer in layers)
    assert all(torch.equal(layer.get_base_layer().weight, weight)  # bit for bit: no drift
               for layer, weight in zip(layers, first))


def test_mismatching_adapter_is_rejected_and_weights_kept(model_dir, prompts, tmp_path):
    lora_engine = HFEngine(model_dir, lora=LORA)
    save_adapter(model_dir, tmp_path / "v1", LORA, seed=1)
    lora_engine.load_adapter(tmp_path / "v1", 1)
    logits = last_logits(lora_engine.model, prompts[0])
    save_adapter(model_dir, tmp_path / "wide", LoraSettings(r=8, alpha=8), seed=2)

    with pytest.raises(EngineError, match="r: adapter has 8, engine serves 4"):
        lora_engine.load_adapter(tmp_path / "wide", 2)

    assert lora_engine.policy_version == 1
    assert_close(last_logits(lora_engine.model, prompts[0]), logits, rtol=0, atol=0)


def test_unreadable_or_foreign_adapter_is_rejected(model_dir, prompts, tmp_path):
    lora_engine = HFEngine(model_dir, lora=LORA)
    adapter = tmp_path / "v1"
    save_adapter(model_dir, adapter, LORA, seed=1)
    weights_path = adapter / "adapter_model.safetensors"
    config_path = adapter / "adapter_config.json"
    weights, config = load_file(weights_path), json.loads(config_path.read_text())
    logits = last_logits(lora_engine.model, prompts[0])

    save_file(dict(list(weights.items())[1:]), weights_path)
    with pytest.raises(EngineError, match="adapter keys differ"):
        lora_engine.load_adapter(adapter, 1)
    save_file({k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in weights.items()},
              weights_path)
    with pytest.raises(EngineError, match="adapter shapes differ"):
        lora_engine.load_adapter(adapter, 1)
    weights_path.write_bytes(b"not safetensors")
    with pytest.raises(EngineError, match="cannot read weights"):
        lora_engine.load_adapter(adapter, 1)
    config_path.write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    with pytest.raises(EngineError, match="target_modules"):
        lora_engine.load_adapter(adapter, 1)

    assert lora_engine.policy_version == 0
    assert_close(last_logits(lora_engine.model, prompts[0]), logits, rtol=0, atol=0)


def test_adapter_needs_a_lora_engine(engine, model_dir, tmp_path):
    save_adapter(model_dir, tmp_path / "v1", LORA, seed=1)
    with pytest.raises(EngineError, match="without LoRA"):
        engine.load_adapter(tmp_path / "v1", 1)
    assert engine.policy_version == 0


def test_full_weights_hot_load(model_dir, prompts, tmp_path):
    full_engine = HFEngine(model_dir)
    new_dir = build_tiny_model(tmp_path / "new", hidden_size=64, layers=2, seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir)
    assert not torch.allclose(last_logits(full_engine.model, prompts[0]),
                              last_logits(new_model, prompts[0]))

    full_engine.load_full_weights(new_dir, 3)

    assert full_engine.policy_version == 3
    assert_close(last_logits(full_engine.model, prompts[0]), last_logits(new_model, prompts[0]))
    wrong_dir = build_tiny_model(tmp_path / "wrong", hidden_size=32, layers=2)
    with pytest.raises(EngineError, match="shapes differ"):
        full_engine.load_full_weights(wrong_dir / "model.safetensors", 4)
    assert full_engine.policy_version == 3
