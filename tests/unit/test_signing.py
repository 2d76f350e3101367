"""Signed control records: the canonical bytes a signature covers, key files, and the
verification policy (a key configured: unsigned and foreign signatures refused)."""

from __future__ import annotations

import logging
import stat
from dataclasses import fields, replace

import msgpack
import pytest

from miles.errors import CodecError, ConfigError
from miles.protocol import WeightVersion, decode, encode, signed_message
from miles.protocol.codec import SIGNATURE_CONTEXT, SIGNED_FIELDS
from miles.weights.signing import (PRIVATE_KEY_FILE, Signer, Verifier, ensure_key_pair,
                                   generate_key_pair, trainer_signer)
from tests.factories import make_command, make_heartbeat, make_weight_version


@pytest.fixture
def keys(tmp_path):
    return generate_key_pair(tmp_path / "keys")


def test_every_field_but_the_signature_is_signed():
    for record_type, names in SIGNED_FIELDS.items():
        assert set(names) == {f.name for f in fields(record_type)} - {"signature"}


def test_the_signed_message_is_canonical_msgpack_of_the_decoded_fields():
    version = make_weight_version(created_at=12)  # an int where the table says float
    message = signed_message(version)
    assert message.startswith(SIGNATURE_CONTEXT)
    body = message[len(SIGNATURE_CONTEXT):]
    canonical = msgpack.unpackb(body)
    assert list(canonical) == sorted(canonical) and canonical["type"] == "weight_version"
    assert canonical["trainer_generation"] == 0 and canonical["created_at"] == 12.0
    assert body[body.index(b"\xaacreated_at") + 11] == 0xCB  # float64, whatever was sent
    # what a foreign client rebuilds from the record it decoded, by the doc's rule
    seen = decode(encode(version))
    rebuilt = {"type": "weight_version",
               **{n: getattr(seen, n) for n in SIGNED_FIELDS[WeightVersion]}}
    assert body == msgpack.packb(dict(sorted(rebuilt.items())), use_bin_type=True)
    beat = make_heartbeat(extra={"z": 1, "a": 0.5, "m": "x"})
    nested = msgpack.unpackb(signed_message(beat)[len(SIGNATURE_CONTEXT):])["extra"]
    assert list(nested) == ["a", "m", "z"]


def test_signed_records_round_trip_and_verify(keys):
    signer, verifier = Signer(keys[0]), Verifier(keys[1], who="producer")
    for record in (make_weight_version(), make_heartbeat(role="trainer"), make_command()):
        signed = signer.sign(record)
        assert len(signed.signature) == 64
        seen = decode(encode(signed))
        assert seen == signed and verifier.refusal(seen) is None


def test_another_key_an_unsigned_record_or_a_changed_field_is_refused(keys, tmp_path):
    verifier = Verifier(keys[1], who="producer")
    other = Signer(generate_key_pair(tmp_path / "other")[0])
    version = make_weight_version()
    assert "bad signature" in verifier.refusal(decode(encode(other.sign(version))))
    assert "unsigned" in verifier.refusal(version)
    signed = Signer(keys[0]).sign(version)
    for change in ({"policy_version": 2**31 - 1}, {"trainer_generation": 9},
                   {"uri": "file:///etc/passwd"}):
        assert "bad signature" in verifier.refusal(replace(signed, **change))
    beat = Signer(keys[0]).sign(make_heartbeat(role="trainer"))
    assert "bad signature" in verifier.refusal(replace(beat, trainer_generation=2**31 - 1))


def test_without_a_key_everything_is_accepted_and_said_once(caplog):
    with caplog.at_level(logging.WARNING):
        verifier = Verifier(None, who="producer")
    assert verifier.refusal(make_weight_version()) is None
    assert sum("NO PUBLIC KEY" in r.message for r in caplog.records) == 1


def test_the_signature_field_is_64_bytes_of_bin():
    version = make_weight_version()
    for bad, reason in ((b"x" * 63, "must be 64 bytes, got 63"), (b"x" * 65, "exceed the cap")):
        with pytest.raises(CodecError, match=reason):
            encode(replace(version, signature=bad))
    raw = msgpack.unpackb(encode(version))
    raw["signature"] = "a" * 64
    with pytest.raises(CodecError, match="signature: expected a bin"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_key_files(tmp_path, keys):
    private, public = keys
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="exists"):
        generate_key_pair(private.parent)
    assert ensure_key_pair(private.parent) == keys  # kept, not replaced
    with pytest.raises(ConfigError, match="weights.public_key: .* not an Ed25519"):
        Verifier(private, who="producer")
    with pytest.raises(ConfigError, match="weights.public_key: cannot read"):
        Verifier(tmp_path / "missing.pub", who="producer")
    with pytest.raises(ConfigError, match="loop.signing_key"):
        Signer(public)
    made = trainer_signer(tmp_path / "out", None)  # first start: a pair in out_dir/keys
    assert made.path == tmp_path / "out" / "keys" / PRIVATE_KEY_FILE
    assert trainer_signer(tmp_path / "out", None).path == made.path
    assert trainer_signer(tmp_path / "out", private).path == private


def test_only_control_records_are_signed():
    from tests.factories import make_group

    with pytest.raises(TypeError):
        signed_message(make_group())
