"""The in-process engine (engine "vllm") on the real vLLM: sampling, logprobs against the
trainer's, LoRA versions while requests run, full-weight loads (also beside streaming
requests), timeouts and aborts."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from miles.engines.base import LoraSettings  # noqa: E402
from miles.engines.vllm_engine import VLLMEngine  # noqa: E402
from miles.errors import EngineError  # noqa: E402
from miles.rl.sampling import SamplingParams  # noqa: E402
from tests.factories import mean_logprob_gap  # noqa: E402
from tests.vllm.conftest import PARAMS, TIER, random_adapter, trainer_model  # noqa: E402

LONG = SamplingParams(n=8, temperature=1.0, max_new_tokens=96)  # keeps requests running a while
IN_FLIGHT_WAIT_S = 60.0


@pytest.fixture(scope="module")
def full_engine(vllm_model_dir):
    engine = VLLMEngine(vllm_model_dir, TIER.settings, lora=None)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def lora_engine(vllm_model_dir):
    engine = VLLMEngine(vllm_model_dir, TIER.settings, lora=LoraSettings(r=8, alpha=16))
    yield engine
    engine.close()


def prompts_of(engine, texts):
    return [engine.encode(text) for text in texts]


def test_samples_carry_the_trainers_logprobs(full_engine, vllm_model_dir):
    prompts = prompts_of(full_engine, ["2+2=", "The answer:"])
    groups = full_engine.generate(prompts, PARAMS)
    assert [len(g) for g in groups] == [4, 4]
    assert {c.policy_version for g in groups for c in g} == {0}
    for completion in (c for g in groups for c in g):
        assert 1 <= len(completion.token_ids) <= PARAMS.max_new_tokens
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == full_engine.eos_token_id
    gap = mean_logprob_gap(trainer_model(vllm_model_dir), prompts, groups, PARAMS)
    assert gap <= TIER.logprob_tolerance, gap


def test_a_stop_string_ends_a_response_and_stays_in_it(full_engine, vllm_model_dir):
    """Greedy, so the same prompt gives the same tokens with and without the stop string: the
    stopped response is the free one up to the token whose text completes the string (kept),
    its finish reason "stop_string", and its logprobs still the trainer's. Runs before the
    full-weight load below changes the module's engine."""
    greedy = SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=16)
    prompts = prompts_of(full_engine, ["2+2=", "The answer:"])
    free = [group[0] for group in full_engine.generate(prompts, greedy)]
    texts = [full_engine.decode(c.token_ids) for c in free]
    stops = tuple(dict.fromkeys(t[4:6] for t in texts if len(t) >= 8))
    assert stops, texts
    stopped = full_engine.generate(prompts, greedy, stop_strings=stops)
    for before, (after,) in zip(free, stopped):
        hit = next((k for k in range(1, len(before.token_ids) + 1)
                    if any(s in full_engine.decode(before.token_ids[:k]) for s in stops)), None)
        if hit is None:
            assert after.token_ids.tolist() == before.token_ids.tolist()
            continue
        assert after.finish_reason == "stop_string"
        assert after.token_ids.tolist() == before.token_ids[:hit].tolist()
    gap = mean_logprob_gap(trainer_model(vllm_model_dir), prompts, stopped, greedy)
    assert gap <= TIER.logprob_tolerance, gap


def test_full_weights_load_in_place_and_the_prefix_cache_is_reset(full_engine, vllm_model_dir,
                                                                  tmp_path):
    """A long prompt sampled before the load is in the prefix cache; after the load its
    logprobs must be the new weights', which they are only if the cached KV blocks of the old
    weights were dropped."""
    assert full_engine._llm.vllm_config.cache_config.enable_prefix_caching
    prompts = prompts_of(full_engine, ["1+2+3+4+5+6+7+8+9+10+11+12+13+14+15+16+17+18+19+20="])
    full_engine.generate(prompts, PARAMS)
    new_dir = scaled_checkpoint(vllm_model_dir, tmp_path / "v1", 0.5)
    full_engine.load_version(new_dir, 1, "full")
    groups = full_engine.generate(prompts, PARAMS)
    assert full_engine.policy_version == 1
    assert {c.policy_version for g in groups for c in g} == {1}
    gap = mean_logprob_gap(trainer_model(new_dir), prompts, groups, PARAMS)
    assert gap <= TIER.logprob_tolerance, gap
    old_gap = mean_logprob_gap(trainer_model(vllm_model_dir), prompts, groups, PARAMS)
    assert old_gap > 100 * TIER.logprob_tolerance  # the load changed what is sampled


def test_streaming_requests_and_a_full_weight_load(full_engine, vllm_model_dir, tmp_path):
    """Streaming requests run side by side; a full-weight load is refused while they run (it
    would replace their weights under them); `abort` ends them in vLLM (futures None, tokens
    counted wasted); requests submitted after the load run on the new weights."""
    requests = full_engine.streaming_requests()
    version, wasted_before = full_engine.policy_version + 1, requests.tokens_wasted
    prompts = prompts_of(full_engine, [f"{i}*{i}=" for i in range(3)])
    running = [requests.submit(p, LONG) for p in prompts]
    wait_for(lambda: all(r.tokens > 0 for r in running), "tokens from every request")
    new_dir = scaled_checkpoint(vllm_model_dir, tmp_path / "v", 0.25)
    with pytest.raises(EngineError, match="3 requests run on the weights"):
        full_engine.load_version(new_dir, version, "full")
    wasted = requests.abort(running)
    assert [r.future.result(0) for r in running] == [None] * 3
    assert all(wasted[r] >= 1 for r in running)
    assert requests.tokens_wasted - wasted_before == sum(wasted.values())
    assert full_engine._llm.get_num_unfinished_requests() == 0 and requests.in_flight == 0
    full_engine.load_version(new_dir, version, "full")
    after = [requests.submit(p, PARAMS) for p in prompts[:2]]
    groups = [r.future.result(TIER.settings.timeout_s) for r in after]
    assert {c.policy_version for g in groups for c in g} == {version}
    gap = mean_logprob_gap(trainer_model(new_dir), prompts[:2], groups, PARAMS)
    assert gap <= TIER.logprob_tolerance, gap


def test_a_generate_past_its_timeout_aborts_its_requests(full_engine):
    prompts = prompts_of(full_engine, [f"{i}*{i}=" for i in range(32)])
    settings = full_engine.settings
    full_engine.settings = replace(settings, timeout_s=0.05)
    try:
        with pytest.raises(EngineError, match="no answer within 0.05 s"):
            full_engine.generate(prompts, LONG)
    finally:
        full_engine.settings = settings
    wait_for(lambda: full_engine._llm.get_num_unfinished_requests() == 0, "the aborts")
    groups = full_engine.generate(prompts[:2], PARAMS)  # the engine goes on
    assert [len(g) for g in groups] == [4, 4]


def test_a_lora_version_lands_while_requests_run(lora_engine, vllm_model_dir, tmp_path):
    """Requests submitted under version 1 finish on it although version 2 is loaded meanwhile;
    version 1's adapter is removed once nothing uses it; later requests run on version 2."""
    v1 = random_adapter(vllm_model_dir, tmp_path / "v1", seed=1)
    v2 = random_adapter(vllm_model_dir, tmp_path / "v2", seed=2)
    lora_engine.load_version(v1, 1, "lora")
    prompts = prompts_of(lora_engine, [f"{i}+{i}=" for i in range(24)])
    running: dict = {}
    thread = threading.Thread(target=lambda: running.update(
        groups=lora_engine.generate(prompts, LONG)))
    thread.start()
    wait_for(lambda: lora_engine._llm.get_num_unfinished_requests() > 0, "requests in flight")
    lora_engine.load_version(v2, 2, "lora")
    assert thread.is_alive(), "the generate ended before version 2 landed: make it longer"
    thread.join(TIER.settings.timeout_s)
    assert {c.policy_version for g in running["groups"] for c in g} == {1}
    sample = [g[:2] for g in running["groups"][:4]]
    assert mean_logprob_gap(trainer_model(vllm_model_dir, v1), prompts[:4], sample,
                            LONG) <= TIER.logprob_tolerance
    loras = set(lora_engine._call(lora_engine._llm.list_loras(), "list adapters"))
    assert loras == {lora_engine._versions.current.lora.lora_int_id}  # v1 is gone
    groups = lora_engine.generate(prompts[:2], PARAMS)
    assert {c.policy_version for g in groups for c in g} == {2}
    model = trainer_model(vllm_model_dir, v2)
    assert mean_logprob_gap(model, prompts[:2], groups, PARAMS) <= TIER.logprob_tolerance
    base_gap = mean_logprob_gap(trainer_model(vllm_model_dir), prompts[:2], groups, PARAMS)
    assert base_gap > 100 * TIER.logprob_tolerance  # the adapter changed what is sampled


def scaled_checkpoint(model_dir, out, factor: float):
    """A copy of the checkpoint with its embeddings scaled by `factor`: other full weights."""
    from safetensors.torch import load_file, save_file

    new_dir = shutil.copytree(model_dir, out)
    state = load_file(new_dir / "model.safetensors")
    save_file({k: v * factor if k.endswith("embed_tokens.weight") else v
               for k, v in state.items()}, new_dir / "model.safetensors")
    return new_dir


def wait_for(condition, what: str, timeout_s: float = IN_FLIGHT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.005)


