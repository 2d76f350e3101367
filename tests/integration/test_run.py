"""`miles run CONFIG` on the embedded bus: the bounds (max_steps, the data's end), the refusals
at the door, and resuming after `kill -9` with no group judged twice or skipped."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import time

import pytest
from transformers import AutoModelForCausalLM

from miles.cli import main
from tests.accounting import ledger
from tests.runs import (assert_judged_once, published_groups, start_run, write_config,
                        write_dataset)


def run_cli(*args: str) -> tuple[int, str]:
    """`miles ARGS` in this process (the kill test runs it as a process): the exit code and
    what it wrote to stderr."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = main(list(args))
    return code, errors.getvalue()


def test_a_run_stops_at_max_steps_and_exports_its_policy(model_dir, tmp_path):
    dataset = write_dataset(tmp_path / "data.jsonl", 64)
    config = write_config(tmp_path / "run.toml", model_dir, tmp_path / "out", dataset,
                          max_steps=3, export_policy=True)
    code, errors = run_cli("run", str(config))
    assert code == 0, errors[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (report["ended_by"], report["steps"], report["policy_version"]) == ("max_steps", 3, 3)
    assert report["run"] == "out" and len(ledger(tmp_path / "out")) == 3
    AutoModelForCausalLM.from_pretrained(report["policy_dir"])  # a plain HF checkpoint


def test_a_run_ends_when_its_epochs_are_used_up(model_dir, tmp_path):
    """2 epochs over 10 prompts: 20 groups, 4 per step; the run ends by itself once all are
    judged (5 steps' worth at most; a step that can no longer fill up is not trained)."""
    dataset = write_dataset(tmp_path / "data.jsonl", 10)
    config = write_config(tmp_path / "run.toml", model_dir, tmp_path / "out", dataset,
                          epochs=2, max_staleness=4)
    code, errors = run_cli("run", str(config))
    assert code == 0, errors[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ended_by"] == "data"
    entries = ledger(tmp_path / "out")
    judged = [g for e in entries for k in ("trained", "dropped", "filtered") for g in e[k]]
    assert 16 <= len(judged) <= 20 and len(set(judged)) == len(judged)
    epochs = {g.split("/")[1] for g in judged}
    assert epochs == {"e0", "e1"}


def test_the_door_refuses_a_second_run_in_the_same_out_dir_and_a_resume_of_nothing(
        model_dir, tmp_path):
    dataset = write_dataset(tmp_path / "data.jsonl", 8)
    config = write_config(tmp_path / "run.toml", model_dir, tmp_path / "out", dataset)
    code, errors = run_cli("run", str(config), "--resume")
    assert code == 2 and "holds no run to resume" in errors
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "run.json").write_text(json.dumps({"run": "out", "bus": "x"}))
    code, errors = run_cli("run", str(config))
    assert code == 2 and "--resume" in errors


@pytest.mark.slow
def test_a_killed_run_resumes_with_every_group_judged_once(model_dir, tmp_path):
    dataset = write_dataset(tmp_path / "data.jsonl", 200)
    out = tmp_path / "out"
    steps = 40  # enough that the kill lands mid-run at ~15 steps a second (50 fill up)
    config = write_config(tmp_path / "run.toml", model_dir, out, dataset, max_steps=steps,
                          checkpoint_every=2, max_staleness=2)
    log = tmp_path / "run.log"
    first = start_run(config, log)
    deadline = time.monotonic() + 180
    while len(ledger(out)) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = len(ledger(out))
    assert 3 <= killed_at < steps, log.read_text()[-3000:]
    resumed = start_run(config, log, "--resume")
    assert resumed.wait(240) == 0, log.read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["ended_by"], report["steps"]) == ("max_steps", steps)
    assert "resumed at step" in log.read_text()
    import asyncio
    published, lettered = asyncio.run(published_groups(f"embedded://{out.resolve() / 'bus'}", "out"))
    entries = assert_judged_once(out, published, lettered)
    assert len(entries) == steps


def test_an_embedded_run_gives_its_roles_a_share_of_the_cores_each(model_dir, tmp_path,
                                                                    monkeypatch):
    """The engine and the learner compute at the same time: the run's process (the engine's)
    sets torch's threads to one role's share while it runs, and puts them back after."""
    import torch

    seen: list[int] = []
    set_threads, before = torch.set_num_threads, torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), set_threads(n)))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))  # six usable cores
    dataset = write_dataset(tmp_path / "data.jsonl", 64)
    for name, settings, threads in (("auto", {}, 3),  # 6 cores // (1 producer + 1 trainer rank)
                                    ("set", {"torch_threads": 5, "producers": 2}, 5)):
        seen.clear()
        config = write_config(tmp_path / f"{name}.toml", model_dir, tmp_path / name, dataset,
                              max_steps=1, export_policy=False, **settings)
        code, errors = run_cli("run", str(config))
        assert code == 0, errors[-3000:]
        assert seen[:1] == [threads] and seen[-1] == before and torch.get_num_threads() == before
