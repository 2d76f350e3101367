"""The secured local broker (`miles broker start --secure`): TLS files, SCRAM users, settings.

Clients connect to one SASL_SSL listener (SCRAM-SHA-512 or SCRAM-SHA-256 over TLS). The
certificates come from the JDK's `keytool`, PKCS12, made once in `<data dir>/tls/`: a CA
(`ca.pem` is what clients trust), the broker's key pair signed by it for `localhost` and
`127.0.0.1`, and a truststore. The KRaft controller and the inter-broker listener stay on
127.0.0.1 with SASL_PLAINTEXT and PLAIN for the super user `admin` (KRaft cannot check SCRAM on
the controller listener: the credentials live in the metadata it serves), so no port accepts an
unauthenticated principal.

SCRAM users (`admin` and one per built-in role: `trainer`, `producer`, `feeder`, `reader`) are
written into the log when it is formatted (`kafka-storage format --add-scram`), so they exist
before the broker first serves. Authorization: the StandardAuthorizer, no access without an ACL
(`allow.everyone.if.no.acl.found=false`), `admin` the only super user; `miles.acls` holds the
ACLs per role. Passwords are random, made once, and kept with the CA path in `security.json`
(mode 600) in the data directory, which is what a user or a test reads to connect.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from miles.acls import Acl, role_acls
from miles.bus.security import KafkaSecurity
from miles.errors import BrokerError

ADMIN_USER = "admin"
ROLE_USERS = ("trainer", "producer", "feeder", "reader")  # user name = role name
SCRAM_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256")
KEY_BITS = 2048
CERT_DAYS = 3650
KEYTOOL_TIMEOUT_S = 60.0
STORE_PASSWORD_ENV = "MILES_KEYSTORE_PASSWORD"  # keytool reads the store password from it
SECURITY_FILE = "security.json"
PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"


@dataclass(frozen=True, kw_only=True)
class SecureSetup:
    """What `security.json` records: how to reach and authenticate to the secured broker."""

    bootstrap: str
    ca_file: str
    passwords: dict[str, str]  # user -> password
    store_password: str  # of the broker's PKCS12 keystore and truststore
    internal_port: int

    def users(self) -> list[str]:
        return sorted(self.passwords)


def setup_path(data_dir: Path) -> Path:
    return Path(data_dir) / SECURITY_FILE


def read_setup(data_dir: Path) -> SecureSetup | None:
    try:
        return SecureSetup(**json.loads(setup_path(data_dir).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def prepare(data_dir: Path, port: int, internal_port: int) -> SecureSetup:
    """The setup of `data_dir`, made on first use (passwords, TLS files), kept afterwards."""
    existing = read_setup(data_dir)
    if existing is not None:
        setup = SecureSetup(**{**asdict(existing), "bootstrap": f"127.0.0.1:{port}",
                               "internal_port": internal_port})
    else:
        if (Path(data_dir) / "kafka-logs" / "meta.properties").exists():
            raise BrokerError(f"{data_dir} holds a broker formatted without --secure; use "
                              "another --data-dir for the secured broker")
        store_password = secrets.token_urlsafe(18)
        ca_file = _make_tls(Path(data_dir) / "tls", store_password)
        setup = SecureSetup(
            bootstrap=f"127.0.0.1:{port}", ca_file=str(ca_file), store_password=store_password,
            passwords={user: secrets.token_urlsafe(18) for user in (ADMIN_USER, *ROLE_USERS)},
            internal_port=internal_port)
    _write_secret(setup_path(data_dir), json.dumps(asdict(setup), indent=2))
    for user, password in setup.passwords.items():
        _write_secret(password_file(data_dir, user), password + "\n")
    return setup


def password_file(data_dir: Path, user: str) -> Path:
    """`<data dir>/passwords/<user>`: what `kafka.sasl_password_file` can point at."""
    return Path(data_dir) / "passwords" / user


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)


def client_security(data_dir: Path, user: str = ADMIN_USER,
                    mechanism: str = "SCRAM-SHA-512") -> KafkaSecurity:
    """The client settings of `user` for the secured broker of `data_dir`."""
    setup = read_setup(data_dir)
    if setup is None:
        raise BrokerError(f"{data_dir} holds no secured broker ({SECURITY_FILE} is missing)")
    if user not in setup.passwords:
        raise BrokerError(f"the secured broker has no user {user!r}; users: "
                          f"{', '.join(setup.users())}")
    return KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism=mechanism,
                         sasl_username=user, sasl_password_file=password_file(data_dir, user),
                         ssl_cafile=Path(setup.ca_file))



def _keytool(password: str, *args: str) -> None:
    """keytool on a PKCS12 store whose password it reads from its environment
    (`-storepass:env`): on the command line, a generated password starting "-J" was taken by
    keytool's launcher for a JVM option, and any process could read it there."""
    store = ["-storetype", "PKCS12", "-storepass:env", STORE_PASSWORD_ENV]
    try:
        result = subprocess.run(["keytool", *args, *store], capture_output=True, text=True,
                                env={**os.environ, STORE_PASSWORD_ENV: password},
                                timeout=KEYTOOL_TIMEOUT_S)
    except FileNotFoundError:
        raise BrokerError("the JDK's `keytool` is needed for --secure (it ships with Java; "
                          "apt-get install openjdk-17-jre-headless)") from None
    if result.returncode != 0:
        raise BrokerError(f"keytool {args[0]} failed:\n{result.stdout}{result.stderr}")


def _make_tls(tls_dir: Path, password: str) -> Path:
    """A CA, the broker's PKCS12 keystore signed by it, a truststore; returns the CA's PEM."""
    tls_dir.mkdir(parents=True, exist_ok=True)
    ca, broker = str(tls_dir / "ca.p12"), str(tls_dir / "broker.p12")
    ca_pem, csr, signed = (str(tls_dir / name) for name in ("ca.pem", "broker.csr", "broker.pem"))
    names = "SAN=dns:localhost,ip:127.0.0.1"
    key = ["-keyalg", "RSA", "-keysize", str(KEY_BITS), "-validity", str(CERT_DAYS)]
    _keytool(password, "-genkeypair", "-alias", "ca", "-dname", "CN=Miles local CA",
             "-ext", "bc:c", *key, "-keystore", ca)
    _keytool(password, "-exportcert", "-rfc", "-alias", "ca", "-file", ca_pem, "-keystore", ca)
    _keytool(password, "-genkeypair", "-alias", "broker", "-dname", "CN=localhost",
             "-ext", names, *key, "-keystore", broker)
    _keytool(password, "-certreq", "-alias", "broker", "-file", csr, "-keystore", broker)
    _keytool(password, "-gencert", "-alias", "ca", "-rfc", "-ext", names,
             "-validity", str(CERT_DAYS), "-infile", csr, "-outfile", signed, "-keystore", ca)
    _keytool(password, "-importcert", "-noprompt", "-alias", "ca", "-file", ca_pem,
             "-keystore", broker)
    _keytool(password, "-importcert", "-noprompt", "-alias", "broker", "-file", signed,
             "-keystore", broker)
    _keytool(password, "-importcert", "-noprompt", "-alias", "ca", "-file", ca_pem,
             "-keystore", str(tls_dir / "truststore.p12"))
    for secret_file in tls_dir.glob("*.p12"):
        secret_file.chmod(0o600)
    return tls_dir / "ca.pem"


def secure_settings(setup: SecureSetup, data_dir: Path, port: int,
                    controller_port: int) -> dict[str, str]:
    """`server.properties` keys that replace or add to the plaintext broker's."""
    admin = setup.passwords[ADMIN_USER]
    plain = (f'{PLAIN_LOGIN} required username="{ADMIN_USER}" password="{admin}" '
             f'user_{ADMIN_USER}="{admin}";')
    tls = Path(data_dir) / "tls"
    settings = {
        "listeners": f"SASL_SSL://127.0.0.1:{port},INTERNAL://127.0.0.1:{setup.internal_port},"
                     f"CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"SASL_SSL://127.0.0.1:{port},"
                                f"INTERNAL://127.0.0.1:{setup.internal_port}",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,INTERNAL:SASL_PLAINTEXT,"
                                          "CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name": "INTERNAL",
        "sasl.mechanism.inter.broker.protocol": "PLAIN",
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": plain,
        "listener.name.internal.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.internal.plain.sasl.jaas.config": plain,
        "listener.name.sasl_ssl.sasl.enabled.mechanisms": ",".join(SCRAM_MECHANISMS),
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(tls / "broker.p12"),
        "ssl.keystore.password": setup.store_password,
        "ssl.key.password": setup.store_password,
        "ssl.truststore.type": "PKCS12",
        "ssl.truststore.location": str(tls / "truststore.p12"),
        "ssl.truststore.password": setup.store_password,
        "ssl.client.auth": "none",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN_USER}",
    }
    for mechanism in SCRAM_MECHANISMS:
        settings[f"listener.name.sasl_ssl.{mechanism.lower()}.sasl.jaas.config"] = \
            f"{SCRAM_LOGIN} required;"
    return settings


def scram_format_args(setup: SecureSetup) -> list[str]:
    """`kafka-storage format` arguments that create every user for both SCRAM mechanisms."""
    args = []
    for user, password in sorted(setup.passwords.items()):
        for mechanism in SCRAM_MECHANISMS:
            args += ["--add-scram", f"{mechanism}=[name={user},password={password}]"]
    return args


def connect_hint(data_dir: Path, user: str = "trainer") -> str:
    """How to reach the broker as `user` (printed by `miles broker start --secure`)."""
    setup = read_setup(data_dir)
    return "\n".join([
        f"secured broker at kafka://{setup.bootstrap} (SASL_SSL, SCRAM-SHA-512/256); users "
        f"{', '.join(setup.users())}; their passwords in {password_file(data_dir, '')}; "
        f"connect as {user}:",
        "export MILES_KAFKA__SECURITY_PROTOCOL=SASL_SSL",
        f"export MILES_KAFKA__SASL_USERNAME={user}",
        f"export MILES_KAFKA__SASL_PASSWORD_FILE={password_file(data_dir, user)}",
        f"export MILES_KAFKA__SSL_CAFILE={setup.ca_file}",
    ])


def grant(data_dir: Path, acls: list[Acl]) -> int:
    """Create `acls` on the running secured broker of `data_dir`, as its admin."""
    import asyncio

    from miles.bus.kafka import KafkaBus

    setup = read_setup(data_dir)
    if setup is None:
        raise BrokerError(f"{data_dir} holds no secured broker ({SECURITY_FILE} is missing)")

    async def create() -> int:
        async with KafkaBus(setup.bootstrap, security=client_security(data_dir)) as bus:
            return await bus.create_acls(acls)

    return asyncio.run(create())


def grant_builtin_roles(data_dir: Path, run: str) -> int:
    """Each built-in user (`trainer`, `producer`, `feeder`, `reader`) gets its role for `run`."""
    return grant(data_dir, [acl for role in ROLE_USERS for acl in role_acls(role, role, run)])
