"""The weight store: atomic versions described by URI, size and sha256, verified on fetch."""

import hashlib
from dataclasses import replace

import pytest

from miles.errors import WeightsError
from miles.weights.store import WEIGHTS_FILES, fetch_version, version_dir, write_version

WEIGHTS_FILE = WEIGHTS_FILES["lora"]


def write_fake_adapter(folder):
    (folder / WEIGHTS_FILE).write_bytes(b"weights-" * 100)
    (folder / "adapter_config.json").write_text("{}")


def test_write_then_fetch_round_trip(tmp_path):
    record = write_version(tmp_path, policy_version=3, step=3, base_model="tiny",
                           write=write_fake_adapter)
    folder = version_dir(tmp_path, 3)
    assert record.uri == (folder / WEIGHTS_FILE).resolve().as_uri()
    assert record.sha256 == hashlib.sha256(b"weights-" * 100).hexdigest()
    assert record.bytes == 800 and record.format == "lora" and record.policy_version == 3
    assert fetch_version(record) == folder
    assert not list(tmp_path.glob("*.tmp"))


def test_a_writer_that_forgets_the_weights_fails(tmp_path):
    with pytest.raises(WeightsError, match="produced no"):
        write_version(tmp_path, policy_version=1, step=1, base_model="m", write=lambda d: None)
    assert not version_dir(tmp_path, 1).exists()


@pytest.mark.parametrize("damage, message", [
    (lambda path, record: path.write_bytes(b"weights-" * 99), "bytes, announced"),
    (lambda path, record: path.write_bytes(b"Weights-" * 100), "sha256"),
    (lambda path, record: path.unlink(), "does not exist"),
])
def test_fetch_rejects_damaged_files(tmp_path, damage, message):
    record = write_version(tmp_path, policy_version=2, step=2, base_model="m",
                           write=write_fake_adapter)
    damage(version_dir(tmp_path, 2) / WEIGHTS_FILE, record)
    with pytest.raises(WeightsError, match=message):
        fetch_version(record)


def test_full_weights_are_announced_by_their_own_file(tmp_path):
    record = write_version(tmp_path, policy_version=4, step=4, base_model="m", fmt="full",
                           write=lambda d: (d / "model.safetensors").write_bytes(b"w" * 10))
    assert record.format == "full" and record.uri.endswith("/v00000004/model.safetensors")
    assert fetch_version(record) == version_dir(tmp_path, 4)
    with pytest.raises(WeightsError, match="produced no model.safetensors"):
        write_version(tmp_path, policy_version=5, step=5, base_model="m", fmt="full",
                      write=write_fake_adapter)
    with pytest.raises(WeightsError, match="weight format"):
        write_version(tmp_path, policy_version=6, step=6, base_model="m", fmt="merged",
                      write=write_fake_adapter)


def test_fetch_rejects_other_schemes(tmp_path):
    record = write_version(tmp_path, policy_version=0, step=0, base_model="m",
                           write=write_fake_adapter)
    with pytest.raises(WeightsError, match="only file://"):
        fetch_version(replace(record, uri="s3://bucket/x.safetensors"))


def test_pruning_keeps_the_newest_versions(tmp_path):
    from miles.weights.store import prune_versions

    for v in range(5):
        write_version(tmp_path, policy_version=v, step=v, base_model="m", write=write_fake_adapter)
    (tmp_path / "v00000009.tmp").mkdir()  # a version being written is never touched
    assert prune_versions(tmp_path, 0) == []
    deleted = prune_versions(tmp_path, 2)
    assert [p.name for p in deleted] == ["v00000000", "v00000001", "v00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004",
                                                          "v00000009.tmp"]
