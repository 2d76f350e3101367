"""The secured broker's TLS files (`miles.broker_security`, made once per data folder with the
JDK's keytool) for any generated store password: `secrets.token_urlsafe` may start one with
"-J", which keytool's launcher took from its command line as a JVM option (about 1 setup in
4,096 failed with "Could not find or load main class ...")."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from miles import broker_security

pytestmark = pytest.mark.skipif(shutil.which("keytool") is None, reason="needs the JDK's keytool")


@pytest.mark.parametrize("password", ["-JtfAsJRGhLlzxQoHzdlTfYf", "plain_Password-1"],
                         ids=["leading-dash-J", "plain"])
def test_tls_files_are_made_for_any_store_password(tmp_path, password):
    ca = broker_security._make_tls(tmp_path, password)
    assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
    listing = subprocess.run(["keytool", "-list", "-keystore", str(tmp_path / "broker.p12"),
                              "-storetype", "PKCS12", "-storepass:env", "PW"],
                             env={**os.environ, "PW": password}, capture_output=True, text=True,
                             check=True).stdout
    assert "broker," in listing and "ca," in listing  # the signed key and its CA, readable
