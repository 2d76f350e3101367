"""The vLLM server engine against recorded vLLM replies, served by a local HTTP server.

The replies in tests/data/vllm_server are shaped exactly like vLLM's OpenAI-compatible server
writes them (see `miles.engines.vllm_api` for the source read). A tiny `http.server` on 127.0.0.1
replays them, so the real HTTP code runs; tests/vllm starts and talks to a real vLLM server.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from miles.engines.vllm_api import (check_processed_logprobs, completion_request, error_message,
                                    parse_completions, pick_base_model, probe_request)
from miles.engines.vllm_server import (VLLMServerEngine, VLLMServerSettings, run_with_deadline,
                                       server_root)
from miles.errors import ConfigError, EngineError, EngineRejectedError, EngineUnavailableError
from miles.rl.sampling import SamplingParams
from tests.factories import tokenizer_folder

DATA = Path(__file__).parent.parent / "data" / "vllm_server"
VOCAB = 80  # config.json's vocab_size (the tokenizer has 78 tokens, the logits are padded)
EOS = 2  # "</s>" of the character tokenizer
PROMPTS = [[6, 14, 6, 18], [7, 16, 6, 18]]  # "2+2=", "3*2="
PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3)
REAL_FIND_SPEC = importlib.util.find_spec


def recorded(name: str):
    return json.loads((DATA / name).read_text())


class FakeVLLM:
    """Replays canned replies per (method, path); the last one of a route repeats. Records
    every request as (method, path, json body or None, headers)."""

    def __init__(self):
        self.routes: dict[tuple[str, str], list[tuple[int, object, float]]] = {}
        self.requests: list[tuple[str, str, object, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def _answer(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                fake.requests.append((method, self.path, json.loads(raw) if raw else None,
                                      dict(self.headers)))
                queue = fake.routes.get((method, self.path)) or [(404, {"detail": "Not Found"},
                                                                   0.0)]
                status, body, delay = queue.pop(0) if len(queue) > 1 else queue[0]
                time.sleep(delay)
                data = body if isinstance(body, bytes) else (
                    body.encode() if isinstance(body, str) else json.dumps(body).encode())
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       daemon=True)
        self.thread.start()
        self.route("GET", "/v1/models", recorded("models.json"))

    def route(self, method: str, path: str, *replies, status: int = 200, delay: float = 0.0):
        """Replies in order; each a body (status `status`) or a (status, body) pair."""
        self.routes[(method, path)] = [(r[0], r[1], delay) if isinstance(r, tuple)
                                       else (status, r, delay) for r in replies]

    def posted(self, path: str) -> list:
        return [body for method, p, body, _ in self.requests if method == "POST" and p == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.fixture
def adapter(tmp_path) -> Path:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_text("{}")
    return tmp_path


def engine_for(fake: FakeVLLM, tokenizer_dir: Path, model: str = "tiny",
               **kwargs) -> VLLMServerEngine:
    options = {"timeout_s": 5.0, "lora": True, "check_logprobs_mode": False, **kwargs}
    return VLLMServerEngine(fake.url + "/v1/", model, tokenizer_dir, **options)


def parse(reply, **overrides):
    options = {"n_prompts": 2, "n": 2, "vocab_size": VOCAB, "eos_token_id": EOS,
               "policy_version": 4, **overrides}
    return parse_completions(reply, **options)


# -- request bodies -------------------------------------------------------------------------------

def test_completion_request_pins_every_sampling_value():
    body = completion_request(PROMPTS, PARAMS, model="miles-v3", vocab_size=VOCAB)
    assert body == {
        "model": "miles-v3", "prompt": PROMPTS, "n": 2, "max_tokens": 3, "temperature": 0.7,
        "top_p": 0.9, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": 0,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "stream": False}
    json.dumps(body)  # plain JSON types only


@pytest.mark.parametrize("top_k, sent", [(0, -1), (5, 5), (VOCAB - 1, VOCAB - 1), (VOCAB, -1)])
def test_top_k_disabled_is_sent_as_minus_one(top_k, sent):
    params = SamplingParams(top_k=top_k)
    assert completion_request([[1]], params, model="m", vocab_size=VOCAB)["top_k"] == sent


def test_completion_request_seed_and_numpy_prompts():
    body = completion_request([np.array([3, 4], dtype=np.int32)], PARAMS, model="m",
                              vocab_size=VOCAB, seed=11)
    assert body["seed"] == 11 and body["prompt"] == [[3, 4]]
    assert type(body["prompt"][0][0]) is int


def test_probe_request_asks_for_runners_up_under_top_k_1():
    body = probe_request([5, 6], model="tiny")
    assert (body["top_k"], body["logprobs"], body["max_tokens"], body["n"]) == (1, 2, 1, 1)
    assert body["prompt"] == [[5, 6]] and body["model"] == "tiny"


# -- reply parsing --------------------------------------------------------------------------------

def test_parse_recorded_reply():
    groups = parse(recorded("completion_2x2.json"))
    assert [len(g) for g in groups] == [2, 2]
    flat = [c for g in groups for c in g]
    assert [c.token_ids.tolist() for c in flat] == [[8, 6, 2], [8, 6, 6], [9, 4, 2], [10, 77]]
    assert all(c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32 for c in flat)
    np.testing.assert_array_equal(
        flat[0].logprobs, np.array([-0.10536051541566849, -1.2039728164672852,
                                    -0.0020020026713609695], dtype=np.float32))
    # stop on EOS; length; EOS on the last allowed token (vLLM: length); a server stop token
    assert [c.finish_reason for c in flat] == ["stop", "length", "stop", "stop"]
    assert {c.policy_version for c in flat} == {4}


def test_parse_without_token_ids_reads_token_strings():
    reply = recorded("completion_2x2.json")
    for choice in reply["choices"]:
        del choice["token_ids"]  # servers before return_token_ids
    assert parse(reply)[1][0].token_ids.tolist() == [9, 4, 2]


def mutate(path: str, value):
    def apply(reply):
        *keys, last = path.split(".")
        node = reply
        for key in keys:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is DELETE:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value
        return reply
    return apply


DELETE = object()
BAD_REPLIES = {
    "missing logprobs": (mutate("choices.0.logprobs", None), "no logprobs"),
    "null logprob": (mutate("choices.1.logprobs.token_logprobs.2", None), "logprob None"),
    "-inf logprob": (mutate("choices.1.logprobs.token_logprobs.0", -9999.0), "not in"),
    "positive logprob": (mutate("choices.1.logprobs.token_logprobs.0", 0.5), "not in"),
    "id outside vocab": (lambda r: mutate("choices.2.token_ids", [9, 4, VOCAB])(
        mutate("choices.2.logprobs.tokens", ["token_id:9", "token_id:4", f"token_id:{VOCAB}"])(r)),
        "outside [0, 80)"),
    "negative id": (lambda r: mutate("choices.2.token_ids", [9, -4, 2])(
        mutate("choices.2.logprobs.tokens", DELETE)(r)), "outside [0, 80)"),
    "ids disagree": (mutate("choices.0.token_ids", [8, 6, 3]), "disagree"),
    "bad token string": (mutate("choices.0.logprobs.tokens.1", "6"), "token_id:N"),
    "fewer logprobs": (mutate("choices.0.logprobs.token_logprobs", [-0.1, -0.2]), "3 token ids"),
    "empty response": (lambda r: mutate("choices.0.token_ids", [])(mutate(
        "choices.0.logprobs.tokens", [])(mutate("choices.0.logprobs.token_logprobs", [])(r))),
        "empty response"),
    "abort": (mutate("choices.3.finish_reason", "abort"), "'abort'"),
    "no finish reason": (mutate("choices.3.finish_reason", None), "None"),
    "stop on a string": (mutate("choices.3.stop_reason", "\n"), "stopped on"),
    "wrong order": (mutate("choices.1.index", 3), "index 1"),
    "no choices": (mutate("choices", DELETE), "without choices"),
}


@pytest.mark.parametrize("case", sorted(BAD_REPLIES))
def test_bad_replies_raise(case):
    change, message = BAD_REPLIES[case]
    with pytest.raises(EngineError) as info:
        parse(change(recorded("completion_2x2.json")))
    assert message in str(info.value)


def test_a_stop_on_a_requested_stop_string_is_stop_string():
    reply = mutate("choices.3.stop_reason", "</tool>")(recorded("completion_2x2.json"))
    assert parse(reply, stop_strings=("</tool>",))[1][1].finish_reason == "stop_string"
    with pytest.raises(EngineError, match="stopped on '</tool>'"):  # not one it asked for
        parse(reply, stop_strings=("</tool_call>",))


@pytest.mark.parametrize("n_prompts, n", [(1, 2), (2, 1), (3, 2)])
def test_choice_count_must_be_prompts_times_n(n_prompts, n):
    with pytest.raises(EngineError, match=f"expected {n_prompts} x {n} choices"):
        parse(recorded("completion_2x2.json"), n_prompts=n_prompts, n=n)


def test_probe_accepts_processed_and_rejects_raw_logprobs():
    check_processed_logprobs(recorded("probe_processed.json"))
    with pytest.raises(EngineError, match="--logprobs-mode processed_logprobs"):
        check_processed_logprobs(recorded("probe_raw.json"))
    logits = recorded("probe_processed.json")  # processed_logits: masked -inf, sampled a logit
    logits["choices"][0]["logprobs"]["token_logprobs"] = [3.25]
    with pytest.raises(EngineError, match="processed_logprobs"):
        check_processed_logprobs(logits)
    with pytest.raises(EngineError, match="unexpected reply shape"):
        check_processed_logprobs({"choices": []})


@pytest.mark.parametrize("raw, message", [
    (json.dumps(recorded("error_model_not_found.json")).encode(),
     "The model `miles-v9` does not exist."),
    (b'{"object": "error", "message": "old style", "type": "BadRequestError", "code": 400}',
     "old style"),
    (b'{"detail": "Not Found"}', "Not Found"),
    (b"Internal Server Error", "Internal Server Error"),
    (b"", "(empty body)"),
])
def test_error_message(raw, message):
    assert error_message(raw) == message


def test_pick_base_model():
    cards = recorded("models_with_adapters.json")["data"]
    assert pick_base_model(cards, "tiny") == "tiny"
    assert pick_base_model(cards, "") == "tiny"
    with pytest.raises(EngineError, match="expected 'miles-v3'"):
        pick_base_model(cards, "miles-v3")  # an adapter, not a base model
    with pytest.raises(EngineError, match="one base model"):
        pick_base_model(cards + [{"id": "other", "parent": None}], "")


def test_settings_validate_and_root_url():
    assert server_root("http://h:8000/v1/") == server_root("http://h:8000") == "http://h:8000"
    for bad in ({"base_url": "h:8000"}, {"timeout_s": 0}, {"adapter_prefix": "a b"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            VLLMServerSettings(**bad)


# -- the engine over HTTP -------------------------------------------------------------------------

def test_generate_sends_one_request_and_groups_by_prompt(fake, tokenizer_dir):
    fake.route("POST", "/v1/completions", recorded("completion_2x2.json"))
    engine = engine_for(fake, tokenizer_dir, api_key="secret")
    assert (engine.vocab_size, engine.eos_token_id, engine.base_model) == (VOCAB, EOS, "tiny")
    groups = engine.generate(PROMPTS, PARAMS, seed=7)
    [body] = fake.posted("/v1/completions")
    assert body == completion_request(PROMPTS, PARAMS, model="tiny", vocab_size=VOCAB)  # no seed
    assert fake.requests[-1][3]["Authorization"] == "Bearer secret"
    assert [[c.token_ids.tolist() for c in g] for g in groups] == [[[8, 6, 2], [8, 6, 6]],
                                                                    [[9, 4, 2], [10, 77]]]
    assert {c.policy_version for g in groups for c in g} == {0}
    assert engine.decode(groups[0][0].token_ids) == "42"
    assert engine.encode("2+2=") == PROMPTS[0]


def test_stop_strings_go_as_stop_and_stay_in_the_output(fake, tokenizer_dir):
    body = completion_request(PROMPTS, PARAMS, model="tiny", vocab_size=VOCAB,
                              stop_strings=("</tool>", "\n"))
    plain = completion_request(PROMPTS, PARAMS, model="tiny", vocab_size=VOCAB)
    assert body == {**plain, "stop": ["</tool>", "\n"], "include_stop_str_in_output": True}
    reply = mutate("choices.3.stop_reason", "</tool>")(recorded("completion_2x2.json"))
    fake.route("POST", "/v1/completions", reply, recorded("completion_2x2.json"))
    engine = engine_for(fake, tokenizer_dir)
    groups = engine.generate(PROMPTS, PARAMS, stop_strings=("</tool>", "\n"))
    assert fake.posted("/v1/completions")[-1] == body
    assert [c.finish_reason for g in groups for c in g] == ["stop", "length", "stop",
                                                            "stop_string"]
    engine.generate(PROMPTS, PARAMS)  # without stop strings the body is as before
    assert fake.posted("/v1/completions")[-1] == plain
    with pytest.raises(EngineError, match="stop_strings"):
        engine.generate(PROMPTS, PARAMS, stop_strings="</tool>")


def test_seeded_generate_sends_one_request_per_prompt(fake, tokenizer_dir):
    reply = recorded("completion_2x2.json")
    first, second = copy.deepcopy(reply), copy.deepcopy(reply)
    first["choices"], second["choices"] = reply["choices"][:2], reply["choices"][2:]
    for i, choice in enumerate(second["choices"]):
        choice["index"] = i
    fake.route("POST", "/v1/completions", first, second)
    engine = engine_for(fake, tokenizer_dir, seeded=True)
    groups = engine.generate(PROMPTS, PARAMS, seed=100)
    bodies = sorted(fake.posted("/v1/completions"), key=lambda b: b["seed"])
    assert [(b["prompt"], b["seed"]) for b in bodies] == [([PROMPTS[0]], 100), ([PROMPTS[1]], 102)]
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)


def test_generate_checks_prompts_before_sending(fake, tokenizer_dir):
    engine = engine_for(fake, tokenizer_dir)
    assert engine.generate([], PARAMS) == []
    for bad in ([[]], [[1, VOCAB]], [[-1]]):
        with pytest.raises(EngineError, match="prompt 0"):
            engine.generate(bad, PARAMS)
    assert fake.posted("/v1/completions") == []


def test_adapter_versions_switch_the_model_name(fake, tokenizer_dir, adapter, tmp_path_factory):
    fake.route("POST", "/v1/completions", recorded("completion_2x2.json"))
    fake.route("POST", "/v1/load_lora_adapter",
               "Success: LoRA adapter 'miles-v3' added successfully.")
    fake.route("POST", "/v1/unload_lora_adapter", "Success: LoRA adapter removed successfully.")
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 3)
    assert (engine.policy_version, engine.served_model) == (3, "miles-v3")
    assert fake.posted("/v1/load_lora_adapter") == [{"lora_name": "miles-v3",
                                                     "lora_path": str(adapter.resolve())}]
    assert fake.posted("/v1/unload_lora_adapter") == []  # the base model is never unloaded
    groups = engine.generate(PROMPTS, PARAMS)
    assert fake.posted("/v1/completions")[-1]["model"] == "miles-v3"
    assert {c.policy_version for g in groups for c in g} == {3}

    second = tmp_path_factory.mktemp("v5")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (second / name).write_text("{}")
    engine.load_version(second, 5, "lora")
    assert fake.posted("/v1/load_lora_adapter")[-1]["lora_name"] == "miles-v5"
    assert fake.posted("/v1/unload_lora_adapter") == [{"lora_name": "miles-v3"}]
    engine.generate(PROMPTS, PARAMS)
    assert fake.posted("/v1/completions")[-1]["model"] == "miles-v5"


def test_a_new_lineage_s_version_of_the_served_number_loads_under_another_name(
        fake, tokenizer_dir, adapter):
    fake.route("POST", "/v1/load_lora_adapter", "Success")
    fake.route("POST", "/v1/unload_lora_adapter", "Success")
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 5)
    engine.load_version(adapter, 5, "lora", new_lineage=True)  # a resumed trainer's version 5
    assert [b["lora_name"] for b in fake.posted("/v1/load_lora_adapter")] == [
        "miles-v5", "miles-v5-reload"]
    assert fake.posted("/v1/unload_lora_adapter") == [{"lora_name": "miles-v5"}]
    engine.load_version(adapter, 2, "lora", new_lineage=True)
    assert (engine.policy_version, engine.served_model) == (2, "miles-v2")


def test_a_restarted_server_gets_the_served_adapter_again(fake, tokenizer_dir, adapter):
    """A server restarted since the adapter was loaded answers 404 for its name: the engine
    loads the same folder under the same name and retries the batch once (the real restart is
    tests/vllm/test_producer.py)."""
    fake.route("POST", "/v1/load_lora_adapter", "Success")
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 3)
    fake.route("POST", "/v1/completions", (404, recorded("error_model_not_found.json")),
               recorded("completion_2x2.json"))
    groups = engine.generate(PROMPTS, PARAMS)
    assert {c.policy_version for g in groups for c in g} == {3}
    assert fake.posted("/v1/load_lora_adapter") == 2 * [{"lora_name": "miles-v3",
                                                         "lora_path": str(adapter.resolve())}]
    assert [b["model"] for b in fake.posted("/v1/completions")] == ["miles-v3", "miles-v3"]
    fake.route("POST", "/v1/completions", (404, recorded("error_model_not_found.json")))
    with pytest.raises(EngineError, match="HTTP 404"):  # still unknown after loading: raised
        engine.generate(PROMPTS, PARAMS)


def test_a_switch_during_a_generate_neither_waits_nor_unloads_its_adapter(
        fake, tokenizer_dir, adapter):
    """A streaming producer's generates run while versions load: the one in flight keeps its
    adapter and version, the next names the new adapter, and the old adapter is unloaded only
    when its last generate has its reply."""
    fake.route("POST", "/v1/load_lora_adapter", "Success")
    fake.route("POST", "/v1/unload_lora_adapter", "Success")
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 3)
    fake.route("POST", "/v1/completions", recorded("completion_2x2.json"), delay=1.0)
    slow = threading.Thread(target=lambda: results.append(engine.generate(PROMPTS, PARAMS)))
    results: list = []
    slow.start()
    time.sleep(0.3)  # the slow generate has sent its request for miles-v3
    began = time.monotonic()
    engine.load_adapter(adapter, 4)
    assert time.monotonic() - began < 0.5  # no wait for the generate in flight
    assert fake.posted("/v1/unload_lora_adapter") == []  # miles-v3 is still in use
    slow.join()
    assert {c.policy_version for g in results[0] for c in g} == {3}
    assert fake.posted("/v1/unload_lora_adapter") == [{"lora_name": "miles-v3"}]
    fake.route("POST", "/v1/completions", recorded("completion_2x2.json"))
    groups = engine.generate(PROMPTS, PARAMS)
    assert fake.posted("/v1/completions")[-1]["model"] == "miles-v4"
    assert {c.policy_version for g in groups for c in g} == {4}
    engine.load_adapter(adapter, 5)  # nothing in flight: unloaded at once
    assert fake.posted("/v1/unload_lora_adapter")[-1] == {"lora_name": "miles-v4"}


def test_a_name_the_server_already_holds_is_unloaded_and_loaded_again(fake, tokenizer_dir,
                                                                      adapter):
    """A load whose reply was lost (a timeout) left the adapter on the server; the retry's 400
    "already loaded" unloads that name and loads the folder again, instead of dropping the
    version."""
    fake.route("POST", "/v1/load_lora_adapter", (400, recorded("error_adapter_taken.json")),
               "Success")
    fake.route("POST", "/v1/unload_lora_adapter", "Success")
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 3)
    assert (engine.policy_version, engine.served_model) == (3, "miles-v3")
    assert fake.posted("/v1/unload_lora_adapter") == [{"lora_name": "miles-v3"}]
    assert len(fake.posted("/v1/load_lora_adapter")) == 2


def test_concurrent_generates_after_a_restart_load_the_adapter_once_each_way(
        fake, tokenizer_dir, adapter):
    """Two generates both meet the 404 of a restarted server: one loads the adapter again, the
    other's load is refused as already loaded, and both retry and succeed."""
    fake.route("POST", "/v1/load_lora_adapter", "Success")
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 3)
    fake.route("POST", "/v1/completions", (404, recorded("error_model_not_found.json")),
               (404, recorded("error_model_not_found.json")), recorded("completion_2x2.json"),
               delay=0.3)  # both first requests are in flight together
    fake.route("POST", "/v1/load_lora_adapter", "Success",
               (400, recorded("error_adapter_taken.json")))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(engine.generate(PROMPTS, PARAMS)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2
    assert {c.policy_version for r in results for g in r for c in g} == {3}


def test_the_base_model_is_not_reloaded_on_404(fake, tokenizer_dir):
    fake.route("POST", "/v1/completions", (404, recorded("error_model_not_found.json")))
    engine = engine_for(fake, tokenizer_dir)
    with pytest.raises(EngineError, match="HTTP 404"):
        engine.generate(PROMPTS, PARAMS)
    assert fake.posted("/v1/load_lora_adapter") == []


def test_failed_unload_is_logged_not_raised(fake, tokenizer_dir, adapter, caplog):
    fake.route("POST", "/v1/load_lora_adapter", "Success")
    fake.route("POST", "/v1/unload_lora_adapter", (500, {"error": {"message": "boom"}}))
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 1)
    engine.load_adapter(adapter, 2)
    assert (engine.policy_version, engine.served_model) == (2, "miles-v2")
    assert "could not unload adapter miles-v1" in caplog.text and "boom" in caplog.text


@pytest.mark.parametrize("reply, message", [
    ((404, {"detail": "Not Found"}), "VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
    ((400, recorded("error_adapter_taken.json")), "has already been loaded"),
    ((500, {"error": {"message": "max_lora_rank 8 < adapter rank 16"}}), "max_lora_rank"),
])
def test_failed_load_keeps_the_version(fake, tokenizer_dir, adapter, reply, message):
    fake.route("POST", "/v1/load_lora_adapter", "Success", reply)
    engine = engine_for(fake, tokenizer_dir)
    engine.load_adapter(adapter, 3)
    with pytest.raises(EngineError, match=message):
        engine.load_adapter(adapter, 4)
    assert (engine.policy_version, engine.served_model) == (3, "miles-v3")


def test_loads_that_cannot_happen(fake, tokenizer_dir, adapter, tmp_path):
    with pytest.raises(EngineError, match="built without LoRA"):
        engine_for(fake, tokenizer_dir, lora=False).load_adapter(adapter, 1)
    engine = engine_for(fake, tokenizer_dir)
    with pytest.raises(EngineError, match="lacks adapter_config.json"):
        engine.load_adapter(tmp_path / "missing", 1)
    with pytest.raises(EngineError, match="cannot load full weights"):
        engine.load_version(adapter, 1, "full")
    assert engine.policy_version == 0 and fake.posted("/v1/load_lora_adapter") == []


def test_start_up_unloads_own_stale_adapters(fake, tokenizer_dir):
    fake.route("GET", "/v1/models", recorded("models_with_adapters.json"))
    fake.route("POST", "/v1/unload_lora_adapter", "Success")
    engine_for(fake, tokenizer_dir, model="")
    assert fake.posted("/v1/unload_lora_adapter") == [{"lora_name": "miles-v3"}]


def test_start_up_probes_the_logprobs_mode(fake, tokenizer_dir):
    fake.route("POST", "/v1/completions", recorded("probe_processed.json"))
    engine_for(fake, tokenizer_dir, check_logprobs_mode=True)
    [probe] = fake.posted("/v1/completions")
    assert probe == probe_request(probe["prompt"][0], model="tiny")
    fake.route("POST", "/v1/completions", recorded("probe_raw.json"))
    with pytest.raises(EngineError, match="--logprobs-mode processed_logprobs"):
        engine_for(fake, tokenizer_dir, check_logprobs_mode=True)


def test_start_up_fails_on_unknown_model_or_tokenizer(fake, tokenizer_dir, tmp_path):
    with pytest.raises(EngineError, match="expected 'llama'"):
        engine_for(fake, tokenizer_dir, model="llama")
    with pytest.raises(EngineError, match="cannot load a tokenizer"):
        engine_for(fake, tmp_path)
    fake.route("GET", "/v1/models", {"object": "list", "data": "nope"})
    with pytest.raises(EngineError, match="not a model list"):
        engine_for(fake, tokenizer_dir)


@pytest.mark.parametrize("reply, message", [
    ((400, recorded("error_context_length.json")), "HTTP 400: This model's maximum context"),
    ((404, recorded("error_model_not_found.json")), "HTTP 404: The model `miles-v9`"),
    ((500, "Internal Server Error"), "HTTP 500: Internal Server Error"),
    ((200, b"{not json"), "malformed JSON"),
    ((200, b"\xff\xfe"), "malformed JSON"),
    ((200, {"choices": [None, None, None, None]}), "not a choice"),
])
def test_http_errors_carry_the_server_message(fake, tokenizer_dir, reply, message):
    fake.route("POST", "/v1/completions", reply)
    engine = engine_for(fake, tokenizer_dir)
    with pytest.raises(EngineError) as info:
        engine.generate(PROMPTS, PARAMS)
    assert message in str(info.value)


def test_a_refused_request_is_the_requests_fault(fake, tokenizer_dir):
    """A 400 (vLLM's validation: prompt plus max_tokens past max_model_len) fails the same way
    again: EngineRejectedError, which callers never retry; a 500 stays a plain EngineError."""
    fake.route("POST", "/v1/completions", (400, recorded("error_context_length.json")),
               (500, "Internal Server Error"))
    engine = engine_for(fake, tokenizer_dir)
    with pytest.raises(EngineRejectedError, match="maximum context length is 64"):
        engine.generate(PROMPTS, PARAMS)
    with pytest.raises(EngineError) as info:
        engine.generate(PROMPTS, PARAMS)
    assert not isinstance(info.value, EngineRejectedError)


def test_the_context_limit_comes_from_the_model_card(fake, tokenizer_dir):
    assert engine_for(fake, tokenizer_dir).context_limit == 64  # models.json's max_model_len
    models = recorded("models.json")
    del models["data"][0]["max_model_len"]
    fake.route("GET", "/v1/models", models)
    assert engine_for(fake, tokenizer_dir).context_limit is None
    assert engine_for(fake, tokenizer_dir, max_model_len=256).context_limit == 256
    with pytest.raises(ConfigError, match="max_model_len must be >= 0"):
        VLLMServerSettings(max_model_len=-1)


def test_a_slow_server_times_out(fake, tokenizer_dir):
    engine = engine_for(fake, tokenizer_dir, timeout_s=0.5)
    fake.route("POST", "/v1/completions", recorded("completion_2x2.json"), delay=3.0)
    began = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="within 0.5 s|timed out"):
        engine.generate(PROMPTS, PARAMS)
    assert time.monotonic() - began < 2.0


def test_run_with_deadline_bounds_every_call():
    assert run_with_deadline([lambda: 1, lambda: 2], 1.0, what="x") == [1, 2]
    began = time.monotonic()
    with pytest.raises(EngineError, match="slow: no answer within 0.2 s"):
        run_with_deadline([lambda: 1, lambda: time.sleep(3)], 0.2, what="slow")
    assert time.monotonic() - began < 1.0

    def fail():
        raise EngineError("first")
    with pytest.raises(EngineError, match="first"):
        run_with_deadline([lambda: 1, fail], 1.0, what="x")


def test_an_unreachable_server_fails_fast(tokenizer_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EngineError, match="GET http://127.0.0.1"):
        VLLMServerEngine(f"http://127.0.0.1:{port}", "tiny", tokenizer_dir, timeout_s=5.0)


# -- engine selection in the producer -------------------------------------------------------------

def test_producer_builds_the_server_engine(fake, tokenizer_dir, monkeypatch):
    from producers.rollout import ProducerSettings, build_engine

    monkeypatch.setenv("MILES_TEST_VLLM_KEY", "k-123")
    fake.route("POST", "/v1/completions", recorded("probe_processed.json"))
    settings = ProducerSettings(model_dir=tokenizer_dir, engine="vllm-server",
                                vllm_server=VLLMServerSettings(base_url=fake.url,
                                                               api_key_env="MILES_TEST_VLLM_KEY"))
    engine = build_engine(settings)
    assert isinstance(engine, VLLMServerEngine) and engine.lora and engine.base_model == "tiny"
    assert len(fake.posted("/v1/completions")) == 1  # the logprobs-mode probe
    assert {headers["Authorization"] for *_, headers in fake.requests} == {"Bearer k-123"}


def test_producer_engine_choices(monkeypatch):
    from producers.rollout import ProducerSettings, build_engine

    with pytest.raises(ConfigError, match="engine must be one of hf, vllm-server, vllm"):
        ProducerSettings(engine="sglang")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else REAL_FIND_SPEC(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'miles\[vllm\]'"):
        build_engine(ProducerSettings(engine="vllm"))



def test_producer_config_reads_server_settings():
    from miles.config import load_config
    from producers.rollout import ProducerSettings

    settings = load_config(ProducerSettings, overrides=[
        "engine=vllm-server", "vllm_server.base_url=http://gpu-7:8000/v1",
        "vllm_server.timeout_s=30", "vllm_server.seeded=true"], env={})
    assert settings.vllm_server == VLLMServerSettings(base_url="http://gpu-7:8000/v1",
                                                      timeout_s=30.0, seeded=True)
    with pytest.raises(ConfigError, match="vllm_server.timeout_s"):
        load_config(ProducerSettings, overrides=["vllm_server.timeout_s=0"], env={})


def test_a_server_that_is_down_is_unavailable_not_a_refusal(fake, tokenizer_dir, adapter):
    """A refused connection says nothing about the request (the server is restarting): it is
    an EngineUnavailableError, which the weight follower retries; an HTTP error is the server's
    answer and stays a plain EngineError."""
    engine = engine_for(fake, tokenizer_dir)
    fake.route("POST", "/v1/load_lora_adapter", (500, "Internal Server Error"))
    with pytest.raises(EngineError) as answered:
        engine.load_adapter(adapter, 1)
    assert not isinstance(answered.value, EngineUnavailableError)
    for status in (502, 503):  # a proxy in front of a restarting server
        fake.route("POST", "/v1/load_lora_adapter", (status, "upstream unavailable"))
        with pytest.raises(EngineUnavailableError, match=f"HTTP {status}"):
            engine.load_adapter(adapter, 1)
    fake.close()
    with pytest.raises(EngineUnavailableError, match="load_lora_adapter"):
        engine.load_adapter(adapter, 1)
    with pytest.raises(EngineUnavailableError, match="completions"):
        engine.generate(PROMPTS, PARAMS)
    assert engine.policy_version == 0


# -- episodes on the server engine ----------------------------------------------------------------

async def test_a_refused_turn_fails_its_episode_not_the_batch(fake, tokenizer_dir):
    """The server refuses the round's call (400) and then, generated one by one, only the
    second episode's request: that episode fails ("engine_rejected"), the first goes on."""
    from miles.episodes import EpisodeRunner, EpisodeSettings
    from miles.protocol import PromptTask
    from tests import envs

    one = recorded("completion_2x2.json")
    one["choices"] = one["choices"][:1]
    refused = (400, recorded("error_context_length.json"))
    fake.route("POST", "/v1/completions", refused, one, refused)
    engine = engine_for(fake, tokenizer_dir)

    async def generate(prompts, params, **kwargs):
        return engine.generate(prompts, params, **kwargs)

    runner = EpisodeRunner(engine, envs.Counter, EpisodeSettings(),
                           SamplingParams(n=1, max_new_tokens=3), generate_in_engine=generate)
    tasks = [PromptTask(task_id=name, prompt="2+2=", metadata={"turns": 1}, created_at=0.0)
             for name in ("ok", "refused")]
    (ok,), (bad,) = await runner.run([(t, PROMPTS[0]) for t in tasks], seed=0)
    assert ok.failure is None and ok.turns[0].completion.token_ids.tolist() == [8, 6, 2]
    assert bad.failure_kind == "engine_rejected" and "maximum context length" in bad.failure
    assert [len(body["prompt"]) for body in fake.posted("/v1/completions")] == [2, 1, 1]


def test_more_stop_strings_than_the_server_takes_stop_the_producer_at_start_up(fake,
                                                                               tokenizer_dir):
    """vLLM's request schema takes at most 4 stop strings (HTTP 400 for more; Miles allows
    16): a producer whose environment has 5 fails when it is built, naming the environment
    and the engine, instead of having every turn refused; an engine of Miles' 16 takes them."""
    from miles.bus.embedded import EmbeddedBus
    from miles.envs import load_environment
    from miles.rollout import RolloutConfig, RolloutWorker
    from miles.tasks.rewards import resolve_reward
    from tests.scripted import ScriptedEngine

    scorer = resolve_reward("exact_match")
    server, local = engine_for(fake, tokenizer_dir), ScriptedEngine(tokenizer_dir, str)
    five, four = (load_environment(f"tests.envs:{name}", reward=scorer)
                  for name in ("FiveStops", "StopCounter"))
    for engine, env in ((server, four), (local, five)):
        RolloutWorker(EmbeddedBus(), engine, scorer, RolloutConfig(), env=env)
    with pytest.raises(ConfigError, match=r"env tests.envs.FiveStops: its 5 stop strings are "
                                          r"more than engine 'vllm-server' takes \(4"):
        RolloutWorker(EmbeddedBus(), server, scorer, RolloutConfig(), env=five)
