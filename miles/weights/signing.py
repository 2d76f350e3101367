"""Ed25519 signatures on the control records that move a follower's state.

The trainer signs every `WeightVersion` it announces and every `Heartbeat` it sends; whoever
holds its private key may sign a `Command`. Followers (producers, the evaluator) verify with the
public key before a record changes anything. The bytes signed are
`miles.protocol.signed_message` (docs/wire-format.md, "Signatures"); the policy is in
docs/control-plane.md.

Choices:
- Key files are PEM: the private key PKCS#8, unencrypted, written with mode 0600; the public key
  SubjectPublicKeyInfo. `miles keys generate DIR` writes a pair; a trainer without
  `loop.signing_key` uses (and on first start writes) `<out_dir>/keys/control.key`.
- A follower with no public key configured accepts unsigned records (a laptop demo, an older
  trainer) and says so once, loudly; with a key, unsigned or badly signed records are refused.
- `cryptography` is imported here only.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from miles.errors import ConfigError
from miles.protocol import WireRecord, signed_message

log = logging.getLogger(__name__)
PRIVATE_KEY_FILE = "control.key"
PUBLIC_KEY_FILE = "control.pub"
PRIVATE_KEY_MODE = 0o600


def generate_key_pair(folder: str | Path) -> tuple[Path, Path]:
    """Write a new key pair into `folder` (created); refuses to replace an existing one."""
    folder = Path(folder)
    private, public = folder / PRIVATE_KEY_FILE, folder / PUBLIC_KEY_FILE
    for path in (private, public):
        if path.exists():
            raise ConfigError(f"{path} exists; remove it to make a new key pair")
    folder.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_KEY_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def ensure_key_pair(folder: str | Path) -> tuple[Path, Path]:
    """The key pair in `folder`, written first if there is none (the trainer's default and the
    single-machine demo's)."""
    folder = Path(folder)
    private, public = folder / PRIVATE_KEY_FILE, folder / PUBLIC_KEY_FILE
    if private.exists() and public.exists():
        return private, public
    log.info("writing a new control-plane key pair to %s", folder)
    return generate_key_pair(folder)


def _read_key(path: Path, field: str, load):
    try:
        return load(Path(path).read_bytes())
    except OSError as err:
        raise ConfigError(f"{field}: cannot read {path}: {err}") from err
    except (ValueError, TypeError) as err:  # not PEM, or not the kind of key expected
        raise ConfigError(f"{field}: {path} is not an Ed25519 PEM key: {err}") from err


class Signer:
    """Signs control records with a private key."""

    def __init__(self, path: str | Path, field: str = "loop.signing_key"):
        key = _read_key(Path(path), field,
                        lambda data: serialization.load_pem_private_key(data, password=None))
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{field}: {path} is not an Ed25519 private key")
        self.path = Path(path)
        self._key = key

    def sign(self, record: WireRecord) -> WireRecord:
        """`record` with its `signature` set."""
        return replace(record, signature=self._key.sign(signed_message(record)))


def trainer_signer(out_dir: str | Path, configured: str | Path | None) -> Signer:
    """The trainer's signer: `configured` (`loop.signing_key`), else the key pair of
    `<out_dir>/keys`, written on first start."""
    if configured is not None:
        return Signer(configured)
    private, _ = ensure_key_pair(Path(out_dir) / "keys")
    return Signer(private)


class Verifier:
    """Checks control records against the trainer's public key, if one is configured."""

    def __init__(self, path: str | Path | None, *, who: str,
                 field: str = "weights.public_key"):
        self.path = None if path is None else Path(path)
        self._key = None
        if self.path is None:
            log.warning("%s: NO PUBLIC KEY CONFIGURED (%s): unsigned weight versions, trainer "
                        "heartbeats and commands are accepted, so anyone who can write to the "
                        "control and status topics can move this %s's weights and version",
                        who, field, who)
            return
        key = _read_key(self.path, field, serialization.load_pem_public_key)
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{field}: {self.path} is not an Ed25519 public key")
        self._key = key

    def refusal(self, record: WireRecord) -> str | None:
        """Why `record` must change nothing, or None when it may (always None without a key)."""
        if self._key is None:
            return None
        if record.signature is None:
            return f"unsigned; this follower only accepts records signed for {self.path}"
        try:
            self._key.verify(record.signature, signed_message(record))
        except InvalidSignature:
            return f"bad signature: not signed by the key of {self.path}"
        return None
