"""The Kafka bus: with its helpers `kafka_consumer`, `kafka_errors` and `kafka_acls`, the only
code that imports aiokafka.

Producer: idempotent, `acks=all`, zstd, a 5 ms linger and 4 MiB batches (the Python client, not
the broker, limits throughput, so records are batched hard). Consumers (`kafka_consumer`):
manual commits only, earliest reset by default, fetch sizes from `miles.protocol.topics` so no
record the topic accepts can stall them. Every aiokafka exception is wrapped in `BusError` here;
a commit refused because the group's membership changed raises its subclass
`CommitFailedError`, an ACL denial `AuthorizationError`, a refused password or failed TLS
handshake `AuthenticationError` (`kafka_errors`). Starting the bus or a consumer waits up to
`START_TIMEOUT_S` for a broker that is not reachable yet (a daemon started during a broker
restart), with one log line, before it fails; a refused identity or a denied ACL fails at once.
Each attempt builds fresh clients (one whose start failed cannot start again) and closes them
when it fails, so a refused start leaves no client unclosed. Every client (producer,
consumers, admin, offsets reader, probe) gets the same TLS/SASL options (`miles.bus.security`).

aiokafka's admin client does not raise per-topic errors from CreateTopics; they are read from the
response and reported (an existing topic is not an error).

Offsets for monitoring: a topic's first and end offsets come from one group-less consumer the bus
starts on first use (the admin client has no ListOffsets); committed offsets come from the admin
client, one OffsetFetch per consumer group the cluster lists (as `kafka-consumer-groups` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka import TopicPartition as KafkaTopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError

from miles.acls import Acl
from miles.bus import reconnects
from miles.bus.kafka_errors import check_codes, denied, diagnose, retrying
from miles.bus.kafka_errors import wrapped as _wrapped
from miles.bus.security import KafkaSecurity
from miles.bus.base import (Bus, Delivery, Headers, RebalanceCallback, TopicInfo, TopicPartition,
                            check_record_size)
from miles.errors import BusError
from miles.protocol.topics import PRODUCER_MAX_REQUEST_BYTES, TopicSpec

if TYPE_CHECKING:
    from miles.bus.kafka_consumer import KafkaConsumer

COMPRESSION = "zstd"
LINGER_MS = 5
MAX_BATCH_BYTES = 4 * 1024 * 1024  # one request in flight per broker: fewer, bigger batches
REQUEST_TIMEOUT_MS = 40_000
TOPIC_LOOKUP_TIMEOUT_S = 15.0
TOPIC_ALREADY_EXISTS = 36
log = logging.getLogger(__name__)


def parse_bootstrap(url: str) -> str:
    """`kafka://host:port[,host:port]` (or a bare `host:port`) -> aiokafka's bootstrap string."""
    address = url.removeprefix("kafka://").strip("/")
    if not address or any(":" not in part for part in address.split(",")):
        raise BusError(f"Kafka address must look like kafka://HOST:PORT, got {url!r}")
    return address


def probe_cluster(bootstrap: str, timeout_s: float = 5.0,
                  security: KafkaSecurity | None = None) -> bool:
    """True when a broker at `bootstrap` answers a metadata request (blocking; no loop needed)."""
    options = (security or KafkaSecurity()).client_options()

    async def probe() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap,
                                    request_timeout_ms=int(timeout_s * 1000), **options)
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            await asyncio.wait_for(admin.describe_cluster(), timeout_s)
            return True
        except (KafkaError, OSError, TimeoutError):
            return False
        finally:
            await admin.close()

    return asyncio.run(probe())


class KafkaBus(Bus):
    def __init__(self, url: str, *, client_id: str = "miles",
                 security: KafkaSecurity | None = None):
        self.url = url if url.startswith("kafka://") else f"kafka://{url}"
        self.bootstrap = parse_bootstrap(url)
        self.client_id = client_id
        self.security = security or KafkaSecurity()
        self.options = self.security.client_options()  # fails here, at start-up, not later
        reconnects.install()
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._offsets_reader: AIOKafkaConsumer | None = None
        self._known_topics: set[str] = set()

    async def start(self) -> None:
        await retrying(f"connecting to Kafka at {self.bootstrap}", self._connect,
                       self.diagnose, self.security)

    async def diagnose(self) -> BusError | None:
        """Why clients cannot connect, when it is their identity or TLS (else None)."""
        return await diagnose(self.bootstrap, self.security, self.options)

    async def _connect(self) -> None:
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, client_id=self.client_id,
            enable_idempotence=True, acks="all", compression_type=COMPRESSION,
            linger_ms=LINGER_MS, max_batch_size=MAX_BATCH_BYTES,
            max_request_size=PRODUCER_MAX_REQUEST_BYTES, request_timeout_ms=REQUEST_TIMEOUT_MS,
            **self.options)
        self._admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap,
                                          client_id=f"{self.client_id}-admin",
                                          request_timeout_ms=REQUEST_TIMEOUT_MS, **self.options)
        try:
            await self._producer.start()
            await self._admin.start()
        except BaseException:
            with contextlib.suppress(BusError):  # a failed start closes what it made
                await self.close()
            raise

    async def close(self) -> None:
        if self._producer is not None:
            with _wrapped("closing the producer", self.security):
                await self._producer.stop()
            self._producer = None
        if self._admin is not None:
            await self._admin.close()
            self._admin = None
        if self._offsets_reader is not None:
            with _wrapped("closing the offsets reader", self.security):
                await self._offsets_reader.stop()
            self._offsets_reader = None

    def _require(self, client: Any) -> Any:
        if client is None:
            raise BusError("Kafka bus is not started (or already closed)")
        return client

    async def create_topics(self, specs: Iterable[TopicSpec]) -> list[str]:
        specs = list(specs)
        admin = self._require(self._admin)
        new_topics = [NewTopic(s.name, s.partitions, 1, topic_configs=dict(s.configs))
                      for s in specs]
        with _wrapped("creating topics", self.security):
            response = await admin.create_topics(new_topics)
        created, failures = [], []
        entries = response.to_object()["topic_errors"]
        check_codes("creating topics", [(e["topic"], e["error_code"]) for e in entries],
                    self.security)
        for entry in entries:
            code = entry["error_code"]
            if code == 0:
                created.append(entry["topic"])
            elif code != TOPIC_ALREADY_EXISTS:
                failures.append(f"{entry['topic']}: error {code} {entry.get('error_message')}")
        if failures:
            raise BusError("creating topics failed: " + "; ".join(failures))
        return created

    async def _partition_counts(self, names: list[str]) -> dict[str, int]:
        with _wrapped("describing topics", self.security):
            metadata = await self._require(self._admin).describe_topics(names)
        check_codes("describing topics", [(t["topic"], t["error_code"]) for t in metadata],
                    self.security)
        missing = [t["topic"] for t in metadata if t["error_code"] != 0]
        if missing:
            raise BusError(f"topics do not exist: {', '.join(missing)}")
        return {t["topic"]: len(t["partitions"]) for t in metadata}

    async def _partitions(self, names: Iterable[str]) -> list[KafkaTopicPartition]:
        counts = await self._partition_counts(list(names))
        return [KafkaTopicPartition(name, p) for name, count in counts.items()
                for p in range(count)]

    async def describe_topics(self, names: Iterable[str]) -> dict[str, TopicInfo]:
        names = list(names)
        partitions = await self._partition_counts(names)
        with _wrapped("describing topics", self.security):
            configs = await self._require(self._admin).describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name) for name in names])
        result = {}
        for response in configs:
            for resource in response.to_object()["resources"]:
                name = resource["resource_name"]
                entries = {e["config_names"]: e["config_value"]
                           for e in resource["config_entries"]}
                result[name] = TopicInfo(name=name, partitions=partitions[name], configs=entries)
        return result

    async def topic_offsets(self, topics: Iterable[str]
                            ) -> dict[TopicPartition, tuple[int, int]]:
        tps = await self._partitions(topics)
        reader = await self._offsets()
        with _wrapped("reading topic offsets", self.security):
            first = await reader.beginning_offsets(tps)
            end = await reader.end_offsets(tps)
        return {TopicPartition(tp.topic, tp.partition): (first[tp], end[tp]) for tp in tps}

    async def _offsets(self) -> AIOKafkaConsumer:
        """The group-less consumer that looks up first and end offsets, started on first use."""
        self._require(self._admin)
        if self._offsets_reader is None:
            reader = AIOKafkaConsumer(bootstrap_servers=self.bootstrap,
                                      client_id=f"{self.client_id}-offsets", group_id=None,
                                      enable_auto_commit=False,
                                      request_timeout_ms=REQUEST_TIMEOUT_MS, **self.options)
            try:
                with _wrapped("starting the offsets reader", self.security):
                    await reader.start()
            except BaseException:
                with contextlib.suppress(KafkaError):
                    await reader.stop()
                raise
            self._offsets_reader = reader
        return self._offsets_reader

    async def group_offsets(self, topics: Iterable[str]
                            ) -> dict[str, dict[TopicPartition, int]]:
        tps = await self._partitions(topics)
        if not tps:
            return {}
        admin = self._require(self._admin)
        with _wrapped("reading consumer group offsets", self.security):
            groups = sorted(group[0] for group in await admin.list_consumer_groups())
            fetched = await asyncio.gather(*(admin.list_consumer_group_offsets(g, partitions=tps)
                                             for g in groups))
        result = {}
        for group, offsets in zip(groups, fetched):
            committed = {TopicPartition(tp.topic, tp.partition): meta.offset
                         for tp, meta in offsets.items() if meta.offset >= 0}  # -1: none
            if committed:
                result[group] = committed
        return result

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None,
                   headers: Headers | None = None,
                   partition: int | None = None) -> Awaitable[Delivery]:
        producer = self._require(self._producer)
        check_record_size(topic, value, key, headers)
        await self._check_topic(producer, topic)
        with _wrapped(f"publishing to {topic}", self.security):
            future = await producer.send(topic, value, key=key, partition=partition,
                                         headers=list(headers) if headers else None)
        return asyncio.ensure_future(self._delivery(topic, future))

    async def _check_topic(self, producer: AIOKafkaProducer, topic: str) -> None:
        if topic in self._known_topics:
            return
        try:
            await asyncio.wait_for(producer.partitions_for(topic), TOPIC_LOOKUP_TIMEOUT_S)
        except TopicAuthorizationFailedError as err:
            raise denied(f"publishing to {topic}", "topic", topic, self.security) from err
        except (KafkaError, TimeoutError) as err:
            raise BusError(f"topic {topic!r} is unknown to the broker at {self.bootstrap}; "
                           "create it first (`miles topics create`)") from err
        self._known_topics.add(topic)

    async def _delivery(self, topic: str, future: asyncio.Future) -> Delivery:
        with _wrapped(f"publishing to {topic}", self.security):
            metadata = await future
        return Delivery(metadata.topic, metadata.partition, metadata.offset)

    async def flush(self) -> None:
        with _wrapped("flushing", self.security):
            await self._require(self._producer).flush()

    async def create_acls(self, acls: Iterable[Acl]) -> int:
        """Allow the rules of `acls` (`miles.acls`); needs a super user. Kafka only."""
        from miles.bus.kafka_acls import create_acls

        with _wrapped("creating ACLs", self.security):
            return await create_acls(self._require(self._admin), acls)

    def consumer(self, topics: Sequence[str], *, group_id: str, from_beginning: bool = True,
                 on_assigned: RebalanceCallback | None = None,
                 on_revoked: RebalanceCallback | None = None) -> KafkaConsumer:
        from miles.bus.kafka_consumer import KafkaConsumer

        return KafkaConsumer(self, list(topics), group_id, from_beginning,
                             on_assigned, on_revoked)
