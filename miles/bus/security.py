"""How Miles authenticates to a Kafka cluster: TLS and SASL settings, and where the secret lives.

`KafkaSecurity` is the `kafka` section of every daemon's settings (file, `--set kafka.x=y`, or
`MILES_KAFKA__X`), and what the `miles` sub-commands read from the same `MILES_KAFKA__*`
variables (`from_env`), so one set of variables configures every process of a run.

The password is never a config value: it is read, when a client is built, from the variable
that `sasl_password_env` names (`MILES_KAFKA_PASSWORD` by default) or from `sasl_password_file`.
So it never reaches a config file, `log_config`, a repr or an error message. TLS files are
checked at start-up; the hostname check is on unless turned off. OAUTHBEARER takes a token
provider (an object with `async token()`, aiokafka's `AbstractTokenProvider`) built by calling
the `package.module:name` that `sasl_oauth_token_provider` names.

No aiokafka here: `client_options()` returns the keyword arguments `miles.bus.kafka` passes to
every client it creates (producer, consumers, admin, offsets reader, probe).
"""

from __future__ import annotations

import importlib
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from miles.errors import ConfigError

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER")
DEFAULT_PASSWORD_ENV = "MILES_KAFKA_PASSWORD"


@dataclass(frozen=True, kw_only=True)
class KafkaSecurity:
    """TLS and SASL settings of every Kafka client a process creates."""

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN",
                            "OAUTHBEARER"] = "SCRAM-SHA-512"  # used with SASL_* only
    sasl_username: str = ""  # SCRAM and PLAIN
    sasl_password_env: str = DEFAULT_PASSWORD_ENV  # the variable that holds the password
    sasl_password_file: Path | None = None  # or a file holding it (wins over the variable)
    sasl_oauth_token_provider: str = ""  # OAUTHBEARER: package.module:name, called with no args
    ssl_cafile: Path | None = None  # CA bundle (PEM) the broker's certificate must chain to; None: system CAs
    ssl_certfile: Path | None = None  # client certificate (PEM) for mutual TLS
    ssl_keyfile: Path | None = None  # its private key (PEM, unencrypted)
    ssl_check_hostname: bool = True  # the broker's certificate must name the host dialled

    def __post_init__(self) -> None:
        if self.sasl and self.sasl_mechanism != "OAUTHBEARER" and not self.sasl_username:
            raise ConfigError(f"kafka.sasl_username is needed for {self.security_protocol} with "
                              f"{self.sasl_mechanism}")
        if self.sasl and self.sasl_mechanism == "OAUTHBEARER" \
                and ":" not in self.sasl_oauth_token_provider:
            raise ConfigError("kafka.sasl_oauth_token_provider must be package.module:name for "
                              f"OAUTHBEARER, got {self.sasl_oauth_token_provider!r}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("kafka.ssl_certfile and kafka.ssl_keyfile go together (mutual TLS)")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "sasl_password_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"kafka.{name}: {path} does not exist or is not a file")

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def describe(self) -> str:
        """One line for messages: protocol, mechanism and user; never the secret."""
        parts = [self.security_protocol]
        if self.sasl:
            parts.append(self.sasl_mechanism)
            if self.sasl_username:
                parts.append(f"user {self.sasl_username!r}")
        if self.tls:
            parts.append(f"CA {self.ssl_cafile or 'system default'}")
        return ", ".join(parts)

    def password_source(self) -> str:
        """Where the password is read from (for messages)."""
        if self.sasl_password_file is not None:
            return f"kafka.sasl_password_file {self.sasl_password_file}"
        return f"the variable {self.sasl_password_env} (kafka.sasl_password_env)"

    def password(self, env: Mapping[str, str] | None = None) -> str:
        """The SASL password from `sasl_password_file` or the `sasl_password_env` variable."""
        if self.sasl_password_file is not None:
            try:
                secret = Path(self.sasl_password_file).read_text().strip()
            except OSError as err:
                raise ConfigError(f"kafka.sasl_password_file: cannot read "
                                  f"{self.sasl_password_file}: {err.strerror}") from None
        else:
            secret = (os.environ if env is None else env).get(self.sasl_password_env, "")
        if not secret:
            raise ConfigError(f"no SASL password for user {self.sasl_username!r}: "
                              f"{self.password_source()} is empty or unset")
        return secret

    def client_options(self, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """aiokafka's security keyword arguments (the same for every client kind)."""
        options: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.tls:
            options["ssl_context"] = self.ssl_context()
        if self.sasl:
            options["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_mechanism == "OAUTHBEARER":
                options["sasl_oauth_token_provider"] = self._token_provider()
            else:
                options["sasl_plain_username"] = self.sasl_username
                options["sasl_plain_password"] = self.password(env)
        return options

    def ssl_context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(
                cafile=str(self.ssl_cafile) if self.ssl_cafile else None)
        except ssl.SSLError as err:
            raise ConfigError(f"kafka.ssl_cafile {self.ssl_cafile} is not a PEM CA bundle: "
                              f"{err.reason or err}") from None
        context.check_hostname = self.ssl_check_hostname
        if self.ssl_certfile is not None:
            try:
                context.load_cert_chain(str(self.ssl_certfile), str(self.ssl_keyfile))
            except ssl.SSLError as err:
                raise ConfigError(f"kafka.ssl_certfile/ssl_keyfile cannot be loaded: "
                                  f"{err.reason or err}") from None
        return context

    def _token_provider(self) -> Any:
        module_name, _, attr = self.sasl_oauth_token_provider.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"kafka.sasl_oauth_token_provider "
                              f"{self.sasl_oauth_token_provider!r} cannot be loaded: {err}") from err
        provider = factory()
        if not callable(getattr(provider, "token", None)):
            raise ConfigError(f"kafka.sasl_oauth_token_provider {self.sasl_oauth_token_provider!r}"
                              " must build an object with an async token() method")
        return provider


@dataclass(frozen=True, kw_only=True)
class _KafkaSection:
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)


def from_env(env: Mapping[str, str] | None = None) -> KafkaSecurity:
    """The `MILES_KAFKA__*` variables (e.g. `MILES_KAFKA__SECURITY_PROTOCOL=SASL_SSL`), the
    same names a daemon's `kafka` section reads; PLAINTEXT when none is set."""
    from miles.config import load_config

    return load_config(_KafkaSection, env=os.environ if env is None else env).kafka
