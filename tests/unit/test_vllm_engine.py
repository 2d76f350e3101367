"""The in-process vLLM engine against a fake vLLM shaped like the real one.

`FakeAsyncLLM` and the output classes below have the fields and call signatures of vLLM's
`AsyncLLM`, `RequestOutput`, `CompletionOutput` and `Logprob` (see `miles.engines.vllm_engine`
for the source read); tests/data/vllm_engine holds RequestOutputs as vLLM builds them for this
engine's requests (EOS is a stop token, so a stop on it names it in `stop_reason`). The fake
runs on the engine's real event-loop thread, so submission, waiting, cancelling and version
switching are the engine's own code. tests/vllm runs the real vLLM.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from miles.engines import vllm_engine, vllm_weights
from miles.engines.base import LoraSettings
from miles.engines.vllm_engine import (MAX_LORA_RANKS, ServedVersions, Served, VLLMEngine,
                                       VLLMEngineSettings, engine_args,
                                       lora_rank_limit, parse_request_output, request_values)
from miles.engines.vllm_weights import WeightLoader
from miles.errors import ConfigError, EngineError, EngineRejectedError, MilesError
from miles.rl.sampling import SamplingParams
from tests.factories import tokenizer_folder

DATA = Path(__file__).parent.parent / "data" / "vllm_engine"
VOCAB = 80  # config.json's vocab_size (the tokenizer has 78 tokens, the logits are padded)
EOS = 2  # "</s>" of the character tokenizer
PROMPTS = [[6, 14, 6, 18], [7, 16, 6, 18]]  # "2+2=", "3*2="
PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3)
SETTINGS = VLLMEngineSettings(timeout_s=5.0)
LORA = LoraSettings(r=8)
REAL_FIND_SPEC = importlib.util.find_spec


# -- a fake vLLM ----------------------------------------------------------------------------------

@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    lora_request: Any = None


@dataclass(frozen=True)
class LoRARequest:  # vllm.lora.request.LoRARequest
    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeSamplingParams:  # vllm.SamplingParams: keeps the keyword arguments it was built with
    def __init__(self, **values):
        self.values = values


def recorded_outputs() -> list[RequestOutput]:
    outputs = []
    for request in json.loads((DATA / "request_outputs_2x2.json").read_text()):
        samples = [CompletionOutput(**{**s, "logprobs": [
            {int(token): Logprob(**lp) for token, lp in position.items()}
            for position in s["logprobs"]]}) for s in request.pop("outputs")]
        outputs.append(RequestOutput(**request, outputs=samples))
    return outputs


def sampled(prompt: list[int], n: int, request_id: str = "r") -> RequestOutput:
    """n samples `[prompt[0] + k, EOS]`, each stopped on EOS, as vLLM reports them."""
    samples = [CompletionOutput(index=k, text="", token_ids=[prompt[0] + k, EOS],
                                cumulative_logprob=-0.75,
                                logprobs=[{prompt[0] + k: Logprob(-0.5, 1)}, {EOS: Logprob(-0.25)}],
                                finish_reason="stop", stop_reason=EOS) for k in range(n)]
    return RequestOutput(request_id, None, list(prompt), None, samples, True)


@dataclass
class FakeAsyncLLM:
    """vLLM's `AsyncLLM` as the engine uses it. Records every call; requests wait while `gate`
    is clear; `reply` builds each final output; `fail` makes the next call of that name raise."""

    args: dict
    requests: list = field(default_factory=list)  # (prompt ids, sampling values, lora_request)
    cancelled: list = field(default_factory=list)
    aborted: list = field(default_factory=list)  # ids aborted by `abort`
    added: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    rpcs: list = field(default_factory=list)
    resets: int = 0
    add_result: bool = True
    rpc_result: list = field(default_factory=lambda: [[]])
    fail: dict = field(default_factory=dict)
    errored: bool = False
    shut_down: bool = False
    gate: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    reply: Any = None

    def __post_init__(self):
        self.gate.set()
        self.reply = self.reply or (lambda ids, params: sampled(ids, params.values["n"]))

    @classmethod
    def from_engine_args(cls, args):
        return cls(args)

    def _maybe_fail(self, name):
        if name in self.fail:
            raise self.fail.pop(name)

    async def generate(self, prompt, sampling_params, request_id, *, lora_request=None):
        ids = prompt["prompt_token_ids"]
        self.requests.append((ids, sampling_params.values, lora_request))
        self._maybe_fail("generate")
        self.started.set()
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)  # the real one aborts the request here
            raise
        yield self.reply(ids, sampling_params)

    async def abort(self, request_id, internal=False):
        self.aborted.append(request_id)

    async def add_lora(self, lora_request):
        self._maybe_fail("add_lora")
        self.added.append(lora_request)
        return self.add_result

    async def remove_lora(self, lora_id):
        self._maybe_fail("remove_lora")
        self.removed.append(lora_id)
        return True

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._maybe_fail("collective_rpc")
        self.rpcs.append((method, args))
        return self.rpc_result

    async def reset_prefix_cache(self):
        self.resets += 1
        return True

    def shutdown(self):
        self.shut_down = True


FAKE_VLLM = SimpleNamespace(AsyncEngineArgs=dict, AsyncLLM=FakeAsyncLLM, LoRARequest=LoRARequest,
                            SamplingParams=FakeSamplingParams, FINAL_ONLY="FINAL_ONLY", DELTA="DELTA",
                            RequestErrors=(ValueError,), on_cpu=False)


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: FAKE_VLLM)
    return FAKE_VLLM


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.fixture
def make_engine(fake_vllm, tokenizer_dir):
    engines = []

    def make(settings: VLLMEngineSettings = SETTINGS, lora: LoraSettings | None = LORA):
        engine = VLLMEngine(tokenizer_dir, settings, lora=lora)
        engines.append(engine)
        return engine, engine._llm

    yield make
    for engine in engines:
        engine.close()


def write_adapter(folder: Path, r: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return folder


# -- settings and requests ------------------------------------------------------------------------

def test_engine_args_pin_the_logprobs_mode():
    args = engine_args("/m", VLLMEngineSettings(max_model_len=512, enforce_eager=True), 16)
    assert args == {
        "model": "/m", "tokenizer": "/m", "dtype": "auto", "seed": 0,
        "gpu_memory_utilization": 0.9, "enforce_eager": True, "tensor_parallel_size": 1,
        "logprobs_mode": "processed_logprobs", "generation_config": "vllm", "max_model_len": 512,
        "enable_lora": True, "max_lora_rank": 16, "max_loras": 2}
    full = engine_args("/m", VLLMEngineSettings())
    assert "enable_lora" not in full and "max_model_len" not in full
    assert full["worker_extension_cls"] == "miles.engines.vllm_weights.WeightLoader"


def test_on_cpu_the_kv_cache_is_sized_explicitly():
    """vLLM on CPU reads gpu_memory_utilization as a share of host memory, and refuses to start
    when that is more than is free; the KV cache is then sized in bytes instead."""
    assert "kv_cache_memory_bytes" not in engine_args("/m", VLLMEngineSettings())
    cpu = engine_args("/m", VLLMEngineSettings(), on_cpu=True)
    assert cpu["kv_cache_memory_bytes"] == int(vllm_engine.CPU_KV_CACHE_GIB * 2**30)
    chosen = VLLMEngineSettings(kv_cache_gib=0.25)
    for on_cpu in (False, True):
        assert engine_args("/m", chosen, on_cpu=on_cpu)["kv_cache_memory_bytes"] == 2**28


def test_lora_rank_limit_rounds_up_to_a_rank_vllm_accepts():
    assert lora_rank_limit(VLLMEngineSettings(), LoraSettings(r=16)) == 16
    assert lora_rank_limit(VLLMEngineSettings(), LoraSettings(r=20)) == 32
    assert lora_rank_limit(VLLMEngineSettings(max_lora_rank=64), LoraSettings(r=8)) == 64
    with pytest.raises(ConfigError, match="lora.r 16 is above vllm.max_lora_rank 8"):
        lora_rank_limit(VLLMEngineSettings(max_lora_rank=8), LoraSettings(r=16))
    with pytest.raises(ConfigError, match=f"accepts \\({MAX_LORA_RANKS[-1]}\\)"):
        lora_rank_limit(VLLMEngineSettings(), LoraSettings(r=600))


@pytest.mark.parametrize("bad", [{"dtype": "fp8"}, {"gpu_memory_utilization": 0},
                                 {"gpu_memory_utilization": 1.5}, {"max_model_len": -1},
                                 {"tensor_parallel_size": 0}, {"max_lora_rank": 20},
                                 {"max_loras": 1}, {"timeout_s": 0}, {"kv_cache_gib": -1}])
def test_settings_validate(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        VLLMEngineSettings(**bad)


def test_request_values_stop_on_eos_only_and_ask_for_the_sampled_logprob():
    assert request_values(PARAMS, vocab_size=VOCAB, eos_token_id=EOS) == {
        "n": 2, "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "logprobs": 0, "ignore_eos": True, "stop_token_ids": [EOS], "detokenize": False}
    values = request_values(SamplingParams(top_k=0), vocab_size=VOCAB, eos_token_id=EOS, seed=9)
    assert (values["top_k"], values["seed"]) == (-1, 9)
    with pytest.raises(EngineError, match="below 0.01"):
        request_values(SamplingParams(temperature=0.005), vocab_size=VOCAB, eos_token_id=EOS)


def test_served_versions_keep_an_adapter_while_it_is_used():
    versions = ServedVersions()
    base = versions.acquire()
    v3 = Served(3, lora="adapter-3")
    assert versions.switch(v3) == []  # the base weights are never removed
    assert versions.release(base) == []
    running = versions.acquire()
    assert running is v3
    v5 = Served(5, lora="adapter-5")
    assert versions.switch(v5) == []  # v3 is still in use
    assert versions.release(running) == [v3]
    assert versions.switch(Served(6, lora="adapter-6")) == [v5]  # unused: goes at once


def test_no_request_starts_while_full_weights_replace_the_weights():
    versions = ServedVersions()
    running = versions.acquire()
    with pytest.raises(EngineError, match="1 requests run on the weights"):
        with versions.replacing():
            pass
    versions.release(running)
    with versions.replacing():
        with pytest.raises(EngineError, match="no request can start"):
            versions.acquire()
    assert versions.acquire() is versions.current  # after the load


# -- parsing vLLM's outputs -----------------------------------------------------------------------

def parse_all(outputs, **overrides):
    options = {"n": 2, "vocab_size": VOCAB, "eos_token_id": EOS, "policy_version": 4, **overrides}
    return [parse_request_output(o, where=f"prompt {i}", **options)
            for i, o in enumerate(outputs)]


def test_parse_recorded_outputs():
    groups = parse_all(recorded_outputs())
    flat = [c for g in groups for c in g]
    assert [c.token_ids.tolist() for c in flat] == [[8, 6, 2], [8, 6, 6], [9, 4, 2], [10, 77, 5]]
    assert all(c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32 for c in flat)
    np.testing.assert_array_equal(flat[1].logprobs, np.array(
        [-0.10536051541566849, -1.2039728164672852, -2.995732307434082], dtype=np.float32))
    # EOS (a stop token); length; EOS as the last allowed token (vLLM: length); length
    assert [c.finish_reason for c in flat] == ["stop", "length", "stop", "length"]
    assert {c.policy_version for c in flat} == {4}


def sample_of(outputs, prompt=0, k=0):
    return outputs[prompt].outputs[k]


BAD_OUTPUTS = {
    "no logprobs": (lambda o: setattr(sample_of(o), "logprobs", None), "no logprobs"),
    "sampled token missing": (lambda o: sample_of(o).logprobs.__setitem__(
        1, {7: Logprob(-0.1)}), "position 1 has no logprob for its token 6"),
    "fewer positions": (lambda o: sample_of(o).logprobs.pop(), "3 token ids but 2"),
    "id outside vocab": (lambda o: (sample_of(o, 1, 1).token_ids.__setitem__(1, VOCAB),
                                    sample_of(o, 1, 1).logprobs.__setitem__(
                                        1, {VOCAB: Logprob(-0.1)})), "outside [0, 80)"),
    "nan logprob": (lambda o: setattr(sample_of(o).logprobs[0][8], "logprob", math.nan), "nan"),
    "-inf logprob": (lambda o: setattr(sample_of(o).logprobs[0][8], "logprob", -math.inf),
                     "not in"),
    "aborted": (lambda o: setattr(sample_of(o, 1, 1), "finish_reason", "abort"), "'abort'"),
    "unfinished sample": (lambda o: setattr(sample_of(o), "finish_reason", None), "None"),
    "stop on a string": (lambda o: (setattr(sample_of(o, 0, 1), "finish_reason", "stop"),
                                    setattr(sample_of(o, 0, 1), "stop_reason", "\n")),
                         "stopped on"),
    "wrong order": (lambda o: setattr(sample_of(o, 0, 1), "index", 0), "has index 0"),
    "a sample short": (lambda o: o[1].outputs.pop(), "expected 2 samples"),
    "unfinished request": (lambda o: setattr(o[0], "finished", False), "not a finished"),
}


@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
def test_bad_outputs_raise(case):
    change, message = BAD_OUTPUTS[case]
    outputs = recorded_outputs()
    change(outputs)
    with pytest.raises(EngineError) as info:
        parse_all(outputs)
    assert message in str(info.value)


def test_requests_with_stop_strings_detokenize_and_keep_the_string():
    plain = request_values(PARAMS, vocab_size=VOCAB, eos_token_id=EOS)
    values = request_values(PARAMS, vocab_size=VOCAB, eos_token_id=EOS,
                            stop_strings=("</tool>",))
    assert values == {**plain, "detokenize": True, "stop": ["</tool>"],
                      "include_stop_str_in_output": True}


# -- the engine -----------------------------------------------------------------------------------

def test_generate_submits_every_prompt_and_groups_by_prompt(make_engine):
    engine, llm = make_engine()
    assert (engine.vocab_size, engine.eos_token_id, engine.policy_version) == (VOCAB, EOS, 0)
    assert llm.args == engine_args(llm.args["model"], SETTINGS, 8)
    assert len(llm.requests) == 1  # the warm-up
    llm.reply = lambda ids, params: recorded_outputs()[PROMPTS.index(ids)]
    groups = engine.generate(PROMPTS, PARAMS, seed=7)
    submitted = llm.requests[1:]
    assert [ids for ids, _, _ in submitted] == PROMPTS
    expected = request_values(PARAMS, vocab_size=VOCAB, eos_token_id=EOS)  # unseeded
    assert all(values == {**expected, "output_kind": "FINAL_ONLY"} for _, values, _ in submitted)
    assert all(lora is None for _, _, lora in submitted)  # version 0 is the base model
    assert [[c.token_ids.tolist() for c in g] for g in groups] == [[[8, 6, 2], [8, 6, 6]],
                                                                    [[9, 4, 2], [10, 77, 5]]]
    assert {c.policy_version for g in groups for c in g} == {0}
    assert engine.decode(groups[0][0].token_ids) == "42" and engine.encode("2+2=") == PROMPTS[0]
    assert engine.generate([], PARAMS) == []
    for bad in ([[]], [[1, VOCAB]]):
        with pytest.raises(EngineError, match="prompt 0"):
            engine.generate(bad, PARAMS)


def stopped_on(text: str):
    """A reply whose samples stop on the stop string `text` (vLLM's stop_reason is the string)."""
    def reply(ids, params):
        output = sampled(ids, params.values["n"])
        for sample in output.outputs:
            sample.token_ids, sample.stop_reason = sample.token_ids[:1], text
            sample.logprobs = sample.logprobs[:1]
        return output
    return reply


def test_generate_with_stop_strings(make_engine):
    engine, llm = make_engine()
    llm.reply = stopped_on("</tool>")
    groups = engine.generate(PROMPTS, PARAMS, stop_strings=("</tool>",))
    assert all(values["stop"] == ["</tool>"] and values["detokenize"]
               for _, values, _ in llm.requests[1:])
    assert {c.finish_reason for g in groups for c in g} == {"stop_string"}
    assert [c.token_ids.tolist() for c in groups[0]] == [[PROMPTS[0][0]], [PROMPTS[0][0] + 1]]
    with pytest.raises(EngineError, match="stopped on '</tool>'"):  # a string it did not ask for
        engine.generate(PROMPTS, PARAMS)
    with pytest.raises(EngineError, match="stop_strings"):
        engine.generate(PROMPTS, PARAMS, stop_strings=("",))
    llm.reply = lambda ids, params: sampled(ids, params.values["n"])
    engine.generate(PROMPTS, PARAMS)
    assert llm.requests[-1][1]["detokenize"] is False and "stop" not in llm.requests[-1][1]


def test_seeded_generate_gives_every_sample_its_own_seed(make_engine):
    engine, llm = make_engine(VLLMEngineSettings(timeout_s=5.0, seeded=True, warmup=False))
    engine.generate(PROMPTS, PARAMS, seed=100)
    assert [values["seed"] for _, values, _ in llm.requests] == [100, 102]  # vLLM adds k
    engine.generate(PROMPTS, PARAMS)
    assert all("seed" not in values for _, values, _ in llm.requests[2:])


def test_in_flight_requests_keep_their_version(make_engine, tmp_path):
    engine, llm = make_engine()
    engine.load_adapter(write_adapter(tmp_path / "v3"), 3)
    v3 = llm.added[-1]
    assert (v3.lora_name, v3.lora_path) == ("miles-v3", str((tmp_path / "v3").resolve()))
    llm.gate.clear()
    llm.started.clear()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(engine.generate, PROMPTS, PARAMS)
        assert llm.started.wait(5)
        engine.load_adapter(write_adapter(tmp_path / "v5"), 5)  # does not wait for generate
        v5 = llm.added[-1]
        assert engine.policy_version == 5 and v5.lora_name == "miles-v5"
        assert v5.lora_int_id != v3.lora_int_id and llm.removed == []  # v3 is still in use
        llm.gate.set()
        old = running.result(5)
    assert {c.policy_version for g in old for c in g} == {3}
    assert {lora for _, _, lora in llm.requests[-2:]} == {v3}
    assert llm.removed == [v3.lora_int_id]  # gone once its last request finished
    new = engine.generate(PROMPTS, PARAMS)
    assert {c.policy_version for g in new for c in g} == {5}
    assert {lora for _, _, lora in llm.requests[-2:]} == {v5}


def test_a_failed_removal_is_logged_not_raised(make_engine, tmp_path, caplog):
    engine, llm = make_engine()
    engine.load_adapter(write_adapter(tmp_path / "v1"), 1)
    llm.fail["remove_lora"] = RuntimeError("busy")
    with caplog.at_level(logging.WARNING):
        engine.load_adapter(write_adapter(tmp_path / "v2"), 2)
    assert engine.policy_version == 2 and "miles-v1 stays loaded" in caplog.text


ADAPTER_FAILURES = {
    "missing files": (lambda llm, d: (d / "adapter_model.safetensors").unlink(), "lacks"),
    "rank too high": (lambda llm, d: write_adapter(d, r=16), "rank 16; this engine serves"),
    "config not json": (lambda llm, d: (d / "adapter_config.json").write_text("{"),
                        "cannot read adapter config"),
    "vllm raises": (lambda llm, d: llm.fail.update(add_lora=ValueError("LoRA rank 8 > 4")),
                    "add adapter miles-v5: ValueError('LoRA rank 8 > 4')"),
    "vllm refuses": (lambda llm, d: setattr(llm, "add_result", False), "did not add"),
}


@pytest.mark.parametrize("case", sorted(ADAPTER_FAILURES))
def test_a_failed_adapter_load_keeps_the_version(make_engine, tmp_path, case):
    engine, llm = make_engine()
    engine.load_adapter(write_adapter(tmp_path / "v3"), 3)
    v3 = llm.added[-1]
    folder = write_adapter(tmp_path / "v5")
    change, message = ADAPTER_FAILURES[case]
    change(llm, folder)
    with pytest.raises(EngineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.load_adapter(folder, 5)
    assert engine.policy_version == 3 and llm.removed == []
    groups = engine.generate(PROMPTS, PARAMS)
    assert llm.requests[-1][2] is v3 and groups[0][0].policy_version == 3


def test_loads_that_cannot_happen(make_engine, tmp_path):
    engine, llm = make_engine()
    engine.load_adapter(write_adapter(tmp_path / "v3"), 3)
    with pytest.raises(EngineError, match="not newer than the loaded version 3"):
        engine.load_adapter(write_adapter(tmp_path / "again"), 3)
    with pytest.raises(EngineError, match="load_adapter, not full weights"):
        engine.load_version(tmp_path, 4, "full")
    full, _ = make_engine(lora=None)
    with pytest.raises(EngineError, match="built without LoRA"):
        full.load_adapter(write_adapter(tmp_path / "v4"), 4)
    assert engine.policy_version == 3 and full.policy_version == 0


def test_a_new_lineage_may_go_back_in_version(make_engine, tmp_path):
    engine, llm = make_engine()
    engine.load_adapter(write_adapter(tmp_path / "v3"), 3)
    engine.load_version(write_adapter(tmp_path / "resumed-v3"), 3, "lora", new_lineage=True)
    assert engine.policy_version == 3 and llm.added[-1].lora_path.endswith("resumed-v3")
    engine.load_version(write_adapter(tmp_path / "resumed-v2"), 2, "lora", new_lineage=True)
    assert engine.policy_version == 2 and llm.added[-1].lora_path.endswith("resumed-v2")


def save_weights(path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, 4)}, path)
    return path


def test_full_weights_load_in_place_and_reset_the_prefix_cache(make_engine, tmp_path):
    engine, llm = make_engine(lora=None)
    weights = save_weights(tmp_path / "model.safetensors")
    engine.load_version(tmp_path, 7, "full")
    assert llm.rpcs == [("miles_load_safetensors", ([str(weights)],))] and llm.resets == 1
    assert engine.policy_version == 7
    assert engine.generate(PROMPTS, PARAMS)[1][1].policy_version == 7
    with pytest.raises(EngineError, match="no .safetensors files"):
        engine.load_full_weights(tmp_path / "empty", 8)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(EngineError, match="cannot read weights"):
        engine.load_full_weights(tmp_path / "bad", 8)
    assert engine.policy_version == 7 and len(llm.rpcs) == 1


@pytest.mark.parametrize("failure", ["missed parameters", "rpc raises"])
def test_a_full_load_that_fails_part_way_stops_generation(make_engine, tmp_path, failure):
    engine, llm = make_engine(lora=None)
    save_weights(tmp_path / "model.safetensors")
    if failure == "missed parameters":
        llm.rpc_result = [["lm_head.weight"]]
    else:
        llm.fail["collective_rpc"] = RuntimeError("CUDA error")
    with pytest.raises(EngineError, match="lm_head.weight|CUDA error"):
        engine.load_full_weights(tmp_path, 1)
    assert engine.policy_version == 0
    with pytest.raises(MilesError, match="unknown state") as info:
        engine.generate(PROMPTS, PARAMS)
    assert not isinstance(info.value, EngineError)  # not retried: the producer must restart


def test_weight_loader_reports_parameters_the_files_miss(tmp_path):
    from safetensors.torch import save_file

    class Model(torch.nn.Module):  # a vLLM model: load_weights returns the names it loaded
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4, 2)
            self.head = torch.nn.Linear(2, 4)

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            loaded = set()
            for name, tensor in weights:
                params[name].data.copy_(tensor)
                loaded.add(name)
            return loaded

    worker = type("Worker", (WeightLoader,), {})()
    worker.model_runner = SimpleNamespace(model=Model())
    save_file({"embed.weight": torch.ones(4, 2), "head.weight": torch.ones(4, 2)},
              tmp_path / "a.safetensors")
    save_file({"head.bias": torch.full((4,), 2.0)}, tmp_path / "b.safetensors")
    files = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert worker.miles_load_safetensors(files) == []
    assert torch.equal(worker.model_runner.model.head.bias, torch.full((4,), 2.0))
    assert worker.miles_load_safetensors(files[:1]) == ["head.bias"]


def test_full_weights_must_match_the_checkpoints_tensors(tmp_path):
    from safetensors.torch import save_file

    base = {"embed.weight": (4, 2), "head.weight": (4, 2)}
    save_file({"embed.weight": torch.ones(4, 2), "head.weight": torch.ones(4, 2)},
              tmp_path / "a.safetensors")
    files = [tmp_path / "a.safetensors"]
    assert vllm_weights.tensor_shapes(files) == base
    vllm_weights.check_covers(vllm_weights.tensor_shapes(files), base, tmp_path)
    cases = {"miss 1 tensors of the checkpoint": {"embed.weight": (4, 2)},
             "lacks: \\['extra'\\]": {**base, "extra": (1,)},
             "change tensor shapes: \\['head.weight \\(4, 3\\)": {**base, "head.weight": (4, 3)}}
    for message, shapes in cases.items():
        with pytest.raises(EngineError, match=message):
            vllm_weights.check_covers(shapes, base, tmp_path)


def test_a_full_load_that_does_not_cover_the_checkpoint_changes_nothing(make_engine, tmp_path):
    from safetensors.torch import save_file

    engine, llm = make_engine(lora=None)
    engine._checkpoint_shapes = {"model.embed_tokens.weight": (VOCAB, 4), "lm_head.weight": (4,)}
    save_weights(tmp_path / "model.safetensors")
    with pytest.raises(EngineError, match="miss 1 tensors"):
        engine.load_full_weights(tmp_path, 1)
    assert llm.rpcs == [] and engine.policy_version == 0
    assert len(engine.generate(PROMPTS, PARAMS)) == 2  # refused before anything was copied
    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, 4),
               "lm_head.weight": torch.zeros(4)}, tmp_path / "model.safetensors")
    engine.load_full_weights(tmp_path, 1)
    assert engine.policy_version == 1


def test_weight_loader_uses_the_workers_reload_and_reties_the_head(tmp_path):
    from safetensors.torch import save_file

    class Head(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight
            self.quant_method = self
            self.processed = 0

        def process_weights_after_loading(self, layer):
            layer.processed += 1

    embed = torch.nn.Embedding(4, 2)
    model = SimpleNamespace(lm_head=Head(embed.weight), model=SimpleNamespace(embed_tokens=embed))
    reloaded = []
    worker = type("Worker", (WeightLoader,), {
        "reload_weights": lambda self, weights_iterator: reloaded.extend(weights_iterator)})()
    worker.model_runner = SimpleNamespace(model=model, model_config=SimpleNamespace(
        hf_config=SimpleNamespace(tie_word_embeddings=True)))
    save_file({"embed.weight": torch.ones(4, 2)}, tmp_path / "a.safetensors")
    embed.weight = torch.nn.Parameter(torch.ones(4, 2))  # what a reload does to the embeddings
    assert worker.miles_load_safetensors([str(tmp_path / "a.safetensors")]) == []
    assert [name for name, _ in reloaded] == ["embed.weight"]
    assert model.lm_head.weight is embed.weight and model.lm_head.processed == 1


def test_streaming_requests_abort_and_wait_for_full_weights(make_engine, tmp_path):
    """Requests submitted one by one run beside each other; a full-weight load is refused while
    they run; `abort` cancels them in vLLM (and by id) and resolves them to None; those
    submitted after the load carry its version."""
    from safetensors.torch import save_file

    engine, llm = make_engine(lora=None)
    requests, warmed = engine.streaming_requests(), len(llm.requests)
    llm.gate.clear()
    running = [requests.submit(p, PARAMS) for p in PROMPTS]
    wait(lambda: len(llm.requests) == warmed + 2 and requests.in_flight == 2)
    assert [values["output_kind"] for _, values, _ in llm.requests[warmed:]] == ["DELTA"] * 2
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, weights)
    with pytest.raises(EngineError, match="2 requests run on the weights"):
        engine.load_full_weights(weights, 1)
    assert requests.abort(running) == {r: 0 for r in running}
    assert [r.future.result(0) for r in running] == [None, None]
    assert len(llm.cancelled) == 2 and llm.aborted == [[r.request_id for r in running]]
    engine.load_full_weights(weights, 1)
    llm.gate.set()
    groups = [requests.submit(p, PARAMS).future.result(5) for p in PROMPTS]
    assert [[c.token_ids.tolist() for c in g] for g in groups] == [
        [[6, EOS], [7, EOS]], [[7, EOS], [8, EOS]]]
    assert {c.policy_version for g in groups for c in g} == {1}
    assert requests.tokens_generated == 8 and requests.in_flight == 0


def test_a_cancelled_streaming_request_is_aborted(make_engine):
    engine, llm = make_engine()
    requests = engine.streaming_requests()
    llm.gate.clear()
    warmed = len(llm.requests)
    request = requests.submit(PROMPTS[0], PARAMS)
    wait(lambda: len(llm.requests) > warmed)
    request.future.cancel()  # the producer stopped waiting for it
    wait(lambda: llm.cancelled and requests.in_flight == 0)


def wait(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_vllm_errors_become_engine_errors(make_engine):
    engine, llm = make_engine()
    llm.fail["generate"] = ValueError("The decoder prompt (length 9000) is longer than ...")
    with pytest.raises(EngineRejectedError, match="generate: ValueError\\('The decoder prompt"):
        engine.generate(PROMPTS, PARAMS)  # the request's fault: its caller fails what asked
    llm.fail["generate"] = RuntimeError("a worker hiccup")
    with pytest.raises(EngineError) as info:
        engine.generate(PROMPTS, PARAMS)
    assert not isinstance(info.value, EngineRejectedError)
    llm.fail["generate"] = RuntimeError("EngineCore died")
    llm.errored = True
    with pytest.raises(MilesError, match="the vLLM engine died") as info:
        engine.generate(PROMPTS, PARAMS)
    assert not isinstance(info.value, EngineError)


def test_the_context_limit_is_the_max_model_len_vllm_serves(make_engine, monkeypatch):
    engine, _ = make_engine(VLLMEngineSettings(max_model_len=512, warmup=False))
    assert engine.context_limit == 512
    engine, _ = make_engine(VLLMEngineSettings(warmup=False))
    assert engine.context_limit is None  # the fake tells nothing; the real one always does
    monkeypatch.setattr(FakeAsyncLLM, "model_config", SimpleNamespace(max_model_len=2048),
                        raising=False)
    engine, _ = make_engine(VLLMEngineSettings(warmup=False))
    assert engine.context_limit == 2048  # the model's maximum, which vLLM chose


def test_a_slow_generate_times_out_and_aborts_its_requests(make_engine):
    engine, llm = make_engine(VLLMEngineSettings(timeout_s=0.3, warmup=False))
    llm.gate.clear()
    with pytest.raises(EngineError, match="no answer within 0.3 s"):
        engine.generate(PROMPTS, PARAMS)
    for _ in range(200):
        if len(llm.cancelled) == 2:
            break
        threading.Event().wait(0.01)
    assert len(llm.cancelled) == 2


def test_close_shuts_vllm_down(make_engine):
    engine, llm = make_engine()
    engine.close()
    assert llm.shut_down and not engine._thread.is_alive()


# -- engine selection in the producer -------------------------------------------------------------

def test_producer_engine_vllm_needs_the_extra(monkeypatch):
    from producers.rollout import ProducerSettings, build_engine

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else REAL_FIND_SPEC(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'miles\[vllm\]'"):
        build_engine(ProducerSettings(engine="vllm"))


def test_producer_builds_the_vllm_engine(fake_vllm, tokenizer_dir, monkeypatch):
    from miles.config import load_config
    from producers.rollout import ProducerSettings, build_engine

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        SimpleNamespace(name=name) if name == "vllm" else REAL_FIND_SPEC(name, *a)))
    settings = load_config(ProducerSettings, overrides=[
        "engine=vllm", f"model_dir={tokenizer_dir}", "vllm.enforce_eager=true",
        "vllm.gpu_memory_utilization=0.5", "vllm.max_model_len=256", "lora.r=16"], env={})
    assert settings.vllm == VLLMEngineSettings(enforce_eager=True, gpu_memory_utilization=0.5,
                                               max_model_len=256)
    engine = build_engine(settings)
    try:
        assert isinstance(engine, VLLMEngine) and engine.lora == LoraSettings(r=16)
        args = engine._llm.args
        assert (args["enforce_eager"], args["max_lora_rank"], args["model"]) == (
            True, 16, str(tokenizer_dir))
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="vllm.max_loras"):
        load_config(ProducerSettings, overrides=["vllm.max_loras=1"], env={})
