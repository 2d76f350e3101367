"""The embedded run's learner in a child process (`LearnerProcess`): the same updates as the
learner in this process, its errors back as themselves, and its end (closed, killed, orphaned,
Ctrl-C)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from miles.errors import FencedError
from miles.protocol import encode
from miles.trainer.fence import Fence
from miles.trainer.learner import LearnerConfig
from miles.trainer.learner_process import (LearnerProcess, LearnerProcessError,
                                           LearnerProcessSettings)
from miles.trainer.loop import LoopConfig
from miles.trainer.model import LoraSettings
from miles.trainer.runner import StepRunner, pack_step
from tests.factories import small_batch
from tests.integration.conformance import process_group  # noqa: F401

LORA = LoraSettings(r=4, alpha=8)
CONFIG = LearnerConfig(lr=1e-2, seed=0, precision="fp32")


def settings(model_dir, out_dir) -> LearnerProcessSettings:
    return LearnerProcessSettings(model_dir=model_dir, lora=LORA, torch_threads=1,
                                  learner=CONFIG, loop=LoopConfig(out_dir=out_dir))


def started(model_dir, out_dir) -> LearnerProcess:
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = LearnerProcess(settings(model_dir, out_dir), settings_path=out_dir / "learner.yaml")
    runner.wait_ready()
    return runner


def step_message(step: int) -> bytes:
    return pack_step([encode(g) for g in small_batch()], checkpoint=False, meta={"step": step})


@pytest.fixture
def child(model_dir, tmp_path):
    runner = started(model_dir, tmp_path / "child")
    yield runner
    runner.close()


def test_the_learner_process_makes_the_updates_of_the_learner_in_this_process(
        model_dir, tmp_path, child):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's, so both reduce in the same order
    try:
        here = StepRunner.build(model_dir, LoopConfig(out_dir=tmp_path / "here"),
                                learner=CONFIG, lora=LORA)
        versions = [(here.resume()[1], child.resume()[1])]
        results = [(here.step(step_message(s)), child.step(step_message(s))) for s in (1, 2, 3)]
    finally:
        torch.set_num_threads(threads)
    versions += [(a.record, b.record) for a, b in results]
    assert [b.policy_version for _, b in versions] == [0, 1, 2, 3]
    assert child.learner.policy_version == 3
    for a, b in versions:  # the same exported weights, byte for byte
        assert (a.policy_version, a.sha256, a.bytes) == (b.policy_version, b.sha256, b.bytes)
    for a, b in results:
        assert a.metrics["trainer/policy_loss"] == b.metrics["trainer/policy_loss"]
        assert a.metrics == pytest.approx(b.metrics, rel=1e-6, abs=1e-9)
    assert child.learner.kl.checkpoint_meta() == here.learner.kl.checkpoint_meta()
    assert child.learner.vocab_size == here.learner.vocab_size
    assert child.fence.generation == 1


def test_a_checkpoint_in_the_child_is_what_a_resumed_child_starts_from(model_dir, tmp_path):
    out = tmp_path / "run"
    first = started(model_dir, out)
    first.resume()
    for s in (1, 2):
        first.step(step_message(s))
    first.step(pack_step([], checkpoint=True, meta={"step": 2, "offsets": {}}))
    first.close()
    assert first.process.returncode == 0
    second = started(model_dir, out)
    try:
        meta, record = second.resume()
        assert meta["step"] == 2 and record.policy_version == 2
        assert second.fence.generation == 2 and second.learner.policy_version == 2
    finally:
        second.close()


def test_a_fenced_child_raises_fenced_error_here(model_dir, tmp_path, child):
    child.resume()
    Fence.take(tmp_path / "child")  # a newer trainer took the folder
    with pytest.raises(FencedError, match="generation 2 took over"):
        child.step(step_message(1))
    assert child.process.poll() is None  # the child is still there, for the next request


def test_a_killed_child_is_named_in_the_error(child):
    child.resume()
    child.process.send_signal(signal.SIGKILL)
    child.process.wait(10)
    with pytest.raises(LearnerProcessError, match=r"ended unexpectedly \(exit code -9\)"):
        child.step(step_message(1))


def test_ctrl_c_stops_the_run_not_the_child(child):
    """The run drains on SIGINT (the terminal sends it to the whole process group): the child
    ignores it and finishes what it is asked to."""
    child.resume()
    child.process.send_signal(signal.SIGINT)
    child.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert child.step(step_message(1)).record.policy_version == 1


def test_the_run_setting_chooses_where_the_learner_runs(model_dir, tmp_path):
    from miles.run import RunConfig, step_runner

    for flag, kind in ((True, LearnerProcess), (False, StepRunner)):
        out = tmp_path / str(flag)
        out.mkdir()
        runner = step_runner(RunConfig(out_dir=out, learner_process=flag, lora=LORA,
                                       learner=CONFIG), model_dir)
        try:
            assert isinstance(runner, kind)
            if flag:
                runner.wait_ready()
                assert runner.process.poll() is None and (out / "learner.yaml").is_file()
        finally:
            runner.close()


def test_the_child_dies_with_the_process_that_started_it(model_dir, tmp_path):
    """The child does not outlive its parent. Here the pipe's end would also stop it; the
    parent-death signal is what stops it in the middle of a long step (not reproduced here)."""
    script = (
        "import sys; from pathlib import Path\n"
        "from tests.integration.test_learner_process import started\n"
        "runner = started(Path(sys.argv[1]), Path(sys.argv[2]))\n"
        "print(runner.process.pid, flush=True)\n"
        "import os; os._exit(0)\n")  # no close: as if killed
    parent = subprocess.run([sys.executable, "-c", script, str(model_dir), str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert parent.returncode == 0, parent.stderr[-2000:]
    pid = int(parent.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, f"learner process {pid} outlived its parent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
