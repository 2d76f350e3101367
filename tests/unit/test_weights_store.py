"""The weight store: atomic versions described by URI, size and sha256, verified on fetch."""

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from miles.errors import MissingWeightsError, WeightsError
from miles.weights import store as weights_store
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
    assert fetch_version(record, tmp_path) == folder
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
        fetch_version(record, tmp_path)


def test_full_weights_are_announced_by_their_own_file(tmp_path):
    record = write_version(tmp_path, policy_version=4, step=4, base_model="m", fmt="full",
                           write=lambda d: (d / "model.safetensors").write_bytes(b"w" * 10))
    assert record.format == "full" and record.uri.endswith("/v00000004/model.safetensors")
    assert fetch_version(record, tmp_path) == version_dir(tmp_path, 4)
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
        fetch_version(replace(record, uri="s3://bucket/x.safetensors"), tmp_path)


def outside_file(tmp_path) -> Path:
    """A file outside the store `tmp_path / "store"`, with an adapter config beside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    write_fake_adapter(outside)
    return outside / WEIGHTS_FILE


def announced_as(record, path: Path):
    """`record` claiming the file at `path` (its true size and sha256: only the place is wrong)."""
    data = Path(path).read_bytes()
    return replace(record, uri=f"file://{path}", bytes=len(data),
                   sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture
def store_record(tmp_path):
    store = tmp_path / "store"
    return store, write_version(store, policy_version=1, step=1, base_model="m",
                                write=write_fake_adapter)


def test_a_uri_outside_the_store_is_refused_before_any_file_is_read(store_record, monkeypatch):
    store, record = store_record
    passwd = Path("/etc/passwd")
    forged = announced_as(record, passwd)  # the right sha256: integrity alone would pass
    monkeypatch.setattr(weights_store, "file_sha256", lambda path: pytest.fail(f"read {path}"))
    with pytest.raises(WeightsError, match="outside the weight store"):
        fetch_version(forged, store)


def test_dot_dot_and_symlinks_out_of_the_store_are_refused(tmp_path, store_record):
    store, record = store_record
    target = outside_file(tmp_path)
    dotted = f"{store}/v00000001/../../outside/{WEIGHTS_FILE}"
    linked_file = version_dir(store, 2)
    linked_file.mkdir()
    (linked_file / WEIGHTS_FILE).symlink_to(target)
    (store / "v00000003").symlink_to(target.parent, target_is_directory=True)
    for uri_path in (dotted, linked_file / WEIGHTS_FILE, store / "v00000003" / WEIGHTS_FILE):
        with pytest.raises(WeightsError, match="outside the weight store"):
            fetch_version(announced_as(record, uri_path), store)
    for uri in (f"file://otherhost{target}", store.resolve().as_uri()):
        with pytest.raises(WeightsError, match="names host|outside the weight store"):
            fetch_version(replace(record, uri=uri), store)
    assert fetch_version(record, store) == version_dir(store, 1)  # inside: fine
    assert fetch_version(record, f"{store}/../store") == version_dir(store, 1)


def test_a_missing_file_is_its_own_error(store_record):
    store, record = store_record
    (version_dir(store, 1) / WEIGHTS_FILE).unlink()
    with pytest.raises(MissingWeightsError, match="does not exist"):
        fetch_version(record, store)


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
