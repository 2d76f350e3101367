"""A Kafka client that is not Miles, for tests of what foreign writers can put on a topic."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from miles.protocol.topics import PRODUCER_MAX_REQUEST_BYTES


class RawProducer:
    """A client that is not Miles: writes whatever bytes (or None) it is given."""

    def __init__(self, bootstrap: str):
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all",
                                         max_request_size=PRODUCER_MAX_REQUEST_BYTES)

    async def __aenter__(self) -> RawProducer:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.producer.stop()

    async def send(self, topic: str, value: bytes | None, partition: int = 0) -> int:
        """Offset of `value` sent to `topic`; None sends a tombstone (which needs a key)."""
        sent = await self.producer.send_and_wait(topic, value, key=b"k", partition=partition)
        return sent.offset
