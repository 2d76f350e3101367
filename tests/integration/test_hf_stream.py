"""The Hugging Face engine's continuous batcher on a tiny model: requests joining mid-flight sample
what they would alone, logprobs are the model's, rows end and leave on their own, a weight load
between steps switches the version and the distribution of the following tokens, aborts, and a
cache that never grows past the longest context in flight."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.engines import HFEngine, LoraSettings
from miles.engines.hf_stream import Request, StreamingSampler
from miles.errors import EngineError
from miles.rl.sampling import SamplingParams, sampled_logprobs
from miles.tasks.tiny_model import build_tiny_model
from tests.integration.test_hf_engine import save_adapter

PROMPTS = ["37+48=", "1+2=", "123+456=", "9=", "1000+2000+3000="]  # different lengths
GREEDY = SamplingParams(n=2, top_k=1, max_new_tokens=16)
FILTERED = SamplingParams(n=3, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=20)
PLAIN = SamplingParams(n=2, temperature=1.0, max_new_tokens=20)
LORA = LoraSettings(r=4, alpha=8)
LOGPROB_TOLERANCE = 1e-5  # max |streamed - teacher-forced| in fp32 on CPU


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(model_dir)


@pytest.fixture(scope="module")
def sharp_engine(model_dir, tmp_path_factory):
    """An engine whose greedy tokens depend on the context (the tiny model's own greedy answer
    is the same character whatever the prompt): a random adapter loaded as version 1."""
    lora_engine = HFEngine(model_dir, lora=LORA)
    adapter = tmp_path_factory.mktemp("sharp") / "v1"
    save_adapter(model_dir, adapter, LORA, seed=1)
    lora_engine.load_adapter(adapter, 1)
    return lora_engine


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.encode(text) for text in PROMPTS]


def drain(sampler: StreamingSampler, schedule: list[tuple], on_step=None,
          max_steps: int = 500) -> list[Request]:
    """Submit each `(at_step, prompt, params, kwargs)` at its step, then step until every request
    is done or aborted; `on_step(step, requests)` runs before each step's submissions."""
    requests: list[Request | None] = [None] * len(schedule)
    for step in range(max_steps):
        if on_step is not None:
            on_step(step, requests)
        for i, (at, prompt, params, kwargs) in enumerate(schedule):
            if at == step:
                requests[i] = sampler.submit(prompt, params, **kwargs)
        sampler.step()
        if all(r is not None and (r.done or r.aborted) for r in requests):
            return requests
    raise AssertionError(f"not done after {max_steps} steps")


def teacher_forced(model, prompt: list[int], tokens: np.ndarray,
                   params: SamplingParams) -> torch.Tensor:
    """Logprobs [T] of `tokens` after `prompt` in one unpadded forward (positions 0..L-1)."""
    ids = torch.tensor([prompt + tokens.tolist()])  # [1, L]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [T, V]
    return sampled_logprobs(logits, torch.from_numpy(tokens).long(),
                            temperature=params.temperature, top_k=params.top_k,
                            top_p=params.top_p)


def assert_same(streamed, reference) -> None:
    assert streamed.token_ids.tolist() == reference.token_ids.tolist()
    np.testing.assert_allclose(streamed.logprobs, reference.logprobs, atol=LOGPROB_TOLERANCE)
    assert streamed.finish_reason == reference.finish_reason


def test_greedy_requests_joining_mid_flight_give_what_generate_gives(sharp_engine, prompts):
    reference = sharp_engine.generate(prompts, GREEDY)
    short = SamplingParams(n=1, top_k=1, max_new_tokens=5)
    schedule = [(at, p, GREEDY, {}) for at, p in zip([0, 3, 3, 7, 12], prompts)]
    requests = drain(StreamingSampler(sharp_engine), schedule + [(1, prompts[2], short, {})])
    texts = set()
    for request, group in zip(requests, reference):
        assert len(request.completions) == GREEDY.n
        for streamed, expected in zip(request.completions, group, strict=True):
            assert streamed.token_ids.tolist() == expected.token_ids.tolist()
            assert streamed.finish_reason == expected.finish_reason
            texts.add(sharp_engine.decode(streamed.token_ids))
        assert request.token_versions[0].tolist() == [1] * len(request.completions[0].token_ids)
    assert len(texts) == len(prompts)  # each prompt has its own greedy answer
    (cut,) = requests[-1].completions
    assert cut.token_ids.tolist() == reference[2][0].token_ids[:5].tolist()
    assert cut.finish_reason == "length"


def test_logprobs_of_rows_joining_mid_flight_are_the_models(engine, prompts):
    params = [FILTERED, PLAIN, FILTERED, PLAIN, PLAIN]
    schedule = [(at, p, sp, {"seed": i}) for i, (at, p, sp)
                in enumerate(zip([0, 2, 2, 5, 9], prompts, params))]
    requests = drain(StreamingSampler(engine), schedule)
    worst = 0.0
    for request, prompt, sp in zip(requests, prompts, params):
        for c, versions in zip(request.completions, request.token_versions, strict=True):
            expected = teacher_forced(engine.model, prompt, c.token_ids, sp)
            worst = max(worst, (torch.from_numpy(c.logprobs) - expected).abs().max().item())
            assert versions.tolist() == [0] * len(c.token_ids) and c.policy_version == 0
    print(f"max |streamed - teacher-forced| logprob = {worst:.2e}")
    assert worst <= LOGPROB_TOLERANCE
    assert max(len(c.token_ids) for r in requests for c in r.completions) >= 10


def test_qwen2_rows_joining_mid_flight_score_as_the_model(tmp_path):
    qwen = HFEngine(build_tiny_model(tmp_path / "qwen2", arch="qwen2", hidden_size=64, layers=2))
    prompts = [qwen.encode(text) for text in PROMPTS]
    schedule = [(at, p, FILTERED, {"seed": i}) for i, (at, p) in enumerate(zip([0, 2, 5], prompts))]
    for request, prompt in zip(drain(StreamingSampler(qwen), schedule), prompts):
        for c in request.completions:
            torch.testing.assert_close(torch.from_numpy(c.logprobs),
                                       teacher_forced(qwen.model, prompt, c.token_ids, FILTERED),
                                       rtol=0, atol=LOGPROB_TOLERANCE)


def test_a_sliding_window_model_is_refused_when_its_sampler_is_built(tmp_path):
    model_dir = build_tiny_model(tmp_path / "qwen2", arch="qwen2", hidden_size=64, layers=2)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                  layer_types=["sliding_attention"] * 2)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="DynamicSlidingWindowLayer"):
        HFEngine(model_dir).streaming_sampler()


def test_a_seeded_single_sample_is_the_same_alone_or_joined(engine, prompts):
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=20)
    schedule = [(at, p, params, {"seed": 10 + i})
                for i, (at, p) in enumerate(zip([0, 1, 4, 4, 6], prompts))]
    requests = drain(StreamingSampler(engine), schedule)
    for i, (request, prompt) in enumerate(zip(requests, prompts)):
        (alone,) = engine.generate([prompt], params, seed=10 + i)[0]
        assert_same(request.completions[0], alone)


def test_eos_stop_strings_and_the_budget_end_rows_as_in_generate(engine, prompts):
    long, short = (SamplingParams(n=1, temperature=1.0, max_new_tokens=k) for k in (24, 6))
    free = [engine.generate([p], long, seed=s)[0][0] for p in prompts for s in range(4)]
    texts = [engine.decode(c.token_ids) for c in free]
    stops = tuple(dict.fromkeys(t[5:7] for t in texts[::5] if len(t) >= 8))
    cases = [(p, long if s % 2 else short, s) for p in prompts for s in range(4)]
    schedule = [(i % 7, p, params, {"seed": s, "stop_strings": stops})
                for i, (p, params, s) in enumerate(cases)]
    requests = drain(StreamingSampler(engine), schedule)
    reasons = set()
    for (_, prompt, params, kwargs), request in zip(schedule, requests):
        (alone,) = engine.generate([prompt], params, **kwargs)[0]
        (streamed,) = request.completions
        assert_same(streamed, alone)
        reasons.add(streamed.finish_reason)
        if streamed.finish_reason == "stop":
            assert streamed.token_ids[-1] == engine.eos_token_id
        elif streamed.finish_reason == "length":
            assert len(streamed.token_ids) == params.max_new_tokens
    assert reasons == {"stop", "stop_string", "length"}


def test_tokens_after_a_weight_load_have_the_new_version_and_distribution(model_dir, prompts,
                                                                          tmp_path):
    lora_engine = HFEngine(model_dir, lora=LORA)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # version 0: lora_B is zero
    trained = save_adapter(model_dir, tmp_path / "v1", LORA, seed=1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=14)
    switch_at = 4

    def load_between_steps(step, requests):
        if step == switch_at:
            lora_engine.load_adapter(tmp_path / "v1", 1)

    schedule = [(0, prompts[0], params, {"seed": 1}), (1, prompts[1], params, {"seed": 2}),
                (switch_at, prompts[2], params, {"seed": 3})]
    requests = drain(lora_engine.streaming_sampler(), schedule, on_step=load_between_steps)
    spanning = 0
    for (at, prompt, _, _), request in zip(schedule, requests):
        for c, versions in zip(request.completions, request.token_versions, strict=True):
            before = min(max(0, switch_at - at), len(c.token_ids))  # sampled before the load
            assert versions.tolist() == [0] * before + [1] * (len(c.token_ids) - before)
            assert c.policy_version == versions[0]
            old = teacher_forced(base, prompt, c.token_ids, params)[:before]
            new = teacher_forced(trained, prompt, c.token_ids, params)[before:]
            torch.testing.assert_close(torch.from_numpy(c.logprobs),
                                       torch.cat([old, new]), rtol=0, atol=LOGPROB_TOLERANCE)
            if 0 < before < len(c.token_ids):
                spanning += 1
                stale = teacher_forced(base, prompt, c.token_ids, params)[before:]
                assert (stale - new).abs().max() > 1e-2  # the two versions do differ here
    assert spanning >= 2


def test_abort_drops_a_request_and_the_others_go_on_unchanged(engine, prompts):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20)
    sampler = StreamingSampler(engine)
    queued = []

    def abort_some(step, requests):
        if step != 3:
            return
        victim = requests[1]
        running = [row for row in victim.rows if row.finish_reason is None]
        assert running and sampler.rows_in_flight > len(running)
        rows, sampled = sampler.rows_in_flight, sum(len(row.tokens) for row in victim.rows)
        assert sampler.abort(victim) == sampled and sampler.tokens_wasted == sampled
        assert sampler.rows_in_flight == rows - len(running) and sampler.abort(victim) == 0
        queued.append(sampler.submit(prompts[3], params))
        assert sampler.abort(queued[0]) == 0  # queued, never ran

    schedule = [(0, p, params, {"seed": i}) for i, p in enumerate(prompts[:3])]
    requests = drain(sampler, schedule, on_step=abort_some)
    assert requests[1].aborted and not requests[1].done and not queued[0].done
    assert sampler.rows_in_flight == 0 and sampler.requests_pending == 0
    for i in (0, 2):
        alone = drain(StreamingSampler(engine), [schedule[i]])[0]
        for streamed, expected in zip(requests[i].completions, alone.completions, strict=True):
            assert_same(streamed, expected)


@pytest.mark.parametrize("fails_in", ["_sample", "_prefill"])
def test_a_step_that_raises_leaves_the_rows_in_flight_consistent(engine, prompts, fails_in,
                                                                 monkeypatch):
    """A step raises after the cache moved (`_sample`: decoded, no token appended) or while the
    rows were being rebuilt (`_prefill` after a weight load): the rows stay in flight, and the
    survivors' tokens are still scored by the model (a cache one token ahead of its rows gave
    logprobs off by 0.027)."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20)
    sampler = StreamingSampler(engine)
    requests = [sampler.submit(p, params, seed=i) for i, p in enumerate(prompts[:2])]
    for _ in range(3):
        sampler.step()
    real = getattr(sampler, fails_in)

    def broken(*args, **kwargs):
        raise EngineError("a step failed part-way")

    monkeypatch.setattr(sampler, fails_in, broken)
    if fails_in == "_prefill":
        engine.weight_loads += 1  # as after a load: the next step rebuilds every row
    rows = sampler.rows_in_flight
    with pytest.raises(EngineError, match="part-way"):
        sampler.step()
    monkeypatch.setattr(sampler, fails_in, real)
    assert sampler.rows_in_flight == rows
    sampler.abort(requests[0])
    while not requests[1].done:
        sampler.step()
    for completion in requests[1].completions:
        expected = teacher_forced(engine.model, prompts[1], completion.token_ids, params)
        np.testing.assert_allclose(completion.logprobs, expected.numpy(),
                                   atol=LOGPROB_TOLERANCE)


def test_the_cache_is_as_wide_as_the_longest_context_in_flight(engine, prompts):
    rng = np.random.default_rng(0)
    sampler = StreamingSampler(engine)
    schedule = [(int(rng.integers(0, 60)), prompts[int(rng.integers(0, len(prompts)))],
                 SamplingParams(n=int(rng.integers(1, 4)), temperature=1.0,
                                max_new_tokens=int(rng.integers(1, 30))), {"seed": i})
                for i in range(40)]
    widths = []

    def check_width(step, requests):
        contexts = [len(r.prompt) + len(row.tokens) - 1 for r in requests if r is not None
                    for row in r.rows if row.finish_reason is None]
        assert sampler.cache_width == max(contexts, default=0)
        widths.append(sampler.cache_width)

    drain(sampler, schedule, on_step=check_width)
    assert sampler.cache_width == 0 and sampler.rows_in_flight == 0
    assert max(widths) <= max(map(len, prompts)) + 30
    assert len(widths) > 60


def test_counters_submit_from_threads_and_bad_requests(engine, prompts):
    sampler = engine.streaming_sampler()
    assert sampler is engine.streaming_sampler()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    submitted: list[Request] = []

    def submit_some(offset: int):
        for i in range(5):
            submitted.append(sampler.submit(prompts[(offset + i) % len(prompts)], params))

    threads = [threading.Thread(target=submit_some, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    finished = []
    while any(t.is_alive() for t in threads) or sampler.requests_pending or sampler.rows_in_flight:
        finished += sampler.step()
    assert {id(r) for r in finished} == {id(r) for r in submitted} and len(submitted) == 20
    tokens = sum(len(c.token_ids) for r in submitted for c in r.completions)
    assert sampler.tokens_generated == tokens and sampler.steps <= 8 * 20
    assert sampler.busy_seconds > 0 and sampler.step() == []
    with pytest.raises(EngineError, match="empty"):
        sampler.submit([], params)
    with pytest.raises(EngineError, match="stop_strings"):
        sampler.submit(prompts[0], params, stop_strings="x")
