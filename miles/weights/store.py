"""A weight store on a file system that the trainer and every producer can read.

Layout: `<store>/v<policy_version:08d>/` holds one version, written by the trainer into a
temporary folder and renamed into place in one step, so a reader never sees half a version. For
LoRA the folder is peft's adapter format (`adapter_model.safetensors` + `adapter_config.json`);
for full weights it is a Hugging Face model folder with one `model.safetensors`. The announced URI
names the safetensors file, and its sha256 and size travel in the `WeightVersion`.

Only `file://` URIs for now: a shared file system (NFS, a mounted bucket) serves a cluster; an
object-store scheme is a new `fetch` branch, not a new record. A reader names the store it
trusts, and `fetch_version` refuses a URI that resolves (symlinks and `..` followed) outside it
before it opens any file: an announcement cannot make a producer read `/etc/passwd`.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from miles.errors import MissingWeightsError, WeightsError
from miles.protocol import WeightVersion

WEIGHTS_FILES = {"lora": "adapter_model.safetensors", "full": "model.safetensors"}
HASH_CHUNK_BYTES = 4 * 1024 * 1024


def base_model_id(model_dir: str | Path) -> str:
    """What `WeightVersion.base_model` names: the base checkpoint's folder name (resolved), so
    trainer and producers agree on it even where the file system mounts it elsewhere."""
    return Path(model_dir).resolve().name


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def version_dir(store: Path, policy_version: int) -> Path:
    return Path(store) / f"v{policy_version:08d}"


def write_version(store: Path, *, policy_version: int, step: int, base_model: str,
                  write: Callable[[Path], None], fmt: str = "lora",
                  trainer_generation: int = 0) -> WeightVersion:
    """Run `write(folder)` into a fresh folder, move it into place, describe it as a record."""
    if fmt not in WEIGHTS_FILES:
        raise WeightsError(f"weight format must be one of {sorted(WEIGHTS_FILES)}, got {fmt!r}")
    name = WEIGHTS_FILES[fmt]
    final = version_dir(store, policy_version)
    staging = final.with_name(final.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write(staging)
    if not (staging / name).is_file():
        raise WeightsError(f"writing version {policy_version} produced no {name}")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    path = final / name
    return WeightVersion(policy_version=policy_version, step=step, uri=path.resolve().as_uri(),
                         format=fmt, sha256=file_sha256(path), bytes=path.stat().st_size,
                         base_model=base_model, trainer_generation=trainer_generation,
                         created_at=time.time())


def prune_versions(store: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete versions of `store` (0 keeps everything);
    returns what was deleted. A producer still fetching a deleted version fails that load and
    keeps its weights until the next announcement."""
    if keep <= 0:
        return []
    versions = sorted(p for p in Path(store).glob("v*") if p.is_dir()
                      and not p.name.endswith(".tmp"))
    old = versions[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def discard_versions_after(store: Path, policy_version: int) -> list[Path]:
    """Delete the versions newer than `policy_version`: after a resume from an older checkpoint
    they belong to a lineage no trainer continues (the resumed one writes its own)."""
    newer = [p for p in _versions(store) if int(p.name[1:]) > policy_version]
    for path in newer:
        shutil.rmtree(path, ignore_errors=True)
    return newer


def _versions(store: Path) -> list[Path]:
    """The complete version folders of `store`, oldest first."""
    return sorted(p for p in Path(store).glob("v*") if p.is_dir() and p.name[1:].isdigit())


def fetch_version(version: WeightVersion, store: str | Path) -> Path:
    """The local folder of `version`, after checking that its file is inside `store` (resolved:
    symlinks and `..` followed) and of the announced size and sha256. A missing file raises
    `MissingWeightsError` (it may appear later), every other failure `WeightsError`."""
    path = _local_path(version, store)
    if not path.is_file():
        raise MissingWeightsError(f"version {version.policy_version}: {path} does not exist")
    size = path.stat().st_size
    if size != version.bytes:
        raise WeightsError(f"version {version.policy_version}: {path} has {size} bytes, "
                           f"announced {version.bytes} (truncated or replaced?)")
    digest = file_sha256(path)
    if digest != version.sha256:
        raise WeightsError(f"version {version.policy_version}: sha256 of {path} is {digest}, "
                           f"announced {version.sha256}")
    return path.parent


def _local_path(version: WeightVersion, store: str | Path) -> Path:
    """The resolved file `version.uri` names; `WeightsError` unless it is a local `file://`
    URI inside `store` (the check runs before any file is opened)."""
    parsed = urlparse(version.uri)
    if parsed.scheme != "file":
        raise WeightsError(f"version {version.policy_version}: only file:// URIs are supported, "
                           f"got {version.uri!r}")
    if parsed.netloc not in ("", "localhost"):
        raise WeightsError(f"version {version.policy_version}: {version.uri!r} names host "
                           f"{parsed.netloc!r}; only local files are read")
    root = Path(store).resolve()
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(root) or path == root:
        raise WeightsError(f"version {version.policy_version}: {version.uri!r} resolves to "
                           f"{path}, outside the weight store {root}")
    return path
