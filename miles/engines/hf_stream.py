"""A continuous batcher for the Hugging Face engine: requests join and leave between decoding steps.

`HFEngine.generate` samples a fixed batch until its longest row is done. `StreamingSampler`
instead owns the rows in flight: `submit` queues a request (one prompt, `params.n` rows) from
any thread, and each `step` prefills the requests queued since the last one, merges them into
the running batch, samples one token for every row, and retires rows the moment they end, so a
short response never waits for a long one and a new prompt never waits for a batch to drain.

One batched `DynamicCache` holds every row's keys and values, left-padded: row i's tokens are the
rightmost `length[i]` columns, so the attention mask is `arange(W) >= W - length` and the next
position is `length` (the `cumsum(mask) - 1` convention of `prefill`, real tokens at 0, 1, 2, ...).
Joining pads the narrower of the two caches on the left with zeros (masked out); after rows
leave, the columns no remaining row needs are cut, so the width is always the longest in-flight
context. The logits, processing and sampling are those of `generate` (`prefill`,
`process_logits`, `StopStrings`), so a greedy request gives the same tokens either way.

Each token records the engine's `policy_version` when it was sampled (`Request.token_versions`).
Weight loads take the engine's lock, so they land between steps; the next step then rebuilds the
cache by re-prefilling every row's prompt and response so far under the new weights, so each
token is sampled from exactly one version's distribution given its context (keeping keys and
values computed by the old weights would sample from no model's distribution; the price is one
prefill of the in-flight contexts per weight update).

Simplifications, chosen on purpose:
- One forward per step over all rows (decode) plus one over the joiners (prefill); no paged
  cache, no chunked prefill, no limit on rows in flight (the caller bounds what it submits).
- Logits are processed and sampled per request (each has its own params and its own generator),
  so a seeded request with n=1 samples exactly what `generate` samples for it alone, whatever
  else is in flight; the per-request loop costs a few small ops per request and step.
- Only plain `DynamicLayer` caches (full attention) are supported; a sliding-window or hybrid
  model is refused when its sampler is built (the cache its config asks for is checked).
- `Completion.policy_version` is the version of a response's first token (its oldest: versions
  only grow within a lineage); `Request.token_versions` has every token's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from miles.engines.base import Completion, checked_stop_strings
from miles.engines.hf import HFEngine, StopStrings, cache_argument, prefill
from miles.errors import EngineError
from miles.rl.sampling import SamplingParams, process_logits


@dataclass(eq=False)
class Row:
    """One sample in flight: its response so far, with per-token logprobs and versions."""

    request: Request = field(repr=False)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def completion(self) -> Completion:
        return Completion(token_ids=np.array(self.tokens, dtype=np.int32),
                          logprobs=np.array(self.logprobs, dtype=np.float32),
                          finish_reason=self.finish_reason, policy_version=self.versions[0])


@dataclass(eq=False)
class Request:
    """`params.n` samples of one prompt. Once `done`, `completions[i]` is sample i and
    `token_versions[i]` ([T] int32) the policy version that sampled each of its tokens."""

    prompt: list[int]
    params: SamplingParams
    stops: StopStrings
    generator: torch.Generator
    rows: list[Row] = field(default_factory=list)
    completions: list[Completion] | None = None
    token_versions: list[np.ndarray] | None = None
    aborted: bool = False

    @property
    def done(self) -> bool:
        return self.completions is not None

    def _finish(self) -> None:
        self.completions = [row.completion() for row in self.rows]
        self.token_versions = [np.array(row.versions, dtype=np.int32) for row in self.rows]


class StreamingSampler:
    """The rows in flight on one `HFEngine`, stepped one token at a time (see the module doc).

    `submit` is thread-safe and never waits for a step; `step` and `abort` hold the engine's lock,
    so they never overlap a `generate` or a weight load.
    """

    def __init__(self, engine: HFEngine):
        self.engine = engine
        _check_plain(DynamicCache(config=engine.model.config))
        self._cache_name = cache_argument(engine.model)
        self._pending: deque[Request] = deque()
        self._pending_lock = threading.Lock()
        self._rows: list[Row] = []  # batch order: row i is row i of the cache
        self._cache: DynamicCache | None = None  # [B, H, W, D] per layer
        self._lengths = torch.zeros(0, dtype=torch.long, device=engine.device)  # [B]
        self._weights = engine.weight_loads  # the weights the cache was computed with
        self.busy_seconds = 0.0  # wall time inside step
        self.steps = 0  # steps that had rows to sample
        self.tokens_generated = 0  # tokens sampled, including those of aborted rows
        self.tokens_wasted = 0  # tokens of aborted rows

    @property
    def rows_in_flight(self) -> int:
        return len(self._rows)

    @property
    def requests_pending(self) -> int:
        return len(self._pending)

    @property
    def cache_width(self) -> int:
        """Columns of the KV cache: the longest in-flight context (0 when idle)."""
        return 0 if self._cache is None else self._cache.get_seq_length()

    def submit(self, prompt_ids: list[int], params: SamplingParams, *,
               stop_strings: tuple[str, ...] = (), seed: int | None = None) -> Request:
        """Queue `params.n` samples of `prompt_ids`; they join the batch at the next step."""
        self.engine._check_prompts([prompt_ids])
        stops = StopStrings(self.engine.tokenizer, checked_stop_strings(stop_strings))
        generator = torch.Generator(device=self.engine.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        request = Request(prompt=list(prompt_ids), params=params, stops=stops, generator=generator)
        request.rows = [Row(request) for _ in range(params.n)]
        with self._pending_lock:
            self._pending.append(request)
        return request

    def step(self) -> list[Request]:
        """Admit the queued requests, sample one token for every row in flight, and return the
        requests whose last row ended in this step."""
        with self.engine._lock:
            with self._pending_lock:
                joining = list(self._pending)
                self._pending.clear()
            if not joining and not self._rows:
                return []
            start = time.perf_counter()
            rows = self._rows + [row for request in joining for row in request.rows]
            try:
                with torch.inference_mode():
                    if self.engine.weight_loads != self._weights:
                        self._drop_cache()
                    logits = self._advance(joining)  # [B, V]
                    self._sample(logits)
                    finished = self._retire()
            except BaseException:
                self._recover(rows)
                raise
            self.steps += 1
            self.busy_seconds += time.perf_counter() - start
        return finished

    def abort(self, request: Request) -> int:
        """Drop `request`'s rows (queued or in flight); returns the tokens they had sampled."""
        with self.engine._lock:
            with self._pending_lock:
                if request in self._pending:
                    self._pending.remove(request)
            if request.done or request.aborted:
                return 0
            request.aborted = True
            wasted = sum(len(row.tokens) for row in request.rows)
            with torch.inference_mode():
                self._keep([row.request is not request for row in self._rows])
            self.tokens_wasted += wasted
            return wasted

    def _recover(self, rows: list[Row]) -> None:
        """After a step that raised: the cache may be a token ahead of some rows, or gone with
        them, so every row of the step that has not ended stays in flight and is prefilled
        again from its prompt and tokens at the next step; requests whose rows all ended are
        finished (`done`)."""
        self._rows = [row for row in rows if row.finish_reason is None]
        self._drop_cache()
        for request in dict.fromkeys(row.request for row in rows):
            if not request.done and all(row.finish_reason for row in request.rows):
                request._finish()

    def _drop_cache(self) -> None:
        """Forget the keys and values of old weights: every row is prefilled again."""
        self._cache, self._weights = None, self.engine.weight_loads
        self._lengths = self._lengths[:0]

    def _advance(self, joining: list[Request]) -> torch.Tensor:
        """Feed each cached row its last token, prefill the rest and the joiners, and merge
        them into one batch; returns the next-token logits of every row [B, V]."""
        if self._cache is None:
            rejoining, self._rows = self._rows, []
            logits = None
        else:
            rejoining, logits = [], self._decode()  # [B, V]
        contexts = [(row.request.prompt + row.tokens, [row]) for row in rejoining]
        contexts += [(request.prompt, request.rows) for request in joining]
        if contexts:
            new_logits = self._prefill(contexts)  # [R, V]
            logits = new_logits if logits is None else torch.cat([logits, new_logits])
        return logits

    def _decode(self) -> torch.Tensor:
        """One token through the cache for every row: its last sampled one. Returns [B, V]."""
        width = self.cache_width + 1
        device = self._lengths.device
        input_ids = torch.tensor([[row.tokens[-1]] for row in self._rows], device=device)  # [B, 1]
        mask = (torch.arange(width, device=device) >= width - 1 - self._lengths[:, None]).long()
        out = self.engine.model(input_ids=input_ids, attention_mask=mask,  # mask [B, W + 1]
                                position_ids=self._lengths[:, None], use_cache=True,
                                logits_to_keep=1, **{self._cache_name: self._cache})
        self._lengths = self._lengths + 1
        return out.logits[:, -1]

    def _prefill(self, contexts: list[tuple[list[int], list[Row]]]) -> torch.Tensor:
        """Prefill each context once, repeat it for the rows it serves, and append those rows
        to the batch. Returns their next-token logits [R, V]."""
        logits, mask, _, cache = prefill(self.engine.model, [ids for ids, _ in contexts], 1,
                                         pad_token_id=self.engine._pad_token_id,
                                         cache_name=self._cache_name)
        _check_plain(cache)
        index = torch.tensor([i for i, (_, rows) in enumerate(contexts) for _ in rows],
                             device=logits.device)  # [R]
        cache.batch_select_indices(index)
        self._cache = cache if self._cache is None else _join(self._cache, cache)
        self._lengths = torch.cat([self._lengths, mask.sum(-1)[index]])
        self._rows += [row for _, rows in contexts for row in rows]
        return logits[index]

    def _sample(self, logits: torch.Tensor) -> None:
        """One token per row from its request's processed distribution; finishes rows that
        sampled EOS, reached a stop string or their budget."""
        version = self.engine.policy_version
        for request, index in _rows_by_request(self._rows).items():
            params = request.params
            processed = process_logits(logits[index], temperature=params.temperature,
                                       top_k=params.top_k, top_p=params.top_p)  # [r, V]
            tokens = torch.multinomial(processed.softmax(-1), 1, generator=request.generator)
            logprobs = processed.log_softmax(-1).gather(-1, tokens)  # [r, 1]
            for i, token, logprob in zip(index, tokens.flatten().tolist(),
                                         logprobs.flatten().tolist()):
                self._append(self._rows[i], token, logprob, version)
        self.tokens_generated += len(self._rows)

    def _append(self, row: Row, token: int, logprob: float, version: int) -> None:
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.versions.append(version)
        stops = row.request.stops
        if token == self.engine.eos_token_id:
            row.finish_reason = "stop"
        elif stops and _reached_stop(stops, row.tokens):
            row.finish_reason = "stop_string"
        elif len(row.tokens) == row.request.params.max_new_tokens:
            row.finish_reason = "length"

    def _retire(self) -> list[Request]:
        """Remove the rows that ended; return the requests none of whose rows is left."""
        ended = dict.fromkeys(row.request for row in self._rows if row.finish_reason)
        self._keep([row.finish_reason is None for row in self._rows])
        finished = [r for r in ended if all(row.finish_reason for row in r.rows)]
        for request in finished:
            request._finish()
        return finished

    def _keep(self, keep: list[bool]) -> None:
        """Keep only the rows marked in `keep`, and cut the cache columns none of them needs."""
        if all(keep):
            return
        self._rows = [row for row, kept in zip(self._rows, keep) if kept]
        if not self._rows or self._cache is None:  # None: rows wait to be prefilled again
            self._cache, self._lengths = None, self._lengths[:0]
            return
        index = torch.tensor(keep, device=self._lengths.device).nonzero().flatten()  # [B']
        self._lengths = self._lengths[index]
        self._cache.batch_select_indices(index)
        _trim(self._cache, int(self._lengths.max()))


def _rows_by_request(rows: list[Row]) -> dict[Request, list[int]]:
    out: dict[Request, list[int]] = {}
    for i, row in enumerate(rows):
        out.setdefault(row.request, []).append(i)
    return out


def _reached_stop(stops: StopStrings, tokens: list[int]) -> bool:
    """Whether the response's tail (the last `stops.window` tokens) contains a stop string; as in
    `StopStrings.hits`, checking after every token makes the tail enough."""
    tail = stops.tokenizer.decode(tokens[-stops.window:], skip_special_tokens=True)
    return any(s in tail for s in stops.strings)


def _check_plain(cache: DynamicCache) -> None:
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise EngineError(f"streaming needs full-attention caches (DynamicLayer), got {kinds}: "
                          f"generate in batches with this model (rollout.max_in_flight=0, "
                          f"episodes.stream_turns=false)")


def _join(first: DynamicCache, second: DynamicCache) -> DynamicCache:
    """`first`'s rows then `second`'s in `first`, the narrower padded on the left with zeros."""
    width = max(first.get_seq_length(), second.get_seq_length())
    for a, b in zip(first.layers, second.layers, strict=True):
        a.keys = torch.cat([_pad_left(a.keys, width), _pad_left(b.keys, width)])
        a.values = torch.cat([_pad_left(a.values, width), _pad_left(b.values, width)])
    return first


def _pad_left(states: torch.Tensor, width: int) -> torch.Tensor:
    """`states` [B, H, L, D] with `width - L` zero columns in front."""
    return torch.nn.functional.pad(states, (0, 0, width - states.shape[-2], 0))


def _trim(cache: DynamicCache, width: int) -> None:
    """Cut all but the last `width` columns."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, -width:]
        layer.values = layer.values[:, :, -width:]
