"""Message buses: one contract (`Bus`, `Consumer`), a Kafka and an in-process implementation.

`open_bus(url)` picks by address: `kafka://HOST:PORT` for Kafka, `embedded://` (or nothing) for
the in-process bus, `embedded://PATH` for one kept in the folder PATH. aiokafka is imported only when a Kafka bus is asked for.
"""

from miles.bus.base import Bus, Consumer, Delivery, Record, TopicInfo, TopicPartition
from miles.bus.embedded import EmbeddedBus
from miles.bus.security import KafkaSecurity, from_env
from miles.errors import BusError

__all__ = ["Bus", "Consumer", "Delivery", "EmbeddedBus", "Record", "TopicInfo",
           "KafkaSecurity", "TopicPartition", "open_bus"]


def open_bus(url: str | None = None, security: KafkaSecurity | None = None) -> Bus:
    """A not-yet-started bus for `url`; use `async with open_bus(url) as bus:`. A Kafka bus
    authenticates with `security`, or else with the `MILES_KAFKA__*` variables (PLAINTEXT when
    none is set)."""
    if url is None or url in ("", "embedded", "embedded://"):
        return EmbeddedBus()
    if url.startswith("embedded://"):
        return EmbeddedBus(url.removeprefix("embedded://"))
    if url.startswith("kafka://"):
        from miles.bus.kafka import KafkaBus

        return KafkaBus(url, security=security if security is not None else from_env())
    raise BusError(f"bus address must be kafka://HOST:PORT, embedded:// or embedded://PATH, "
                   f"got {url!r}")
