"""Kafka security settings: parsing from files/--set/environment, validation, and the secret
kept out of logs, reprs and error messages."""

from __future__ import annotations


import pytest

from consumers.recorder import RecorderSettings
from miles.trainer.replay import ReplaySettings
from miles.bus.security import KafkaSecurity, from_env
from miles.config import describe, load_config
from miles.errors import ConfigError

SECRET = "s3cr3t-pa55"


class Tokens:
    """An OAUTHBEARER token provider as a user would write one."""

    async def token(self) -> str:
        return "a-token"


def test_plaintext_by_default_and_from_an_empty_environment():
    assert from_env({}) == KafkaSecurity()
    assert KafkaSecurity().client_options() == {"security_protocol": "PLAINTEXT"}


def test_the_environment_configures_cli_commands_and_daemons_alike(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("a CA")  # any file: only its existence is checked here
    env = {"MILES_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "MILES_KAFKA__SASL_USERNAME": "alice",
           "MILES_KAFKA__SASL_MECHANISM": "SCRAM-SHA-256", "MILES_KAFKA__SSL_CAFILE": str(ca),
           "MILES_KAFKA_PASSWORD": SECRET}
    security = from_env(env)
    assert (security.security_protocol, security.sasl_username, security.sasl_mechanism,
            security.ssl_cafile) == ("SASL_SSL", "alice", "SCRAM-SHA-256", ca)
    assert load_config(RecorderSettings, env=env).kafka == security
    overridden = load_config(RecorderSettings, env=env, overrides=["kafka.sasl_username=bob"])
    assert overridden.kafka.sasl_username == "bob"
    assert load_config(ReplaySettings, env=env).kafka == security  # `miles replay`


def test_the_demo_gives_its_kafka_section_to_every_daemon_it_starts(tmp_path):
    from miles.demo import DemoConfig
    from miles.config import write_settings
    from miles.run_daemons import daemon_settings

    ca = tmp_path / "ca.pem"
    ca.write_text("a CA")
    kafka = KafkaSecurity(security_protocol="SASL_SSL", sasl_username="demo", ssl_cafile=ca)
    config = load_config(DemoConfig, overrides=["bus=kafka://127.0.0.1:9093", "run=r"],
                         env={"MILES_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                              "MILES_KAFKA__SASL_USERNAME": "demo",
                              "MILES_KAFKA__SSL_CAFILE": str(ca)})
    assert config.kafka == kafka
    for name, settings in daemon_settings(config, tmp_path).items():
        written = write_settings(settings, tmp_path / f"{name}.yaml")
        assert load_config(type(settings), path=written, env={}).kafka == kafka, name


def test_sasl_options_carry_the_password_from_the_variable_or_the_file(tmp_path):
    security = KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_username="alice")
    options = security.client_options({"MILES_KAFKA_PASSWORD": SECRET})
    assert options == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                       "sasl_plain_username": "alice", "sasl_plain_password": SECRET}
    other = KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_username="alice",
                          sasl_password_env="TEAM_KAFKA_PW")
    assert other.client_options({"TEAM_KAFKA_PW": "x"})["sasl_plain_password"] == "x"
    secret_file = tmp_path / "pw"
    secret_file.write_text(SECRET + "\n")
    from_file = KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_username="alice",
                              sasl_password_file=secret_file)
    assert from_file.client_options({})["sasl_plain_password"] == SECRET


def test_the_secret_never_reaches_the_logged_config_or_a_repr(tmp_path):
    secret_file = tmp_path / "pw"
    secret_file.write_text(SECRET)
    settings = load_config(RecorderSettings, overrides=[
        "kafka.security_protocol=SASL_PLAINTEXT", "kafka.sasl_username=alice",
        f"kafka.sasl_password_file={secret_file}"], env={"MILES_KAFKA_PASSWORD": SECRET})
    assert SECRET not in describe(settings) and SECRET not in repr(settings)
    assert "alice" in describe(settings)
    assert SECRET not in settings.kafka.describe()


def test_a_missing_password_names_where_it_was_looked_for():
    security = KafkaSecurity(security_protocol="SASL_SSL", sasl_username="alice")
    with pytest.raises(ConfigError, match="MILES_KAFKA_PASSWORD"):
        security.client_options({})


@pytest.mark.parametrize("changes, field", [
    ({"security_protocol": "SASL_SSL"}, "kafka.sasl_username"),
    ({"ssl_cafile": "/nowhere/ca.pem"}, "kafka.ssl_cafile"),
    ({"sasl_password_file": "/nowhere/pw"}, "kafka.sasl_password_file"),
    ({"ssl_certfile": "/nowhere/c.pem"}, "kafka.ssl_certfile and kafka.ssl_keyfile"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
     "kafka.sasl_oauth_token_provider"),
    ({"security_protocol": "TLS"}, "kafka.security_protocol"),
    ({"sasl_mechanism": "GSSAPI"}, "kafka.sasl_mechanism"),
])
def test_invalid_settings_fail_at_start_up_naming_the_field(changes, field):
    overrides = [f"kafka.{key}={value}" for key, value in changes.items()]
    with pytest.raises(ConfigError, match=field):
        load_config(RecorderSettings, overrides=overrides, env={})


def test_tls_options_check_the_host_name_unless_turned_off():
    assert KafkaSecurity(security_protocol="SSL").client_options()["ssl_context"].check_hostname
    relaxed = KafkaSecurity(security_protocol="SSL", ssl_check_hostname=False)
    assert not relaxed.client_options()["ssl_context"].check_hostname


def test_a_ca_file_that_is_not_pem_is_a_config_error(tmp_path):
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError, match="kafka.ssl_cafile"):
        KafkaSecurity(security_protocol="SSL", ssl_cafile=junk).client_options()


def test_oauthbearer_builds_the_named_token_provider():
    security = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER",
                             sasl_oauth_token_provider=f"{__name__}:Tokens")
    options = security.client_options()
    assert isinstance(options["sasl_oauth_token_provider"], Tokens)
    assert "sasl_plain_password" not in options
    broken = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER",
                           sasl_oauth_token_provider="no_such_module:Tokens")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        broken.client_options()
