"""The wire of vLLM's OpenAI-compatible server: `/v1/completions` bodies and reply parsing.

Pure functions (dicts in, dicts or `Completion`s out), so every rule is unit-tested against
recorded replies without a server. `miles.engines.vllm_server` does the HTTP around them; the
in-process engine (`miles.engines.vllm_engine`) shares the sampling values, the checks of a
sampled response and the finish-reason rule (`sampling_values`, `build_completion`).

What a request pins down: every sampling value is sent (a value left out falls back to the
server's generation-config default, e.g. a model's top_k=20 or repetition_penalty=1.05, which
would change the distribution); `logprobs=0` asks for the sampled token's logprob only; ids come
back as ids (`return_token_ids`, and `token_id:N` strings for servers that predate it). A
temperature below 0.01 is refused: vLLM would silently raise it to 0.01.

What a reply must satisfy, or the call fails with EngineError: n choices per prompt in
prompt-major order, ids in [0, vocab_size), one finite logprob in (-9999, 0] per id (vLLM writes
-inf as -9999.0, and a sampled token of the processed distribution is never -inf), finish reason
"stop" or "length". A reply that hits max_tokens on EOS is "stop" (vLLM checks the length
first), as in the HF engine; a "stop" on another stop token of the server (`stop_reason` is that
token, e.g. an extra EOS from the model's generation_config) counts as EOS; a "stop" whose
`stop_reason` is one of the request's stop strings is "stop_string"; "abort", "error" and
anything else fail the call (the engine contract has no partial responses).

Stop strings (`generate(..., stop_strings=)`) go as the API's `stop` with
`include_stop_str_in_output=True`, so the string stays in the output; the token ids are vLLM's
sampled ids, which it never cuts (a token that completes a stop string is kept whole, as in the
HF engine). vLLM checks stop strings on the detokenized text, so only such requests need it.

vLLM source read for this module (vllm-project/vllm, path @ commit):
- vllm/entrypoints/openai/completion/protocol.py @ 002032ee2b18: `CompletionRequest` (prompt as
  `list[list[int]]`, n, the top_k/min_p/repetition_penalty extras, logprobs, seed,
  `return_tokens_as_token_ids`, `return_token_ids`; values not sent come from the server's
  generation-config defaults), `CompletionLogProbs`, choice `token_ids` and `stop_reason`.
- vllm/entrypoints/openai/completion/serving.py @ 030ea52effcb: choices are prompt-major with
  `index = len(choices)`; logprobs below -9999 (i.e. -inf) are written as -9999.0.
- vllm/entrypoints/generate/base/serving.py @ 015d1c9b46ae: the `token_id:N` placeholder; a
  "error" finish reason becomes an HTTP error.
- vllm/v1/sample/sampler.py @ 3e342658b2e9, vllm/v1/sample/ops/topk_topp_sampler.py
  @ 3babc05a035b: `--logprobs-mode processed_logprobs` is log_softmax after temperature, then
  top-k, then top-p, with the order and keep-ties rules of `process_logits`; the default
  `raw_logprobs` is taken before temperature, which is why the engine probes the mode.
- vllm/v1/core/sched/utils.py @ 6110ea2910f2 (length is checked before EOS; stop tokens set
  `stop_reason`), vllm/v1/engine/parallel_sampling.py @ 491d923514ad (the n samples of a prompt
  are in index order, child seed = seed + index), vllm/sampling_params.py @ db573835d3ef (top_k
  -1 disables in every version; newer ones also take 0) and @ 00388f6573cc (a temperature in
  (0, 0.01) is raised to 0.01).
- vllm/entrypoints/openai/models/serving.py @ 00153c8b7948: `/v1/models` cards, adapters carry
  `parent`; errors are `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from miles.engines.base import Completion
from miles.errors import EngineError
from miles.rl.sampling import SamplingParams

TOKEN_ID_PREFIX = "token_id:"  # vLLM's spelling of a token under return_tokens_as_token_ids
TOKEN_ID = re.compile(re.escape(TOKEN_ID_PREFIX) + r"(\d+)")
CLAMPED_NEG_INF = -9999.0  # vLLM writes a -inf logprob as this (JSON has no infinity)
LOGPROB_SLACK = 1e-4  # float32 log_softmax may exceed 0 by rounding; more is an error
ERROR_TEXT_CHARS = 500  # how much of a server's reply goes into an error message
VLLM_MIN_TEMPERATURE = 1e-2  # vLLM raises any lower temperature to this (a distribution change)
NEUTRAL_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}  # knobs process_logits does not have: all off


def adapter_name(prefix: str, policy_version: int) -> str:
    return f"{prefix}-v{policy_version}"


def sampling_values(params: SamplingParams, vocab_size: int) -> dict[str, Any]:
    """The sampling values every vLLM request carries, in the names vLLM's `SamplingParams` and
    the completions API share: `params` as `process_logits` applies them, every other knob
    neutral, and logprobs=0 (the sampled token's logprob only)."""
    if params.temperature < VLLM_MIN_TEMPERATURE:
        raise EngineError(f"temperature {params.temperature} is below {VLLM_MIN_TEMPERATURE}, "
                          "which vLLM silently raises to it; the logprobs would not match")
    return {"n": params.n, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if 0 < params.top_k < vocab_size else -1,
            **NEUTRAL_SAMPLING, "logprobs": 0}


def stop_values(stop_strings: tuple[str, ...]) -> dict[str, Any]:
    """The request fields that stop at `stop_strings` and keep them in the output ({} if none:
    such requests stay exactly as before)."""
    if not stop_strings:
        return {}
    return {"stop": list(stop_strings), "include_stop_str_in_output": True}


def completion_request(prompts: list[list[int]], params: SamplingParams, *, model: str,
                       vocab_size: int, seed: int | None = None,
                       stop_strings: tuple[str, ...] = ()) -> dict[str, Any]:
    """The `/v1/completions` body sampling `params` from `process_logits`' distribution.

    Every sampling value is sent, so none falls back to the server's generation-config defaults;
    logprobs=0 asks for the sampled token's logprob only; token ids come back as ids.
    """
    body: dict[str, Any] = {
        "model": model, "prompt": [list(map(int, p)) for p in prompts],
        **sampling_values(params, vocab_size), **stop_values(stop_strings),
        "return_tokens_as_token_ids": True, "return_token_ids": True, "stream": False}
    if seed is not None:
        body["seed"] = seed
    return body


def probe_request(prompt: list[int], *, model: str) -> dict[str, Any]:
    """One token under top_k=1, with the sampled token's and the two best tokens' logprobs."""
    return {"model": model, "prompt": [list(map(int, prompt))], "n": 1, "max_tokens": 1,
            "temperature": 1.0, "top_p": 1.0, "top_k": 1, **NEUTRAL_SAMPLING,
            "logprobs": 2, "return_tokens_as_token_ids": True, "stream": False}


def check_processed_logprobs(reply: Any) -> None:
    """Under top_k=1, processed logprobs give the sampled token 0 and every other token -inf."""
    try:
        logprobs = reply["choices"][0]["logprobs"]
        sampled = float(logprobs["token_logprobs"][0])
        others = sorted(float(v) for v in logprobs["top_logprobs"][0].values())[:-1]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise EngineError(f"logprobs-mode probe: unexpected reply shape ({err!r})") from err
    if abs(sampled) <= LOGPROB_SLACK and others and all(v <= CLAMPED_NEG_INF for v in others):
        return
    raise EngineError(
        "the vLLM server does not return processed logprobs: with top_k=1 the sampled token got "
        f"{sampled} (processed: 0) and the runners-up {others} (processed: -9999, i.e. -inf). "
        "Start it with --logprobs-mode processed_logprobs, so the behaviour logprobs match "
        "what the trainer scores")


def parse_model_cards(reply: Any) -> list[dict[str, Any]]:
    """The model cards of a `/v1/models` reply; each has a string `id`."""
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, list) or not all(
            isinstance(c, dict) and isinstance(c.get("id"), str) for c in data):
        raise EngineError(f"GET /v1/models: not a model list: {str(reply)[:ERROR_TEXT_CHARS]}")
    return data


def pick_base_model(cards: list[dict[str, Any]], model: str) -> str:
    """`model` if the server serves it as a base model; if empty, its only base model."""
    bases = [c["id"] for c in cards if not c.get("parent")]
    if model and model in bases:
        return model
    if not model and len(bases) == 1:
        return bases[0]
    want = repr(model) if model else "one base model (set model to choose)"
    raise EngineError(f"the vLLM server serves base models {bases}, expected {want}")


def parse_completions(reply: Any, *, n_prompts: int, n: int, vocab_size: int, eos_token_id: int,
                      policy_version: int,
                      stop_strings: tuple[str, ...] = ()) -> list[list[Completion]]:
    """`n` completions per prompt, in prompt order, from a `/v1/completions` reply."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list):
        raise EngineError(f"completion reply without choices: {str(reply)[:ERROR_TEXT_CHARS]}")
    if len(choices) != n_prompts * n:
        raise EngineError(f"expected {n_prompts} x {n} choices, the server returned {len(choices)}")
    out = [parse_choice(c, k, vocab_size=vocab_size, eos_token_id=eos_token_id,
                        policy_version=policy_version, stop_strings=stop_strings)
           for k, c in enumerate(choices)]
    return [out[i * n:(i + 1) * n] for i in range(n_prompts)]


def parse_choice(choice: Any, k: int, *, vocab_size: int, eos_token_id: int,
                 policy_version: int, stop_strings: tuple[str, ...] = ()) -> Completion:
    """One choice as a `Completion`; `k` is its position (vLLM's `index`)."""
    where = f"choice {k}"
    if not isinstance(choice, dict) or choice.get("index", k) != k:
        raise EngineError(f"{where}: not a choice at index {k}")
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("token_logprobs"), list):
        raise EngineError(f"{where}: no logprobs (the request asks for them; is this vLLM?)")
    return build_completion(
        _token_ids(choice, logprobs, where), logprobs["token_logprobs"],
        reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"), where=where,
        vocab_size=vocab_size, eos_token_id=eos_token_id, policy_version=policy_version,
        stop_strings=stop_strings)


def build_completion(ids: list, values: list, *, reason: Any, stop_reason: Any, where: str,
                     vocab_size: int, eos_token_id: int, policy_version: int,
                     stop_strings: tuple[str, ...] = ()) -> Completion:
    """A `Completion` from the sampled ids and their logprobs as vLLM reports them (over HTTP
    or in process), after checking every id and value; `where` names it in errors."""
    if not ids:
        raise EngineError(f"{where}: an empty response")
    if len(ids) != len(values):
        raise EngineError(f"{where}: {len(ids)} token ids but {len(values)} logprobs")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"{where}: token ids outside [0, {vocab_size}): {bad[:5]}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) \
                or not CLAMPED_NEG_INF < v <= LOGPROB_SLACK:
            raise EngineError(f"{where}: logprob {v!r} of a sampled token is not in "
                              f"({CLAMPED_NEG_INF}, 0]")
    return Completion(token_ids=np.asarray(ids, dtype=np.int32),
                      logprobs=np.minimum(np.asarray(values, dtype=np.float32), 0.0),
                      finish_reason=map_finish_reason(reason, stop_reason, ids, eos_token_id,
                                                      where, stop_strings),
                      policy_version=policy_version)


def _token_ids(choice: dict, logprobs: dict, where: str) -> list:
    """The sampled ids: `token_ids` (return_token_ids), else parsed from the `token_id:N`
    strings (servers before return_token_ids); both must agree when both are present."""
    ids, tokens = choice.get("token_ids"), logprobs.get("tokens")
    if ids is not None and not isinstance(ids, list):
        raise EngineError(f"{where}: token_ids is not a list")
    if tokens is None:
        if ids is None:
            raise EngineError(f"{where}: neither token_ids nor logprobs.tokens")
        return ids
    matches = [TOKEN_ID.fullmatch(t) if isinstance(t, str) else None
               for t in tokens] if isinstance(tokens, list) else [None]
    if not all(matches):
        raise EngineError(f"{where}: tokens are not '{TOKEN_ID_PREFIX}N' strings: "
                          f"{str(tokens)[:ERROR_TEXT_CHARS]}")
    parsed = [int(m.group(1)) for m in matches]
    if ids is not None and ids != parsed:
        raise EngineError(f"{where}: token_ids {ids[:5]} disagree with logprobs.tokens "
                          f"{parsed[:5]}")
    return parsed


def map_finish_reason(reason: Any, stop_reason: Any, ids: list[int], eos_token_id: int,
                      where: str, stop_strings: tuple[str, ...] = ()) -> str:
    """The contract's finish reason of vLLM's `finish_reason` and `stop_reason`: "length"
    ending on EOS is "stop" (vLLM checks the length first); "stop" must end on EOS, on the
    stop token that `stop_reason` names, or on one of the request's `stop_strings`
    ("stop_string")."""
    if reason == "length":
        return "stop" if ids[-1] == eos_token_id else "length"
    if reason == "stop" and (ids[-1] == eos_token_id or stop_reason == ids[-1]):
        return "stop"
    if reason == "stop" and isinstance(stop_reason, str) and stop_reason in stop_strings:
        return "stop_string"
    if reason == "stop":
        raise EngineError(f"{where}: stopped on {stop_reason!r}, not on EOS or a stop token")
    raise EngineError(f"{where}: vLLM finished it with {reason!r} (aborted or failed)")


def error_message(raw: bytes) -> str:
    """The message of an error body: vLLM's `{"error": {"message"}}`, older `{"message"}`,
    FastAPI's `{"detail"}`, else the text itself."""
    text = raw[:ERROR_TEXT_CHARS * 4].decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text[:ERROR_TEXT_CHARS] or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])
    return text[:ERROR_TEXT_CHARS]
