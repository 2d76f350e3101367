"""The external-server engine: a running `vllm serve` driven over its OpenAI-compatible HTTP API.

Token ids go in (`/v1/completions` with a list of token-id prompts), token ids and the sampled
tokens' logprobs come out (bodies and parsing: `miles.engines.vllm_api`), and each new weight
version is a LoRA adapter hot-loaded with `/v1/load_lora_adapter`. The producer needs neither vLLM
nor a GPU, only the tokenizer (and the model's config.json for the vocabulary size) locally.

What the server must be started with:
- `--logprobs-mode processed_logprobs`. vLLM returns raw logprobs by default (before temperature,
  top-k and top-p), while the trainer scores the processed distribution of `process_logits`. The
  API does not expose the mode, so start-up sends one probe under top_k=1: processed logprobs give
  the sampled token exactly 0 and every other token -inf; any other mode fails the probe and the
  engine refuses to start (`check_logprobs_mode=False` skips it, e.g. for a mock server).
- `--enable-lora --max-lora-rank R` (R >= the adapters' r), and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in its environment, or the load/unload routes do not
  exist. The server reads each adapter folder itself, so it must see the producer's weight
  folders at the same path.
- Recommended: `--generation-config vllm`, so the model's generation_config sets no sampling
  defaults. Its extra EOS ids still stop a response (vLLM reads them either way); such a
  response ends on that stop token and is reported as "stop".

Simplifications, chosen on purpose:
- Blocking `urllib` calls (no new dependency); each exchange runs in a daemon thread joined with
  `timeout_s`, so nothing outlives its bound (DNS included).
- All prompts of a `generate` go in one request (vLLM fans them out itself) and no seed is sent:
  vLLM gives one request's seed to each of its prompts, so samples of different prompts would share
  their noise, and seeded rows slow its sampler. `seeded=True` sends one request per prompt, in
  parallel, with seed `seed + i * n`, so every sample has its own seed.
- Each `generate` takes the adapter being served when it starts (under a short lock) and names
  it in its requests, so `policy_version` is exact per response; generates may run
  concurrently (a streaming producer sends one per group), and an adapter switch does not wait
  for them: requests already sent finish on their adapter, later ones use the new one. The
  previous adapter is unloaded once no generate uses it any more (best effort, logged); a
  resumed trainer's version with the number being served loads as `<prefix>-v<N>-reload`. A
  name the server already holds (a load whose reply timed out, an unload that failed) is
  unloaded and loaded again, so a name always serves the folder of its version. Adapters named
  `<prefix>-v<N>` left by an earlier run are unloaded at start-up, so producers sharing one
  server need distinct `adapter_prefix`es.
- A server that answers a generate with 404 no longer knows the adapter that generate named (it
  was restarted); the engine loads the same folder under the same name again (a concurrent
  generate that already did so is a 400 "already loaded", taken as done) and retries once, so a
  restarted server costs one failed batch, not a stuck producer.
- Full weights cannot be swapped through this API: `load_full_weights` raises.

vLLM source read for the server side (vllm-project/vllm, path @ commit):
vllm/entrypoints/serve/lora/api_router.py @ 27873cab97e4 and serve/lora/protocol.py
@ 7fd1b43852e1 (`/v1/load_lora_adapter` takes `lora_name` and `lora_path`, answers plain text;
both routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING), vllm/entrypoints/openai/models/
serving.py @ 00153c8b7948 (a taken name is a 400, an unknown one a 404 on unload).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any, Callable

from miles.engines.base import Completion, TokenizedEngine, checked_stop_strings
from miles.engines.vllm_api import (ERROR_TEXT_CHARS, adapter_name, check_processed_logprobs,
                                    completion_request, error_message, parse_completions,
                                    parse_model_cards, pick_base_model, probe_request)
from miles.errors import ConfigError, EngineError, EngineRejectedError, EngineUnavailableError
from miles.rl.sampling import SamplingParams

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
RELOAD_SUFFIX = "-reload"  # a new lineage's adapter with the number being served: another name
LORA_HINT = ("the server needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora, and must "
             "read the adapter folder at the same path as the producer")


@dataclass(frozen=True, kw_only=True)
class VLLMServerSettings:
    """Where the `vllm serve` process is and how to talk to it (engine "vllm-server")."""

    base_url: str = "http://127.0.0.1:8000"  # server address, with or without the /v1 suffix
    model: str = ""  # served base model name ("": the one base model the server lists)
    timeout_s: float = 600.0  # bound on every HTTP call, a whole generate batch included
    api_key_env: str = "VLLM_API_KEY"  # environment variable holding the server's --api-key
    adapter_prefix: str = "miles"  # adapters are named <prefix>-v<version>; unique per producer
    seeded: bool = False  # send seeds: one request per prompt (reproducible, slower sampling)
    check_logprobs_mode: bool = True  # probe at start-up that logprobs are processed_logprobs
    max_model_len: int = 0  # the server's context, when its /v1/models does not say (0: unknown)

    def __post_init__(self) -> None:
        if not re.match(r"^https?://[^/]+", self.base_url):
            raise ConfigError(f"base_url must be http(s)://HOST[:PORT], got {self.base_url!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.adapter_prefix):
            raise ConfigError(f"adapter_prefix must be letters, digits, '_', '.' or '-', "
                              f"got {self.adapter_prefix!r}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")


class HTTPStatusError(EngineError):
    """The server answered with a non-2xx status; the message carries the server's own."""

    def __init__(self, what: str, status: int, message: str):
        super().__init__(f"{what}: HTTP {status}: {message}")
        self.status = status


class UnavailableStatusError(HTTPStatusError, EngineUnavailableError):
    """502, 503 or 504: the server (or a proxy in front of it) cannot serve now, e.g. while it
    restarts; like a refused connection, the same call may succeed later."""


class RejectedStatusError(HTTPStatusError, EngineRejectedError):
    """400 or 422: the server refused the request for what it asked (vLLM's validation: a
    prompt plus max_tokens past max_model_len, a bad value); sending it again fails again."""


UNAVAILABLE_STATUSES = (502, 503, 504)
REJECTED_STATUSES = (400, 422)
SERVER_MAX_STOP_STRINGS = 4  # vLLM's request schema refuses more stop strings (HTTP 400)


class VLLMServerEngine(TokenizedEngine):
    """A `vllm serve` process behind the engine contract; see the module docstring."""

    name = "vllm-server"
    max_stop_strings = SERVER_MAX_STOP_STRINGS

    def __init__(self, base_url: str, model: str, tokenizer_dir: str | Path, *,
                 timeout_s: float = 600.0, lora: bool = True, api_key: str = "",
                 adapter_prefix: str = "miles", seeded: bool = False,
                 check_logprobs_mode: bool = True, max_model_len: int = 0):
        VLLMServerSettings(base_url=base_url, model=model, timeout_s=timeout_s,  # validates
                           adapter_prefix=adapter_prefix)
        self.base_url = server_root(base_url)
        self.timeout_s = timeout_s
        self.lora = lora
        self.adapter_prefix = adapter_prefix
        self.seeded = seeded
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.tokenizer, self._vocab_size = load_tokenizer(tokenizer_dir)
        if self.tokenizer.eos_token_id is None:
            raise EngineError(f"the tokenizer in {tokenizer_dir} has no eos token")
        self._eos_token_id = int(self.tokenizer.eos_token_id)
        self._lock = threading.Lock()  # guards what is served and which adapters are in use
        self._users: dict[str, int] = {}  # adapter name -> generates using it now
        self._retired: set[str] = set()  # adapters switched away from while in use
        self._policy_version = 0
        cards = parse_model_cards(self._call("GET", "/v1/models"))
        self.base_model = pick_base_model(cards, model)
        self._context_limit = served_context(cards, self.base_model) or max_model_len or None
        self._served = self.base_model  # the model name requests use: base or current adapter
        self._served_dir: Path | None = None  # the current adapter's folder (None: base model)
        if lora:
            stale = re.compile(rf"{re.escape(adapter_prefix)}-v\d+({RELOAD_SUFFIX})?")
            for card in cards:
                if stale.fullmatch(card["id"]):
                    self._unload(card["id"])
        if check_logprobs_mode:
            self.check_logprobs_mode()

    @classmethod
    def from_settings(cls, settings: VLLMServerSettings, tokenizer_dir: str | Path, *,
                      lora: bool) -> VLLMServerEngine:
        """The engine `settings` describe; the API key is read from the environment, so it
        never sits in a config file or the logged config."""
        return cls(settings.base_url, settings.model, tokenizer_dir, timeout_s=settings.timeout_s,
                   lora=lora, api_key=os.environ.get(settings.api_key_env, ""),
                   adapter_prefix=settings.adapter_prefix, seeded=settings.seeded,
                   check_logprobs_mode=settings.check_logprobs_mode,
                   max_model_len=settings.max_model_len)

    @property
    def context_limit(self) -> int | None:
        """The base model card's `max_model_len` (vLLM lists it), else the setting."""
        return self._context_limit

    @property
    def served_model(self) -> str:
        """The model name requests use now: the base model or the current adapter."""
        return self._served

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seed: int | None = None,
                 stop_strings: tuple[str, ...] = ()) -> list[list[Completion]]:
        self._check_prompts(prompts)
        stops = checked_stop_strings(stop_strings)
        if not prompts:
            return []
        with self._lock:
            model, version, folder = self._served, self._policy_version, self._served_dir
            self._users[model] = self._users.get(model, 0) + 1
        try:
            if self.seeded and seed is not None:
                bodies = [completion_request([p], params, model=model, vocab_size=self._vocab_size,
                                             seed=seed + i * params.n, stop_strings=stops)
                          for i, p in enumerate(prompts)]
            else:
                bodies = [completion_request(prompts, params, model=model,
                                             vocab_size=self._vocab_size, stop_strings=stops)]
            calls = [("POST", "/v1/completions", b) for b in bodies]
            try:
                replies = self._exchange(calls)
            except HTTPStatusError as err:
                if err.status != 404 or folder is None:
                    raise
                self._load_again(model, folder, err)
                replies = self._exchange(calls)
        finally:
            self._release(model)
        groups: list[list[Completion]] = []
        for body, reply in zip(bodies, replies):
            groups += parse_completions(reply, n_prompts=len(body["prompt"]), n=params.n,
                                        vocab_size=self._vocab_size,
                                        eos_token_id=self._eos_token_id, policy_version=version,
                                        stop_strings=stops)
        return groups

    def load_adapter(self, adapter_dir: Path, policy_version: int, *,
                     new_lineage: bool = False) -> None:
        if not self.lora:
            raise EngineError("this engine was built without LoRA; it cannot load an adapter")
        adapter_dir = Path(adapter_dir).resolve()
        missing = [f for f in ADAPTER_FILES if not (adapter_dir / f).is_file()]
        if missing:
            raise EngineError(f"adapter folder {adapter_dir} lacks {', '.join(missing)}")
        name = adapter_name(self.adapter_prefix, policy_version)
        with self._lock:
            if name == self._served:  # a new lineage's version of the number being served
                name += RELOAD_SUFFIX
            try:
                self._load_named(name, adapter_dir)
            except UnavailableStatusError:
                raise  # kept and retried by the weight follower
            except HTTPStatusError as err:
                hint = f" ({LORA_HINT})" if err.status == 404 else ""
                raise EngineError(f"cannot load adapter {name}: {err}{hint}") from err
            previous, self._served, self._policy_version = self._served, name, policy_version
            self._served_dir = adapter_dir
            self._retired.discard(name)  # served again: its old users must not unload it
            in_use = self._users.get(previous, 0) > 0
            if in_use and previous != self.base_model:
                self._retired.add(previous)  # its last generate unloads it
        if not in_use and previous != self.base_model:
            self._unload(previous)

    def _load_named(self, name: str, adapter_dir: Path) -> None:
        """Load `adapter_dir` as `name`. A name the server already holds is this engine's own
        earlier load whose reply was lost (a timeout), or one whose unload failed: unloaded and
        loaded again once, so the name always serves this folder."""
        body = {"lora_name": name, "lora_path": str(adapter_dir)}
        try:
            self._call("POST", "/v1/load_lora_adapter", body, reply_json=False)
        except HTTPStatusError as err:
            if not taken(err):
                raise
            log.warning("the server already holds adapter %s; unloading it and loading %s",
                        name, adapter_dir)
            self._unload(name)
            self._call("POST", "/v1/load_lora_adapter", body, reply_json=False)

    def _release(self, model: str) -> None:
        """A generate using `model` ended; unload it if it was retired and this was its last."""
        with self._lock:
            self._users[model] -= 1
            last = self._users[model] == 0
            if last:
                del self._users[model]
            retired = last and model in self._retired
            if retired:
                self._retired.discard(model)
        if retired:
            self._unload(model)

    def load_full_weights(self, weights: Path, policy_version: int) -> None:
        raise EngineError(
            "engine 'vllm-server' cannot load full weights: a running vLLM server only takes new "
            "LoRA adapters over its API. Train with LoRA (producer lora settings), restart the "
            "server on the new checkpoint, or use engine 'hf'")

    def _load_again(self, model: str, folder: Path, err: HTTPStatusError) -> None:
        """The server does not know adapter `model` (a 404 on generate): it was restarted, or
        someone unloaded it. Load the same folder under the same name again, so the version of
        every response stays exact; the caller retries once. A 400 for a name already loaded
        means a concurrent generate got there first."""
        log.warning("the server does not serve adapter %s (%s); loading it again from %s",
                    model, err, folder)
        try:
            self._call("POST", "/v1/load_lora_adapter",
                       {"lora_name": model, "lora_path": str(folder)}, reply_json=False)
        except HTTPStatusError as again:
            if taken(again):
                return
            raise EngineError(f"cannot load adapter {model} again: {again}") from again

    def check_logprobs_mode(self) -> None:
        """Fail unless the server returns processed logprobs (see the module docstring)."""
        prompt = self.encode("The") or [self._eos_token_id]
        reply = self._exchange([("POST", "/v1/completions",
                                 probe_request(prompt, model=self.base_model))])[0]
        check_processed_logprobs(reply)

    # -- HTTP -----------------------------------------------------------------------------------

    def _unload(self, name: str) -> None:
        """Unload adapter `name` from the server; a failure is logged, not raised."""
        try:
            self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, reply_json=False)
        except EngineError as err:
            log.warning("could not unload adapter %s (it stays loaded on the server): %s",
                        name, err)

    def _call(self, method: str, path: str, body: dict | None = None, *,
              reply_json: bool = True) -> Any:
        return self._exchange([(method, path, body)], reply_json=reply_json)[0]

    def _exchange(self, calls: list[tuple[str, str, dict | None]], *,
                  reply_json: bool = True) -> list[Any]:
        """Run the calls in parallel; their replies (parsed JSON, or text), in call order."""
        def call(method: str, path: str, body: dict | None) -> Any:
            status, raw = http_exchange(self.base_url + path, method, body, self._headers,
                                        self.timeout_s)
            return decode_reply(f"{method} {path}", status, raw, reply_json=reply_json)

        method, path, _ = calls[0]
        return run_with_deadline([functools.partial(call, *c) for c in calls], self.timeout_s,
                                 what=f"{method} {self.base_url}{path}")


def served_context(cards: list[dict[str, Any]], model: str) -> int:
    """The `max_model_len` the card of `model` gives (0: none given)."""
    value = next((c.get("max_model_len") for c in cards if c["id"] == model), None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def taken(err: HTTPStatusError) -> bool:
    """Whether the server refused a load because it already holds an adapter of that name."""
    return err.status == 400 and "already been loaded" in str(err)


def server_root(base_url: str) -> str:
    """`http://host:port` from a base URL given with or without a trailing `/v1`."""
    root = base_url.rstrip("/")
    return root[:-len("/v1")] if root.endswith("/v1") else root


def decode_reply(what: str, status: int, raw: bytes, *, reply_json: bool = True) -> Any:
    """The JSON (or text) of a 2xx reply; any other status raises with the server's message."""
    if not 200 <= status < 300:
        error = (UnavailableStatusError if status in UNAVAILABLE_STATUSES else
                 RejectedStatusError if status in REJECTED_STATUSES else HTTPStatusError)
        raise error(what, status, error_message(raw))
    if not reply_json:
        return raw.decode("utf-8", errors="replace")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise EngineError(f"{what}: malformed JSON ({err}): "
                          f"{raw[:ERROR_TEXT_CHARS].decode('utf-8', 'replace')!r}") from err


def http_exchange(url: str, method: str, body: dict | None, headers: dict[str, str],
                  timeout_s: float) -> tuple[int, bytes]:
    """One HTTP exchange: (status, body). Transport failures (refused, reset: a server down or
    restarting) raise EngineUnavailableError."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()
    except (urllib.error.URLError, OSError, HTTPException) as err:
        reason = getattr(err, "reason", err)
        raise EngineUnavailableError(f"{method} {url}: {reason!r}") from err


def run_with_deadline(calls: list[Callable[[], Any]], timeout_s: float, *, what: str) -> list[Any]:
    """Run each call in its own daemon thread; results in order, or the first error. Raises
    EngineUnavailableError if any is still running after `timeout_s` (its thread is left to end
    at its socket timeout)."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as err:  # re-raised in the caller's thread below
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name="vllm-http")
               for i in range(len(calls))]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    if any(thread.is_alive() for thread in threads):
        raise EngineUnavailableError(f"{what}: no answer within {timeout_s} s")
    for err in errors:
        if err is not None:
            raise err
    return results


def load_tokenizer(tokenizer_dir: str | Path):
    """The tokenizer in `tokenizer_dir` and the model's vocabulary size (its config.json's
    `vocab_size`, the logits width, else the tokenizer's length)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as err:
        raise EngineError(f"cannot load a tokenizer from {tokenizer_dir}: {err}") from err
    vocab_size = len(tokenizer)
    config = Path(tokenizer_dir) / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as err:
            raise EngineError(f"cannot read {config}: {err}") from err
        size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
        if isinstance(size, int) and size > 0:
            vocab_size = size
    return tokenizer, vocab_size
