"""Trainer checkpoints at world size 1: verified loading with fallback, pruning by step number,
fencing. Plain tensor state dicts stand in for the learner's state."""

import logging

import pytest
import torch

from miles.errors import CheckpointError, FencedError
from miles.trainer.checkpoint import (DAMAGED_SUFFIX, LATEST, META, checkpoint_dir,
                                      load_checkpoint, load_newest, prune_checkpoints,
                                      save_checkpoint)

# dcp says once per call that it runs without a process group: world size 1 is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"


def state_of(step):
    return {"w": torch.randn(100, generator=torch.Generator().manual_seed(step)),
            "step": torch.tensor(step)}


def empty_state():
    return {"w": torch.zeros(100), "step": torch.tensor(-1)}


def save(root, *steps):
    for step in steps:
        save_checkpoint(root, step, state_of(step), {"policy_version": step})
    return [checkpoint_dir(root, s) for s in steps]


def assert_loaded(result, state, root, step):
    path, meta = result
    assert path == checkpoint_dir(root, step)
    assert meta["step"] == step and meta["policy_version"] == step
    torch.testing.assert_close(state["w"], state_of(step)["w"])
    assert int(state["step"]) == step


def damaged(root):
    return sorted(p.name for p in root.glob(f"*{DAMAGED_SUFFIX}"))


def skip_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "skipping checkpoint" in r.getMessage()]


def test_save_then_load_round_trip(tmp_path):
    save(tmp_path, 1, 2)
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 2)
    assert (tmp_path / LATEST).read_text() == "step_00000002"
    state = empty_state()
    assert load_checkpoint(checkpoint_dir(tmp_path, 1), state)["step"] == 1
    torch.testing.assert_close(state["w"], state_of(1)["w"])


def test_no_meta_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    _, newest = save(tmp_path, 1, 2)
    (newest / META).unlink()
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 1)
    assert damaged(tmp_path) == ["step_00000002.damaged"]
    [warning] = skip_warnings(caplog)
    assert "step_00000002" in warning and f"no {META}" in warning


def test_latest_naming_a_missing_folder_is_ignored(tmp_path):
    save(tmp_path, 1, 2)
    (tmp_path / LATEST).write_text("step_00000009")
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 2)
    assert damaged(tmp_path) == []


def test_truncated_shard_is_skipped_naming_the_file_and_sizes(tmp_path, caplog):
    _, newest = save(tmp_path, 1, 2)
    shard = newest / SHARD
    full = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:full // 2])
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 1)
    assert damaged(tmp_path) == ["step_00000002.damaged"]
    [warning] = skip_warnings(caplog)
    assert "step_00000002" in warning
    assert f"{SHARD} has {full // 2} bytes, {META} lists {full}" in warning


def test_empty_metadata_is_skipped(tmp_path, caplog):
    _, newest = save(tmp_path, 1, 2)
    (newest / ".metadata").write_bytes(b"")
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 1)
    assert damaged(tmp_path) == ["step_00000002.damaged"]
    [warning] = skip_warnings(caplog)
    assert "step_00000002" in warning and ".metadata has 0 bytes" in warning


def test_a_shard_of_the_right_size_that_does_not_read_is_skipped(tmp_path, caplog):
    _, newest = save(tmp_path, 1, 2)
    shard = newest / SHARD
    shard.write_bytes(b"\x00" * shard.stat().st_size)  # sizes match meta.json, content does not
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 1)
    assert damaged(tmp_path) == ["step_00000002.damaged"]
    [warning] = skip_warnings(caplog)
    assert "step_00000002" in warning and "reading it failed" in warning
    with pytest.raises(CheckpointError, match="step_00000002.damaged: reading it failed"):
        load_checkpoint(tmp_path / "step_00000002.damaged", empty_state())


def test_every_checkpoint_damaged_is_an_error_naming_each(tmp_path):
    first, second = save(tmp_path, 1, 2)
    (first / META).unlink()
    (second / SHARD).write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        load_newest(tmp_path, empty_state())
    message = str(err.value)
    assert str(tmp_path) in message
    assert f"step_00000001: no {META}" in message and f"step_00000002: {SHARD} has 0" in message
    assert damaged(tmp_path) == ["step_00000001.damaged", "step_00000002.damaged"]


def test_no_checkpoint_at_all_is_none(tmp_path):
    assert load_newest(tmp_path, empty_state()) is None
    (tmp_path / "unrelated").mkdir()
    assert load_newest(tmp_path, empty_state()) is None


def test_pruning_goes_by_step_number_not_name(tmp_path):
    # by name "step_100000000" < "step_99999998" < "step_99999999": the newest would go first
    save(tmp_path, 99_999_998, 99_999_999, 100_000_000)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_100000000", "step_99999999"]
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 100_000_000)


def test_a_folder_without_meta_never_counts_as_complete(tmp_path):
    save(tmp_path, 1, 2, 3)
    for step in (4, 5):
        checkpoint_dir(tmp_path, step).mkdir()  # a crash before meta.json: not a checkpoint
    assert prune_checkpoints(tmp_path, keep=2) == []  # 2 and 3 are the newest complete
    assert prune_checkpoints(tmp_path, keep=1) == [checkpoint_dir(tmp_path, 2)]
    assert checkpoint_dir(tmp_path, 3).is_dir()
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 3)


def test_the_newest_complete_checkpoint_is_never_pruned(tmp_path):
    save(tmp_path, 1, 2)
    prune_checkpoints(tmp_path, keep=0)
    assert checkpoint_dir(tmp_path, 2).is_dir() and not checkpoint_dir(tmp_path, 1).exists()


def test_stale_staging_folders_are_pruned(tmp_path):
    save(tmp_path, 3)
    for step in (1, 2, 4):  # 1 and 2: left by crashes; 4: a save still in progress
        (tmp_path / f"step_{step:08d}.tmp").mkdir()
    removed = prune_checkpoints(tmp_path)
    assert sorted(p.name for p in removed) == ["step_00000001.tmp", "step_00000002.tmp"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003",
                                                                "step_00000004.tmp"]


def test_a_fenced_save_publishes_nothing(tmp_path):
    save(tmp_path, 1)

    def fence():
        raise FencedError("a newer trainer runs")

    with pytest.raises(FencedError, match="a newer trainer runs"):
        save_checkpoint(tmp_path, 2, state_of(2), {"policy_version": 2}, fence=fence)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001"]
    assert (tmp_path / LATEST).read_text() == "step_00000001"
    state = empty_state()
    assert_loaded(load_newest(tmp_path, state), state, tmp_path, 1)
