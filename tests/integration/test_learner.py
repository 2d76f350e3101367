"""The FSDP2 LoRA learner on one rank (in-process group, torn down after the module).

A tiny Llama (hidden 64, 2 layers) built locally; groups are sampled from the model itself where
behaviour logprobs must match the trainer's, random otherwise.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from miles.rl.sampling import process_logits
from miles.trainer import distributed
from miles.trainer.batching import make_micro_batches
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from tests.factories import make_group, make_sample

VOCAB = 78  # the tiny character tokenizer
LORA = LoraSettings(r=4, alpha=8)
CONFIG = LearnerConfig(lr=1e-3, max_tokens_per_micro_batch=64, seed=0,
                       precision="fp32")  # exact comparisons with engines (auto: bf16 on some CPUs)
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 20, "max_new_tokens": 6}
METRIC_KEYS = {"trainer/loss", "trainer/clip_frac", "trainer/kl_behaviour",
               "trainer/is_weight_mean", "trainer/is_weight_max", "trainer/is_truncated_frac",
               "trainer/mismatch", "trainer/grad_norm", "trainer/tokens", "trainer/reward_mean"}


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()  # the learners of this module share one in-process group


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def random_groups(n_groups: int = 4) -> list:
    return [make_group(4, 6, vocab_size=VOCAB, seed=s) for s in range(n_groups)]


@torch.no_grad()
def rollout(model, prompt: np.ndarray, rewards: list[float], *, steps: int = 6, seed: int = 0,
            sampling: dict = SAMPLING):
    """A group sampled from `model` (a minimal engine: no cache, one forward per token)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.from_numpy(prompt.astype(np.int64)).repeat(len(rewards), 1)  # [n, P]
    logprobs = []
    for _ in range(steps):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]  # [n, V]
        processed = process_logits(logits, temperature=sampling["temperature"],
                                   top_k=sampling["top_k"], top_p=sampling["top_p"])
        token = torch.multinomial(processed.softmax(-1), 1, generator=generator)  # [n, 1]
        logprobs.append(processed.log_softmax(-1).gather(-1, token))  # [n, 1]
        ids = torch.cat([ids, token], dim=1)
    response = ids[:, len(prompt):].numpy().astype(np.int32)  # [n, steps]
    behaviour = torch.cat(logprobs, dim=1).numpy().astype(np.float32)  # [n, steps]
    samples = [make_sample(steps, response_token_ids=response[i], logprobs=behaviour[i],
                           reward=r) for i, r in enumerate(rewards)]
    return make_group(prompt_token_ids=prompt, samples=samples, vocab_size=VOCAB,
                      sampling=sampling, seed=seed)


def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_train_step_updates_only_lora_params_and_advances_the_version(model_dir):
    learner = Learner(model_dir, CONFIG, lora=LORA)
    before = full_params(learner.model)
    metrics = learner.train_step(random_groups())
    after = full_params(learner.model)
    assert METRIC_KEYS <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["trainer/tokens"] == 4 * 4 * 6
    assert learner.policy_version == 1
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)  # B starts at 0, so its gradient is the signal
    learner.train_step(random_groups())
    assert learner.policy_version == 2


def test_trainer_scores_tokens_like_the_engine_that_sampled_them(model_dir):
    learner = Learner(model_dir, CONFIG, lora=LORA)  # LoRA B = 0: the same function as the base
    base = base_model(model_dir)
    groups = [rollout(base, np.array([5, 6, 7, 8 + s], np.int32), [1.0, 0.0, 0.5, 0.0], seed=s)
              for s in range(3)]
    metrics = learner.train_step(groups)
    assert metrics["trainer/mismatch"] < 1e-4
    assert abs(metrics["trainer/kl_behaviour"]) < 1e-6
    assert abs(metrics["trainer/is_weight_mean"] - 1.0) < 1e-4
    assert metrics["trainer/is_truncated_frac"] == 0.0
    # control: scoring under another temperature than the group's is visibly off
    wrong = [make_group(prompt_token_ids=g.prompt_token_ids, samples=g.samples, vocab_size=VOCAB,
                        sampling={**SAMPLING, "temperature": 1.0}) for g in groups]
    assert learner.train_step(wrong)["trainer/mismatch"] > 100 * metrics["trainer/mismatch"]


def test_packed_and_padded_micro_batches_score_the_same_logprobs(model_dir):
    learner = Learner(model_dir, CONFIG, lora=LORA)
    assert learner.packing  # Llama reads restarting position_ids as separate sequences
    groups = [make_group(prompt_tokens=4, vocab_size=VOCAB, seed=s, samples=[
        make_sample(n, vocab_size=VOCAB, seed=10 * s + n) for n in (8, 1, 2, 5)])
        for s in range(3)]  # samples of 12, 5, 6 and 9 tokens share lines of 12
    (padded,) = make_micro_batches(groups, max_tokens=10_000)
    (packed,) = make_micro_batches(groups, max_tokens=10_000, packed=True)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]
    order = [packed.sample_ids.index(sid) for sid in padded.sample_ids]  # lines reorder them
    with torch.no_grad():
        got, expected = learner.score(packed)[order], learner.score(padded)  # [B, L-1] each
    mask = padded.attention_mask[:, 1:].bool()
    assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)


def test_packing_probe_detects_a_model_that_attends_across_packed_sequences(model_dir):
    from miles.trainer.model import packing_supported

    class IgnoresPositions(torch.nn.Module):  # a causal mask over the whole row
        def __init__(self, lm):
            super().__init__()
            self.lm, self.config = lm, lm.config

        def forward(self, input_ids, **kwargs):
            return self.lm(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           **kwargs)

    model = base_model(model_dir)
    assert packing_supported(model, torch.device("cpu"))
    assert not packing_supported(IgnoresPositions(model), torch.device("cpu"))


def test_exported_adapter_reproduces_the_learner_logits(model_dir, tmp_path):
    from peft import PeftModel

    learner = Learner(model_dir, CONFIG, lora=LORA)
    learner.train_step(random_groups())
    assert learner.export_weights(tmp_path / "adapter") == tmp_path / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()}
    fresh = PeftModel.from_pretrained(base_model(model_dir), tmp_path / "adapter").eval()
    batch = make_micro_batches(random_groups(2), max_tokens=1000)[0]
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, use_cache=False)
    with torch.no_grad():
        learner.model.eval()
        expected = learner.model(**inputs).logits  # [B, L, V]
        got = fresh(**inputs).logits  # [B, L, V]
        untrained = base_model(model_dir)(**inputs).logits  # [B, L, V]
    assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (untrained - expected).abs().max() > 1e-4  # the adapter did change the function


def test_full_fine_tuning_exports_weights_the_engine_and_from_pretrained_load(model_dir,
                                                                            tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.engines.hf import HFEngine

    learner = Learner(model_dir, CONFIG, lora=None)
    assert learner.weights_format == "full"
    learner.train_step(random_groups())
    assert learner.export_weights(tmp_path / "full") == tmp_path / "full"
    assert (tmp_path / "full" / "model.safetensors").is_file()
    batch = make_micro_batches(random_groups(2), max_tokens=1000)[0]
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, use_cache=False)
    engine = HFEngine(model_dir, lora=None)
    engine.load_version(tmp_path / "full", 1, "full")
    assert engine.policy_version == 1
    with torch.no_grad():
        learner.model.eval()
        expected = learner.model(**inputs).logits  # [B, L, V]
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()(**inputs).logits
        served = engine.model(**inputs).logits
        untrained = base_model(model_dir)(**inputs).logits
    assert_close(loaded, expected, atol=1e-5, rtol=1e-5)
    assert_close(served, expected, atol=1e-5, rtol=1e-5)
    assert (untrained - expected).abs().max() > 1e-4


def test_state_dict_round_trip_restores_weights_optimizer_and_version(model_dir, tmp_path):
    learner = Learner(model_dir, CONFIG, lora=LORA)
    learner.train_step(random_groups())
    dcp.save(learner.state_dict(), checkpoint_id=tmp_path / "ckpt")
    saved = full_params(learner.model)
    saved_optim = {k: {n: v.full_tensor().clone() if isinstance(v, DTensor) else v.clone()
                       for n, v in s.items()}
                   for k, s in learner.state_dict()["optimizer"]["state"].items()}
    next_groups = random_groups(3)
    learner.train_step(next_groups)
    assert not all(torch.equal(saved[n], p) for n, p in full_params(learner.model).items())

    restored = Learner(model_dir, CONFIG, lora=LORA)
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    restored.load_state_dict(state)
    assert restored.policy_version == 1
    for name, tensor in full_params(restored.model).items():
        assert torch.equal(tensor, saved[name]), name
    optim = restored.state_dict()["optimizer"]["state"]
    assert optim.keys() == saved_optim.keys()
    for key, values in saved_optim.items():
        for field, value in values.items():
            got = optim[key][field]
            assert_close(got.full_tensor() if isinstance(got, DTensor) else got, value)
    # same state, same data: the same next update as the learner that never stopped
    restored.train_step(next_groups)
    for name, tensor in full_params(restored.model).items():
        assert_close(tensor, full_params(learner.model)[name], atol=1e-6, rtol=1e-6)


def test_repeated_steps_raise_the_logprob_of_the_rewarded_sample(model_dir):
    learner = Learner(model_dir, CONFIG, lora=LORA)
    group = rollout(base_model(model_dir), np.array([5, 6, 7, 8], np.int32),
                    [1.0, 0.0, 0.0, 0.0], seed=3,
                    sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 6})
    (batch,) = make_micro_batches([group], max_tokens=1000)

    def sample_logprobs() -> list[float]:
        with torch.no_grad():
            logp = learner.score(batch)  # [n, L-1]
        by_row = [float(logp[r][batch.response_mask[r]].sum()) for r in range(len(logp))]
        return [by_row[batch.sample_ids.index((group.group_id, i))] for i in range(4)]

    start = sample_logprobs()
    for _ in range(5):
        learner.train_step([group])
    end = sample_logprobs()
    assert end[0] > start[0] + 0.5  # the rewarded sample became more likely
    assert all(e < s for e, s in zip(end[1:], start[1:]))  # the others less likely


@pytest.mark.parametrize("factor", [0.5, 2.0])  # the clip fires / does not
def test_clipping_sharded_gradients_matches_the_whole_gradients_norm(model_dir, factor):
    from miles.trainer.learner import clip_norm

    learner = Learner(model_dir, CONFIG, lora=LORA)
    params = learner.actor_params
    assert all(isinstance(p, DTensor) for p in params)
    torch.manual_seed(0)
    for p in params:
        p.grad = torch.randn_like(p)
    whole = [p.grad.full_tensor().clone() for p in params]
    norm = math.sqrt(sum(float(g.double().norm()) ** 2 for g in whole))
    assert clip_norm(params, factor * norm) == pytest.approx(norm, rel=1e-6)
    scale = min(1.0, factor * norm / (norm + 1e-6))
    for p, g in zip(params, whole):
        assert_close(p.grad.full_tensor(), g * scale)
