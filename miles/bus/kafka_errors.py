"""aiokafka's exceptions as Miles errors (part of the Kafka adapter, like kafka.py).

`wrapped` turns every aiokafka exception into `BusError`; an ACL denial (topic, group, cluster)
into `AuthorizationError` naming the user and what to check. `retrying` is how a client starts:
it waits up to `START_TIMEOUT_S` for a broker that is not reachable yet, but a refused identity
or a denied ACL fails at once, since waiting cannot fix it.

aiokafka hides why it could not bootstrap (it logs each broker's error and raises "Unable to
bootstrap"), so a failed start is diagnosed with one direct connection that raises the real
cause: a SASL failure or a TLS verification error becomes `AuthenticationError`; anything else
(a refused or closed connection) is taken for a broker that is not up yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable

from aiokafka.conn import create_conn
from aiokafka.errors import (AuthenticationFailedError, AuthenticationMethodNotSupported,
                             ClusterAuthorizationFailedError, GroupAuthorizationFailedError,
                             IllegalSaslStateError, KafkaError, SaslAuthenticationFailed,
                             TopicAuthorizationFailedError, TransactionalIdAuthorizationFailed,
                             UnsupportedSaslMechanismError)

from miles.bus.security import KafkaSecurity
from miles.errors import AuthenticationError, AuthorizationError, BusError

log = logging.getLogger("miles.bus.kafka")
START_TIMEOUT_S = 30.0  # how long starting a client waits for an unreachable broker
START_RETRY_S = 1.0
DIAGNOSE_TIMEOUT_S = 10.0
DENIED = {TopicAuthorizationFailedError: "topic", GroupAuthorizationFailedError: "group",
          ClusterAuthorizationFailedError: "cluster",
          TransactionalIdAuthorizationFailed: "transactional id"}
DENIED_CODES = {29: "topic", 30: "group", 31: "cluster"}
REFUSED = (SaslAuthenticationFailed, AuthenticationFailedError, UnsupportedSaslMechanismError,
           IllegalSaslStateError, AuthenticationMethodNotSupported)
ACL_HINT = ("ask the cluster's admin for this role's ACLs (docs/security.md; `miles broker acls` "
            "on the local secured broker)")


def who(security: KafkaSecurity) -> str:
    if security.sasl and security.sasl_username:
        return f"user {security.sasl_username!r}"
    return f"this client ({security.security_protocol})"


def denied(action: str, kind: str, name: str, security: KafkaSecurity) -> AuthorizationError:
    return AuthorizationError(f"{action}: Kafka denied {who(security)} access to {kind} "
                              f"{name}; {ACL_HINT}")


@contextlib.contextmanager
def wrapped(action: str, security: KafkaSecurity | None = None):
    """aiokafka's exceptions as `BusError`, ACL denials as `AuthorizationError`."""
    try:
        yield
    except tuple(DENIED) as err:
        kind = next(k for cls, k in DENIED.items() if isinstance(err, cls))
        raise denied(action, kind, str(err.args[0] if err.args else "?"),
                     security or KafkaSecurity()) from err
    except KafkaError as err:
        raise BusError(f"{action} failed: {type(err).__name__}: {err}") from err


def check_codes(action: str, entries: list[tuple[str, int]], security: KafkaSecurity) -> None:
    """Raise `AuthorizationError` for the first (name, error code) that is an ACL denial."""
    for name, code in entries:
        if code in DENIED_CODES:
            raise denied(action, DENIED_CODES[code], name, security)


async def diagnose(bootstrap: str, security: KafkaSecurity,
                   options: dict) -> AuthenticationError | None:
    """Why a client could not bootstrap, if it is its identity or TLS (else None)."""
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    conn = None
    try:
        conn = await asyncio.wait_for(create_conn(host, int(port), **options,
                                                  request_timeout_ms=int(DIAGNOSE_TIMEOUT_S * 1000)),
                                      DIAGNOSE_TIMEOUT_S)
    except REFUSED as err:
        return AuthenticationError(
            f"Kafka at {bootstrap} refused {who(security)} ({security.sasl_mechanism}): "
            f"{type(err).__name__}: {err}. Check the password ({security.password_source()}) "
            f"and that the user exists for {security.sasl_mechanism} on the cluster")
    except ssl.SSLCertVerificationError as err:
        return AuthenticationError(
            f"TLS with Kafka at {bootstrap} failed: {err.verify_message}. Check kafka.ssl_cafile "
            f"(now {security.ssl_cafile or 'the system CAs'}): it must hold the CA that signed "
            "the broker's certificate, and the certificate must name the host dialled "
            "(kafka.ssl_check_hostname)")
    except ssl.SSLError as err:
        return AuthenticationError(
            f"TLS with Kafka at {bootstrap} failed: {err.reason or err}. Check that the "
            f"listener speaks {security.security_protocol} (kafka.security_protocol)")
    except (KafkaError, OSError, TimeoutError):
        return None
    finally:
        if conn is not None:
            conn.close()
    return None


async def retrying(action: str, connect: Callable[[], Awaitable[None]],
                   why: Callable[[], Awaitable[BusError | None]], security: KafkaSecurity,
                   timeout_s: float | None = None) -> None:
    """`connect()` until it succeeds or `START_TIMEOUT_S` pass: a daemon that starts while the
    broker restarts waits for it (one log line) instead of dying. A refused identity or a
    denied ACL fails at once (`why()` diagnoses a failed bootstrap); BusError after the wait."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (START_TIMEOUT_S if timeout_s is None else timeout_s)
    warned = False
    while True:
        try:
            with wrapped(action, security):
                await connect()
            return
        except (AuthorizationError, AuthenticationError):
            raise
        except BusError as err:
            out_of_time = loop.time() >= deadline
            if not warned or out_of_time:
                cause = await why()
                if cause is not None:
                    raise cause from err
            if out_of_time:
                raise BusError(f"{err} (security: {security.describe()}; check that the "
                               "listener speaks it, kafka.security_protocol)") from err
            if not warned:
                log.warning("%s: not reachable yet, retrying for up to %.0f s (%s)", action,
                            deadline - loop.time(), err)
                warned = True
        await asyncio.sleep(START_RETRY_S)
