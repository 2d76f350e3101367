"""The in-process Hugging Face engine: a transformers causal LM sampled by a hand-written loop.

`model.generate` is not used: its logits processors are not `process_logits`, and the
behaviour logprobs must come from exactly the distribution the trainer scores with. The loop is
gpt-fast style: one prefill over the left-padded prompts (each prompt once; its KV cache is then
repeated for its n samples), then one token per step through the cache. Positions are
`cumsum(attention_mask) - 1`, so each row's real tokens sit at 0, 1, 2, ... exactly as in the
trainer's right-padded forward.

Simplifications, chosen on purpose:
- All prompts x n run as one batch, and finished rows keep stepping (their tokens are dropped)
  until every row is done: no paged cache, and no continuous batching here (`streaming_sampler()`,
  in `hf_stream.py`, is the continuous batcher). This engine is for CPU runs, tests and small
  GPUs; throughput at scale is vLLM's job.
- One EOS id (the tokenizer's) ends a response; extra stop ids of some chat models are ignored.
- Stop strings are checked per row after each step by decoding only the row's last few tokens
  (`StopStrings`: as many as the longest stop string has characters, plus slack for tokens
  that decode to nothing), so the check costs one short decode per unfinished row and step and
  nothing for requests without stop strings.
- LoRA adapters are hot-loaded into the one adapter built at start-up: once its config, keys and
  shapes match, each tensor is copied in place into its live parameter, so a new version costs a
  tensor copy (peft's `set_peft_model_state_dict` walks the whole model on every call: 22 ms
  against 1 ms per load on the demo's model); an adapter of another shape is rejected, not rebuilt.
- The adapter is merged into the base weights it adapts (`MergedLora`), so a forward makes one
  matmul per adapted layer instead of three (the demo's generation: 56 -> 46 ms a batch). Each
  load merges into a kept copy of the original weights, never into the previous merge, so no
  rounding error builds up over versions; the copy costs the adapted layers' weights once more
  in memory.
- Full weights load only into an engine without LoRA.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.engines.base import Completion, LoraSettings, TokenizedEngine, checked_stop_strings
from miles.errors import EngineError
from miles.rl.sampling import SamplingParams, process_logits

if TYPE_CHECKING:
    from miles.engines.hf_stream import StreamingSampler

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
STOP_TAIL_SLACK = 4  # extra tail tokens decoded for a stop check (tokens that decode to "")


class HFEngine(TokenizedEngine):
    """A transformers model (optionally with one LoRA adapter) behind the engine contract."""

    name = "hf"

    def __init__(self, model_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, lora: LoraSettings | None = None):
        self.device = torch.device(device)
        self.lora = lora
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        except (OSError, ValueError) as e:
            raise EngineError(f"cannot load a causal LM and tokenizer from {model_dir}: {e}") from e
        self._context_limit = context_limit_of(model.config)
        if lora is not None:
            model = get_peft_model(model, lora_config(lora))
        self.model = model.to(self.device).eval()
        self._adapter = adapter_parameters(self.model) if lora is not None else {}
        self._merged = MergedLora(self.model) if lora is not None else None
        self._eos_token_id = _required_token_id(self.tokenizer, "eos")
        self._pad_token_id = self.tokenizer.pad_token_id
        if self._pad_token_id is None:
            self._pad_token_id = self._eos_token_id  # pad slots are masked; any id will do
        self._vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self._policy_version = 0
        self._lock = threading.Lock()  # generate and weight loads never overlap
        self.weight_loads = 0  # loads since start-up: a streaming cache is stale after one
        self._streaming: StreamingSampler | None = None
        self.tokens_generated = 0  # response tokens returned since start-up
        self.generate_seconds = 0.0  # wall time spent inside generate

    @property
    def context_limit(self) -> int | None:
        return self._context_limit

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.generate_seconds if self.generate_seconds else 0.0

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seed: int | None = None,
                 stop_strings: tuple[str, ...] = ()) -> list[list[Completion]]:
        self._check_prompts(prompts)
        stops = StopStrings(self.tokenizer, checked_stop_strings(stop_strings))
        if not prompts:
            return []
        with self._lock:
            start = time.perf_counter()
            generator = torch.Generator(device=self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
            with torch.inference_mode():
                tokens, logprobs, lengths, string_stops = sample_rows(
                    self.model, [list(p) for p in prompts], params, pad_token_id=self._pad_token_id,
                    eos_token_id=self._eos_token_id, generator=generator, stops=stops)
            completions = self._completions(tokens, logprobs, lengths, string_stops)
            self.tokens_generated += int(lengths.sum())
            self.generate_seconds += time.perf_counter() - start
        return [completions[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def streaming_sampler(self) -> StreamingSampler:
        """This engine's continuous batcher (`miles.engines.hf_stream`), built on first use; it
        shares the model, tokenizer and lock, so weight loads land between its steps."""
        if self._streaming is None:
            from miles.engines.hf_stream import StreamingSampler

            self._streaming = StreamingSampler(self)
        return self._streaming

    def load_adapter(self, adapter_dir: Path, policy_version: int, *,
                     new_lineage: bool = False) -> None:
        if self.lora is None:
            raise EngineError("this engine was built without LoRA; it cannot load an adapter")
        adapter_dir = Path(adapter_dir)
        _check_adapter_config(adapter_dir / ADAPTER_CONFIG, self.lora)
        state = _read_safetensors([adapter_dir / ADAPTER_WEIGHTS], self.device)
        with self._lock:
            _check_same_tensors(state, self._adapter, what="adapter")
            with torch.no_grad(), self._merged.reloading():
                for key, param in self._adapter.items():
                    param.copy_(state[key])
            self._policy_version = policy_version
            self.weight_loads += 1

    def load_full_weights(self, weights: Path, policy_version: int) -> None:
        if self.lora is not None:
            raise EngineError("this engine serves a LoRA adapter; load_adapter, not full weights")
        weights = Path(weights)
        files = sorted(weights.glob("*.safetensors")) if weights.is_dir() else [weights]
        if not files:
            raise EngineError(f"no .safetensors files in {weights}")
        state = _read_safetensors(files, self.device)
        with self._lock:
            _check_full_state(state, self.model)
            with torch.no_grad():
                self.model.load_state_dict(state, strict=False)
            self._policy_version = policy_version
            self.weight_loads += 1

    def _completions(self, tokens: torch.Tensor, logprobs: torch.Tensor, lengths: np.ndarray,
                     string_stops: np.ndarray) -> list[Completion]:
        tokens_np = tokens.cpu().numpy().astype(np.int32)  # [B, S]
        logprobs_np = logprobs.cpu().numpy().astype(np.float32)  # [B, S]
        out = []
        for row, length in enumerate(lengths.tolist()):
            ids = tokens_np[row, :length]
            reason = "length"
            if length > 0 and ids[-1] == self._eos_token_id:
                reason = "stop"
            elif string_stops[row]:
                reason = "stop_string"
            out.append(Completion(token_ids=ids.copy(), logprobs=logprobs_np[row, :length].copy(),
                                  finish_reason=reason, policy_version=self._policy_version))
        return out


def context_limit_of(config) -> int | None:
    """The model's `max_position_embeddings` (None if its config has none): the positions it
    was trained on; the HF engine does not refuse a longer sequence (RoPE extrapolates), but
    what it samples there is no longer the model's."""
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def lora_config(lora: LoraSettings) -> LoraConfig:
    """The peft config of `lora`; adapters trained for this engine should be built with it."""
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type="CAUSAL_LM")


class MergedLora:
    """The LoRA layers of `model` with their adapter merged into the base weights (peft's
    `merge`): a forward skips the adapter's two matmuls. `reloading()` wraps a change of the
    adapter's tensors: out of it, each base weight is its original (kept here) plus the new
    adapter's update, so merges never compound."""

    def __init__(self, model: PeftModel):
        self.layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        with torch.no_grad():
            self.originals = [layer.get_base_layer().weight.detach().clone()
                              for layer in self.layers]
            self._merge()

    @contextmanager
    def reloading(self) -> Iterator[None]:
        with torch.no_grad():
            for layer, original in zip(self.layers, self.originals):
                # restored exactly; peft's `unmerge` would first compute the delta only for
                # this copy to overwrite it
                layer.get_base_layer().weight.copy_(original)
                layer.merged_adapters.clear()  # peft's bookkeeping of what is merged
            yield
            self._merge()

    def _merge(self) -> None:
        for layer in self.layers:
            layer.merge()


def adapter_parameters(model: PeftModel) -> dict[str, torch.nn.Parameter]:
    """The live LoRA parameters of `model` under the names peft's adapter files use, so a
    version is copied straight into them. Fails if peft's names stop mapping to parameters."""
    by_storage = {param.data_ptr(): param for param in model.parameters()}
    out = {}
    for key, tensor in get_peft_model_state_dict(model).items():
        param = by_storage.get(tensor.data_ptr())
        if param is None or param.shape != tensor.shape:
            raise EngineError(f"adapter key {key} names no parameter of the model")
        out[key] = param
    return out


def left_pad(rows: list[list[int]], pad_token_id: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of `rows`, padded on the left to the longest row."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, P]
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def prefill(model: torch.nn.Module, prompts: list[list[int]], n: int, *, pad_token_id: int,
            cache_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """Run each prompt once and repeat its state n times (B = len(prompts) * n).

    Returns the next-token logits [B, V], attention mask [B, L], last positions [B, 1], KV cache.
    """
    input_ids, mask = left_pad(prompts, pad_token_id, next(model.parameters()).device)  # [P, L]
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # [P, L]: real tokens at 0, 1, 2, ...
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = getattr(out, cache_name)
    cache.batch_repeat_interleave(n)
    logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # [B, V]
    return (logits, mask.repeat_interleave(n, dim=0),
            positions[:, -1:].repeat_interleave(n, dim=0), cache)


class StopStrings:
    """Which rows' responses reached a stop string, found by decoding only each row's tail."""

    def __init__(self, tokenizer, strings: tuple[str, ...]):
        self.tokenizer, self.strings = tokenizer, strings
        self.window = max(map(len, strings), default=0) + STOP_TAIL_SLACK  # tail tokens decoded

    def __bool__(self) -> bool:
        return bool(self.strings)

    def hits(self, tokens: torch.Tensor, step: int, rows: torch.Tensor) -> list[int]:
        """The rows among `rows` ([B] bool) whose response `tokens[row, :step + 1]` ([B, S])
        contains a stop string; only the last `window` tokens are decoded, which suffices since
        a row is checked after every token (a stop string first appears at its newest one)."""
        candidates = rows.nonzero().flatten().tolist()
        if not candidates:
            return []
        tails = tokens[candidates, max(0, step + 1 - self.window):step + 1].tolist()
        return [row for row, tail in zip(candidates, tails)
                if any(s in self.tokenizer.decode(tail, skip_special_tokens=True)
                       for s in self.strings)]


def sample_rows(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, *,
                pad_token_id: int, eos_token_id: int, generator: torch.Generator,
                stops: StopStrings | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Sample `params.n` responses per prompt; returns tokens [B, S], logprobs [B, S], lengths
    [B] and whether a stop string ended each row [B].

    Rows are prompt-major (B = len(prompts) * n). A row's response is `tokens[row, :length]`; it
    ends with EOS iff EOS was sampled, and after the token that completed a stop string of
    `stops` otherwise. Each prompt is prefilled once and its KV cache repeated n times, which
    computes exactly what n identical rows would.
    """
    device, cache_name = next(model.parameters()).device, cache_argument(model)
    logits, mask, positions, cache = prefill(model, prompts, params.n, pad_token_id=pad_token_id,
                                             cache_name=cache_name)
    batch, steps = logits.shape[0], params.max_new_tokens
    tokens = torch.full((batch, steps), pad_token_id, dtype=torch.long, device=device)  # [B, S]
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)  # [B, S]
    lengths = torch.full((batch,), steps, dtype=torch.long, device=device)  # [B]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]
    string_stops = np.zeros(batch, dtype=bool)  # [B]
    for step in range(steps):
        next_tokens, next_logprobs = sample_next(logits, params, generator)  # [B], [B]
        tokens[:, step], logprobs[:, step] = next_tokens, next_logprobs
        ended = ~finished & (next_tokens == eos_token_id)  # [B]
        lengths[ended] = step + 1
        finished |= ended
        if stops:
            for row in stops.hits(tokens, step, ~finished):
                lengths[row], finished[row], string_stops[row] = step + 1, True, True
        if step == steps - 1 or bool(finished.all()):
            break
        mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)  # [B, L + step + 1]
        positions = positions + 1  # [B, 1]
        out = model(input_ids=next_tokens[:, None], attention_mask=mask, position_ids=positions,
                    use_cache=True, logits_to_keep=1, **{cache_name: cache})
        logits = out.logits[:, -1]  # [B, V]
    return tokens, logprobs, lengths.cpu().numpy(), string_stops


def cache_argument(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument and output field: `cache` in recent transformers, else
    `past_key_values` (deprecated there)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from the processed distribution of `logits` ([B, V])."""
    processed = process_logits(logits, temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p)  # [B, V]
    tokens = torch.multinomial(processed.softmax(dim=-1), 1, generator=generator)  # [B, 1]
    logprobs = processed.log_softmax(dim=-1).gather(-1, tokens)  # [B, 1]
    return tokens.squeeze(-1), logprobs.squeeze(-1)


def _required_token_id(tokenizer, which: str) -> int:
    token_id = getattr(tokenizer, f"{which}_token_id")
    if token_id is None:
        raise EngineError(f"the tokenizer has no {which} token")
    return int(token_id)


def _check_adapter_config(path: Path, lora: LoraSettings) -> None:
    """Reject an adapter whose rank, alpha or target modules differ from the engine's."""
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EngineError(f"cannot read adapter config {path}: {e}") from e
    got = {"r": config.get("r"), "lora_alpha": config.get("lora_alpha"),
           "target_modules": sorted(config.get("target_modules") or [])}
    want = {"r": lora.r, "lora_alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}
    diffs = [f"{key}: adapter has {got[key]}, engine serves {want[key]}"
             for key in want if got[key] != want[key]]
    if diffs:
        raise EngineError(f"adapter {path.parent} does not match the engine's LoRA settings: "
                          + "; ".join(diffs))


def _read_safetensors(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            state.update(load_file(path, device=str(device)))
        except (OSError, SafetensorError) as e:
            raise EngineError(f"cannot read weights {path}: {e}") from e
    return state


def _check_same_tensors(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                        what: str) -> None:
    """Reject `state` unless it has exactly the keys and shapes of `expected`."""
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise EngineError(f"{what} keys differ from the engine's: missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}")
    wrong = [f"{key}: {tuple(state[key].shape)} != {tuple(expected[key].shape)}"
             for key in expected if state[key].shape != expected[key].shape]
    if wrong:
        raise EngineError(f"{what} shapes differ from the engine's: {wrong[:5]}")


def _check_full_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Every parameter must be covered (under any of its tied names), nothing unknown given."""
    expected = model.state_dict()
    unexpected = state.keys() - expected.keys()
    if unexpected:
        raise EngineError(f"unexpected weight keys: {sorted(unexpected)[:5]}")
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    missing = [names[0] for names in aliases.values() if not any(n in state for n in names)]
    if missing:
        raise EngineError(f"missing weight keys: {sorted(missing)[:5]}")
    _check_same_tensors(state, {key: expected[key] for key in state}, what="weight")
