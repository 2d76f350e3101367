"""The Kafka bus: with its helpers `kafka_errors` and `kafka_acls`, the only code that imports
aiokafka.

Producer: idempotent, `acks=all`, zstd, a 5 ms linger and 4 MiB batches (the Python client, not
the broker, limits throughput, so records are batched hard). Consumer: manual commits only,
earliest reset by default, fetch sizes from `miles.protocol.topics` so no record the topic
accepts can stall it. Every aiokafka exception is wrapped in `BusError` here; a commit refused
because the group's membership changed raises its subclass `CommitFailedError`, an ACL denial
`AuthorizationError`, a refused password or failed TLS handshake `AuthenticationError`
(`kafka_errors`). Starting the bus or a consumer waits up to `START_TIMEOUT_S` for a broker that
is not reachable yet (a daemon started during a broker restart), with one log line, before it
fails; a refused identity or a denied ACL fails at once. Each attempt builds fresh clients
(one whose start failed cannot start again) and closes them when it fails, so a refused start
leaves no client unclosed. Every client (producer, consumers,
admin, offsets reader, probe) gets the same TLS/SASL options (`miles.bus.security`).

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
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka import TopicPartition as KafkaTopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (CommitFailedError as KafkaCommitFailedError, IllegalGenerationError,
                             IllegalStateError, KafkaError, RebalanceInProgressError,
                             TopicAuthorizationFailedError, UnknownMemberIdError)

from miles.acls import Acl
from miles.bus import reconnects
from miles.bus.kafka_errors import check_codes, denied, diagnose, retrying
from miles.bus.kafka_errors import wrapped as _wrapped
from miles.bus.security import KafkaSecurity
from miles.bus.base import (Bus, Consumer, Delivery, Headers, RebalanceCallback, Record,
                            TopicInfo, TopicPartition, check_record_size)
from miles.errors import BusError, CommitFailedError
from miles.protocol.topics import (CONSUMER_FETCH_MAX_BYTES, CONSUMER_MAX_PARTITION_FETCH_BYTES,
                                   PRODUCER_MAX_REQUEST_BYTES, TopicSpec)

COMPRESSION = "zstd"
LINGER_MS = 5
MAX_BATCH_BYTES = 4 * 1024 * 1024  # one request in flight per broker: fewer, bigger batches
REQUEST_TIMEOUT_MS = 40_000
TOPIC_LOOKUP_TIMEOUT_S = 15.0
TOPIC_ALREADY_EXISTS = 36
log = logging.getLogger(__name__)
# Commit errors that mean the group's membership changed (IllegalStateError: the partition is
# no longer assigned to this member): raised as `CommitFailedError`.
MEMBERSHIP_ERRORS = (KafkaCommitFailedError, IllegalGenerationError, RebalanceInProgressError,
                     UnknownMemberIdError, IllegalStateError)


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
        return KafkaConsumer(self, list(topics), group_id, from_beginning,
                             on_assigned, on_revoked)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, on_assigned: RebalanceCallback | None,
                 on_revoked: RebalanceCallback | None):
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked

    async def on_partitions_revoked(self, revoked: Iterable[KafkaTopicPartition]) -> None:
        await self.revoke({TopicPartition(tp.topic, tp.partition) for tp in revoked})

    async def revoke(self, revoked: set[TopicPartition]) -> None:
        if self._on_revoked is not None and revoked:
            await self._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[KafkaTopicPartition]) -> None:
        if self._on_assigned is not None:
            await self._on_assigned({TopicPartition(tp.topic, tp.partition) for tp in assigned})


def _kafka_tp(tp: TopicPartition) -> KafkaTopicPartition:
    return KafkaTopicPartition(tp.topic, tp.partition)


class KafkaConsumer(Consumer):
    def __init__(self, bus: KafkaBus, topics: list[str], group_id: str, from_beginning: bool,
                 on_assigned: RebalanceCallback | None, on_revoked: RebalanceCallback | None):
        self.bus = bus
        self.topics = topics
        self.group_id = group_id
        self._reset = "earliest" if from_beginning else "latest"
        self._started: AIOKafkaConsumer | None = None  # the client, once it has started
        self._listener = _Listener(on_assigned, on_revoked)

    def _client(self) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=self.bus.bootstrap, client_id=self.bus.client_id,
            group_id=self.group_id, enable_auto_commit=False, auto_offset_reset=self._reset,
            max_partition_fetch_bytes=CONSUMER_MAX_PARTITION_FETCH_BYTES,
            fetch_max_bytes=CONSUMER_FETCH_MAX_BYTES, request_timeout_ms=REQUEST_TIMEOUT_MS,
            **self.bus.options)

    async def start(self) -> None:
        await retrying(f"starting consumer {self.group_id}", self._connect, self.bus.diagnose,
                       self.bus.security)

    async def _connect(self) -> None:
        """One attempt with a fresh client (one whose start failed cannot start again); a
        refused or failed start stops the client it made, so nothing is left unclosed."""
        client = self._client()
        client.subscribe(self.topics, listener=self._listener)
        try:
            await client.start()
        except BaseException:
            with contextlib.suppress(KafkaError):
                await client.stop()
            raise
        self._started = client

    @property
    def _consumer(self) -> AIOKafkaConsumer:
        if self._started is None:
            raise BusError(f"consumer {self.group_id} is not started (or already closed)")
        return self._started

    async def close(self) -> None:
        """Revoke (aiokafka does not on stop, the embedded bus does), then leave the group."""
        if self._started is None:
            return
        await self._listener.revoke(self.assignment())
        client, self._started = self._started, None
        with _wrapped(f"closing consumer {self.group_id}", self.bus.security):
            await client.stop()

    async def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        with _wrapped("polling", self.bus.security):
            batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000),
                                                   max_records=max_records)
        return [Record(topic=r.topic, partition=r.partition, offset=r.offset, key=r.key,
                       value=r.value, headers=tuple(r.headers), timestamp_ms=r.timestamp)
                for records in batches.values() for r in records]

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        kafka_offsets = None if offsets is None else {
            _kafka_tp(tp): offset for tp, offset in offsets.items()}
        try:
            with _wrapped("committing offsets", self.bus.security):
                await self._consumer.commit(kafka_offsets)
        except BusError as err:
            if isinstance(err.__cause__, MEMBERSHIP_ERRORS):
                raise CommitFailedError(str(err)) from err.__cause__
            raise

    async def committed(self, tp: TopicPartition) -> int | None:
        with _wrapped("reading committed offset", self.bus.security):
            return await self._consumer.committed(_kafka_tp(tp))

    def assignment(self) -> set[TopicPartition]:
        if self._started is None:
            return set()
        return {TopicPartition(tp.topic, tp.partition) for tp in self._started.assignment()}

    async def position(self, tp: TopicPartition) -> int:
        with _wrapped("reading position", self.bus.security):
            return await self._consumer.position(_kafka_tp(tp))

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self.assignment():
            raise BusError(f"{tp} is not assigned to this consumer")
        if offset < 0:
            raise BusError(f"cannot seek {tp} to negative offset {offset}")
        self._consumer.seek(_kafka_tp(tp), offset)

    async def seek_to_time(self, timestamp_ms: int,
                           tps: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        tps = list(self.assignment() if tps is None else tps)
        with _wrapped("looking up offsets by time", self.bus.security):
            found = await self._consumer.offsets_for_times(
                {_kafka_tp(tp): timestamp_ms for tp in tps})
        ends = await self.end_offsets(tps)
        targets = {}
        for tp in tps:
            hit = found.get(_kafka_tp(tp))
            targets[tp] = hit.offset if hit is not None else ends[tp]
            self.seek(tp, targets[tp])
        return targets

    async def end_offsets(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        with _wrapped("reading end offsets", self.bus.security):
            ends = await self._consumer.end_offsets([_kafka_tp(tp) for tp in tps])
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    async def beginning_offsets(self,
                                tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        with _wrapped("reading beginning offsets", self.bus.security):
            starts = await self._consumer.beginning_offsets([_kafka_tp(tp) for tp in tps])
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in starts.items()}

    def pause(self, *tps: TopicPartition) -> None:
        self._consumer.pause(*(_kafka_tp(tp) for tp in tps))

    def resume(self, *tps: TopicPartition) -> None:
        self._consumer.resume(*(_kafka_tp(tp) for tp in tps))
