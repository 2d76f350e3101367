"""The embedded run's learner in a process of its own: the trainer loop keeps the bus, the
learner gets a GIL of its own.

Why: in an embedded run the event loop (the producer's scoring and encoding, the trainer's
decoding and checks, heartbeats) holds the GIL about a fifth of the time in pure-Python
stretches, and the learner's step, thousands of small torch ops each of which gives the GIL
up and takes it back, waits behind every stretch (docs/benchmarks.md, "The learner in a
process of its own").

`LearnerProcess` is a `StepRunner` for `TrainerLoop` whose steps run in a child process
(`python -m miles.trainer.learner_process --config SETTINGS --fds R,W`). The child builds the
learner and its `StepRunner` from `LearnerProcessSettings` (written by the parent as YAML) and
then serves requests over two pipes, one msgpack message per request and per reply, no pickle:
`{"op": "resume"}`, `{"op": "step", "payload": step message}` (`pack_step`), `{"op": "close"}`.
A reply carries what the call returned (a weight version as its wire bytes), the learner state
the loop reads (`policy_version`, the KL penalty's checkpoint meta), or the error it raised
(its type name, message and traceback; FencedError, CheckpointError and StepError come back as
themselves). The child runs in a session of its own and ignores SIGINT and SIGTERM (the
parent stops it between steps, so a Ctrl-C never cuts a step or a checkpoint in half), and it
gets SIGKILL when the parent dies (Linux), like the run's daemons. One rank only: several
ranks are `trainer_ranks` on Kafka.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack

from miles.config import load_config, write_settings
from miles.errors import CheckpointError, FencedError, MilesError, StepError
from miles.protocol import WeightVersion, decode, encode
from miles.service import configure_logging, die_with_parent
from miles.trainer.fence import Fence
from miles.trainer.learner import LearnerConfig
from miles.trainer.loop import LoopConfig
from miles.trainer.model import LoraSettings
from miles.trainer.runner import StepResult

log = logging.getLogger(__name__)
ERRORS = {cls.__name__: cls for cls in (FencedError, CheckpointError, StepError)}
"""Errors the child's runner raises on purpose that the parent raises again as themselves."""


class LearnerProcessError(MilesError):
    """The learner process failed: it exited, or its step raised an unexpected error."""


@dataclass
class LearnerProcessSettings:
    model_dir: Path = Path("model")
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full fine-tuning
    torch_threads: int = 0  # 0 leaves torch's default
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)


class LearnerView:
    """What `TrainerLoop` reads of its learner, kept up to date from the child's replies."""

    def __init__(self, settings: LearnerProcessSettings, vocab_size: int, tokenizer):
        self.config = settings.learner
        self.algorithm = settings.learner.algorithm
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.policy_version = 0
        self.kl = _KLMeta({})

    def update(self, state: dict) -> None:
        self.policy_version = int(state["policy_version"])
        self.kl = _KLMeta(state["kl"])


class _KLMeta:
    def __init__(self, meta: dict):
        self.meta = meta

    def checkpoint_meta(self) -> dict:
        return dict(self.meta)


class LearnerProcess:
    """A `StepRunner` whose learner runs in a child process (see the module docstring)."""

    def __init__(self, settings: LearnerProcessSettings, *, settings_path: Path):
        """Start the child; it builds the learner while this process goes on (`wait_ready`)."""
        self.settings = settings
        self.config = settings.loop
        self.fence: Fence | None = None  # the child's generation, once it resumed
        self.learner: LearnerView | None = None  # once the child is ready
        write_settings(settings, settings_path)
        to_child, self._send = os.pipe()
        self._receive, from_child = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "miles.trainer.learner_process", "--config", str(settings_path),
             "--fds", f"{to_child},{from_child}", "--parent", str(os.getpid())],
            pass_fds=(to_child, from_child), start_new_session=True)
        os.close(to_child)
        os.close(from_child)
        self._requests = Connection(self._send, readable=False)
        self._replies = Connection(self._receive, writable=False)

    def wait_ready(self) -> None:
        """Block until the child has built its learner (LearnerProcessError if it failed)."""
        from transformers import AutoTokenizer

        ready = self._reply()
        self.learner = LearnerView(self.settings, int(ready["vocab_size"]),
                                   AutoTokenizer.from_pretrained(self.settings.model_dir))

    def resume(self) -> tuple[dict | None, WeightVersion | None]:
        reply = self._call({"op": "resume"})
        self.fence = Fence(self.config.out_dir, int(reply["generation"]))
        return reply["meta"], _record(reply["record"])

    def step(self, payload: bytes, groups=None) -> StepResult | None:
        """Run one step message in the child (`groups`, rank 0's decoded copy, stay here: the
        child decodes the message's own)."""
        reply = self._call({"op": "step", "payload": payload})
        if reply["stopped"]:
            return None
        return StepResult(metrics=reply["metrics"], record=_record(reply["record"]),
                          failed={int(k): v for k, v in reply["failed"].items()})

    def close(self) -> None:
        """Ask the child to end and wait for it (killed after 30 s)."""
        if self.process.poll() is None:
            try:
                self._requests.send_bytes(msgpack.packb({"op": "close"}))
            except OSError:
                pass
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                log.warning("the learner process did not end within 30 s: killed")
                self.process.kill()
                self.process.wait()
        self._requests.close()
        self._replies.close()

    def _call(self, request: dict) -> dict:
        try:
            self._requests.send_bytes(msgpack.packb(request, use_bin_type=True))
        except OSError as err:
            raise self._exited() from err
        return self._reply()

    def _reply(self) -> dict:
        try:
            reply = msgpack.unpackb(self._replies.recv_bytes(), raw=False, strict_map_key=False)
        except (EOFError, OSError) as err:
            raise self._exited() from err
        if "error" in reply:
            error = reply["error"]
            cls = ERRORS.get(error["type"])
            if cls is not None:
                raise cls(error["message"])
            raise LearnerProcessError(f"the learner process raised {error['type']}: "
                                      f"{error['message']}\n{error['traceback']}")
        if "state" in reply:
            self.learner.update(reply["state"])
        return reply

    def _exited(self) -> LearnerProcessError:
        try:
            code = self.process.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        return LearnerProcessError(f"the learner process (pid {self.process.pid}) ended "
                                   f"unexpectedly (exit code {code}); its log is above")


def _record(data: bytes | None) -> WeightVersion | None:
    return None if data is None else decode(data, WeightVersion)


# -- the child ---------------------------------------------------------------------------------


def serve(settings: LearnerProcessSettings, requests: Connection, replies: Connection) -> None:
    import torch

    from miles.trainer.runner import StepRunner

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    runner = StepRunner.build(settings.model_dir, settings.loop, learner=settings.learner,
                              lora=settings.lora)
    learner = runner.learner
    replies.send_bytes(msgpack.packb({"vocab_size": learner.vocab_size}))
    while True:
        try:
            request = msgpack.unpackb(requests.recv_bytes(), raw=False)
        except EOFError:
            return  # the parent is gone
        if request["op"] == "close":
            return
        try:
            reply = _handle(runner, request)
            reply["state"] = {"policy_version": learner.policy_version,
                              "kl": learner.kl.checkpoint_meta()}
        except Exception as err:  # noqa: BLE001 - every error goes back to the parent
            reply = {"error": {"type": type(err).__name__, "message": str(err),
                               "traceback": traceback.format_exc()}}
        replies.send_bytes(msgpack.packb(reply, use_bin_type=True))


def _handle(runner, request: dict) -> dict:
    if request["op"] == "resume":
        meta, record = runner.resume()
        return {"meta": meta, "record": _wire(record), "generation": runner.fence.generation}
    if request["op"] == "step":
        result = runner.step(request["payload"])
        if result is None:
            return {"stopped": True}
        return {"stopped": False, "metrics": result.metrics, "record": _wire(result.record),
                "failed": result.failed}
    raise ValueError(f"unknown request {request['op']!r}")


def _wire(record: WeightVersion | None) -> bytes | None:
    return None if record is None else encode(record)


def main(argv=None) -> int:
    from miles.trainer import distributed

    parser = argparse.ArgumentParser(description="the embedded run's learner process")
    parser.add_argument("--config", required=True)
    parser.add_argument("--fds", required=True, help="the request and reply pipes' fds")
    parser.add_argument("--parent", type=int, required=True, help="the run's pid")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it, between steps
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    if os.getppid() != args.parent:  # it died before the line above
        return 1
    configure_logging()
    settings = load_config(LearnerProcessSettings, path=args.config, env={})
    read_fd, write_fd = (int(fd) for fd in args.fds.split(","))
    requests = Connection(read_fd, writable=False)
    replies = Connection(write_fd, readable=False)
    try:
        serve(settings, requests, replies)
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
