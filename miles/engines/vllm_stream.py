"""Streaming requests on the in-process vLLM engine: one prompt's samples submitted and collected
on their own, beside the others (engine "vllm" with `rollout.max_in_flight`).

`VLLMEngine.generate` submits a batch and waits for all of it. `StreamingRequests.submit`
instead hands one prompt (its n samples) to vLLM from any thread and returns at once: the
request runs as a task on the engine's loop, vLLM's continuous batching schedules it with
whatever else runs, and its `future` resolves to its Completions when its last sample ends.
It is the same `AsyncLLM`, the same versions and the same weight loads as `generate`'s: one
engine object serves both ways, and weights load through `load_version` either way.

Versions. A request names the weights current when it is submitted (`ServedVersions.acquire`):
its LoRARequest, so an adapter loaded meanwhile serves later requests only and a running
request ends on the version it started with (its Completions carry it); the old adapter is
removed when its last request ends. Full weights are replaced under every running request, so
the engine refuses a full-weight load while requests run and refuses requests while one loads
(EngineError): the caller drains or aborts first (`miles.rollout_stream.AsyncRequestStream`).

Outputs arrive as deltas (`RequestOutputKind.DELTA`) merged as they come (vLLM's own
`RequestOutput.add`), so the tokens sampled so far are known: `tokens_generated`, and the
tokens an aborted request throws away (`tokens_wasted`). `abort` cancels each request's task
(vLLM's generate aborts its request when cancelled), aborts its id as well (a request
cancelled while vLLM was still adding it), and waits for both: when it returns, nothing of
those requests runs in vLLM any more, so full weights can load. Cancelling a request's
`future` (a producer that stops waiting) cancels its task too.

Simplifications, chosen on purpose:
- `busy_seconds` is the wall time with at least one request in flight: vLLM's own step times
  are not visible from here, and one running request keeps its engine stepping.
- A request past `timeout_s` fails with EngineError (and is aborted), as a `generate` does.
- `tokens_generated` counts what reached this process: a token vLLM sampled just before an
  abort may not be counted.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.engines.base import Completion, checked_stop_strings
from miles.engines.vllm_engine import Served, parse_request_output, request_values
from miles.errors import MilesError
from miles.rl.sampling import SamplingParams

if TYPE_CHECKING:
    from miles.engines.vllm_engine import VLLMEngine


@dataclass(eq=False)
class StreamingRequest:
    """One prompt's `n` samples in vLLM. `future` resolves to their Completions (sample order),
    to None when `abort` ended the request, or to the error that ended it; `tokens` counts the
    tokens received so far, `first_token_at` (time.time()) when the first one came."""

    prompt: list[int]
    values: dict[str, Any]  # vLLM's SamplingParams keywords
    n: int
    stops: tuple[str, ...]
    served: Served
    request_id: str
    future: Future = field(default_factory=Future)
    tokens: int = 0
    first_token_at: float | None = None
    task: asyncio.Task | None = None  # on the engine's loop, once launched


class StreamingRequests:
    """The streaming requests of one `VLLMEngine` (see the module docstring). `submit` and
    `abort` are thread-safe; everything else runs on the engine's loop."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self._running: set[StreamingRequest] = set()
        self._removals: set[asyncio.Task] = set()  # adapter removals under way
        self.tokens_generated = 0  # tokens received, those of aborted requests included
        self.tokens_wasted = 0  # tokens of aborted requests
        self._busy = 0.0
        self._busy_since: float | None = None

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @property
    def busy_seconds(self) -> float:
        """Seconds with at least one request in flight."""
        since = self._busy_since
        return self._busy + (time.monotonic() - since if since is not None else 0.0)

    @property
    def loads_beside_requests(self) -> bool:
        """Whether a version can load while requests run (adapters: each request names its
        own); full weights cannot."""
        return self.engine.lora is not None

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, seed: int | None = None,
               stop_strings: tuple[str, ...] = ()) -> StreamingRequest:
        """Start `params.n` samples of `prompt_ids` under the current weights; returns at once.
        `seed` applies where the engine is `seeded` (vLLM gives sample k `seed + k`)."""
        engine = self.engine
        engine._check_prompts([prompt_ids])
        stops = checked_stop_strings(stop_strings)
        values = request_values(params, vocab_size=engine.vocab_size,
                                eos_token_id=engine.eos_token_id,
                                seed=seed if engine.settings.seeded else None,
                                stop_strings=stops)
        if engine._broken:
            raise MilesError(engine._broken)
        request = StreamingRequest(list(map(int, prompt_ids)), values, params.n, stops,
                                   engine._versions.acquire(),
                                   f"miles-{next(engine._request_ids)}")
        request.future.add_done_callback(lambda future: self._on_cancelled(request))
        engine._loop.call_soon_threadsafe(self._launch, request)
        return request

    def abort(self, requests: list[StreamingRequest]) -> dict[StreamingRequest, int]:
        """End `requests` and wait until vLLM has dropped them; the tokens each threw away
        (0 for one that had ended: its result stands)."""
        return self.engine._call(self._abort_all(list(requests)), "abort requests")

    # -- on the engine's loop ---------------------------------------------------------------------

    def _launch(self, request: StreamingRequest) -> None:
        if request.future.cancelled():  # given up before it started
            self._release(request)
            return
        if not self._running:
            self._busy_since = time.monotonic()
        self._running.add(request)
        request.task = self.engine._loop.create_task(self._collect(request))
        request.task.add_done_callback(lambda task: self._ended(request, task))

    async def _collect(self, request: StreamingRequest) -> list[Completion]:
        engine, vllm = self.engine, self.engine._vllm
        params = vllm.SamplingParams(**request.values, output_kind=vllm.DELTA)
        merged = None
        async with asyncio.timeout(engine.settings.timeout_s):
            async for output in engine._llm.generate(
                    {"prompt_token_ids": request.prompt}, params,
                    request_id=request.request_id, lora_request=request.served.lora):
                self._received(request, sum(len(s.token_ids) for s in output.outputs))
                if merged is None:
                    merged = output
                else:
                    merged.add(output, aggregate=True)
        if merged is not None:  # samples arrive in the order they produce tokens
            merged.outputs.sort(key=lambda sample: sample.index)
        return parse_request_output(merged, n=request.n, vocab_size=engine.vocab_size,
                                    eos_token_id=engine.eos_token_id,
                                    policy_version=request.served.policy_version,
                                    where=f"request {request.request_id}",
                                    stop_strings=request.stops)

    def _received(self, request: StreamingRequest, tokens: int) -> None:
        if tokens and request.first_token_at is None:
            request.first_token_at = time.time()
        request.tokens += tokens
        self.tokens_generated += tokens

    def _ended(self, request: StreamingRequest, task: asyncio.Task) -> None:
        """Resolve the request's future (None: aborted) and release its weights."""
        self._running.discard(request)
        if not self._running and self._busy_since is not None:
            self._busy += time.monotonic() - self._busy_since
            self._busy_since = None
        self._release(request)
        if not request.future.set_running_or_notify_cancel():  # nobody waits any more
            return
        if task.cancelled():
            request.future.set_result(None)
        elif task.exception() is not None:
            err = task.exception()
            request.future.set_exception(self.engine._failure(f"request {request.request_id}",
                                                              err))
        else:
            request.future.set_result(task.result())

    def _release(self, request: StreamingRequest) -> None:
        """The request no longer uses its weights; remove an adapter nothing uses now."""
        retired = self.engine._versions.release(request.served)
        if retired:
            removal = self.engine._loop.create_task(self.engine._drop_adapters(retired))
            self._removals.add(removal)
            removal.add_done_callback(self._removals.discard)

    async def _abort_all(self, requests: list[StreamingRequest]) -> dict[StreamingRequest, int]:
        tasks = [r.task for r in requests if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
            await self.engine._llm.abort([r.request_id for r in requests])
        wasted = {r: r.tokens if r.task is not None and r.task.cancelled() else 0
                  for r in requests}
        self.tokens_wasted += sum(wasted.values())
        return wasted

    # -- from any thread --------------------------------------------------------------------------

    def _on_cancelled(self, request: StreamingRequest) -> None:
        """A request whose future was cancelled (its caller stopped waiting) is aborted; one
        not launched yet never starts (`_launch`)."""
        if request.future.cancelled():
            self.engine._loop.call_soon_threadsafe(self._cancel, request)

    @staticmethod
    def _cancel(request: StreamingRequest) -> None:
        if request.task is not None:
            request.task.cancel()
