"""Topic names of a run, their per-topic configs, and the one place record sizes are aligned.

Kafka checks sizes in four places: the producer (`max_request_size`, before compression), the
topic (`max.message.bytes`, after compression), the broker's replica fetcher and the consumer
(`max_partition_fetch_bytes`; smaller than the largest record and a consumer stalls). All four are
derived from `MAX_RECORD_BYTES` here, so raising one raises them all. Weights never travel as
records: a `WeightVersion` carries a URI and a sha256 (claim check).
"""

from dataclasses import dataclass, field

from miles.errors import ConfigError

MAX_RECORD_BYTES = 8 * 1024 * 1024
"""Largest encoded record (key + value + headers) any Miles topic accepts."""

# Room for the record-batch header and a record's own framing on top of the payload.
BATCH_OVERHEAD_BYTES = 64 * 1024

TOPIC_MAX_MESSAGE_BYTES = MAX_RECORD_BYTES + BATCH_OVERHEAD_BYTES
CONSUMER_MAX_PARTITION_FETCH_BYTES = TOPIC_MAX_MESSAGE_BYTES
CONSUMER_FETCH_MAX_BYTES = 8 * TOPIC_MAX_MESSAGE_BYTES
PRODUCER_MAX_REQUEST_BYTES = TOPIC_MAX_MESSAGE_BYTES

KINDS = ("prompts", "trajectories", "control", "status", "dlq")

CARRIED = {
    "prompts": ("prompt_task",),
    "trajectories": ("trajectory_group",),
    "control": ("weight_version", "command"),
    "status": ("heartbeat",),
    "dlq": ("dead_letter",),
}
"""The record types (wire `type` names) each kind of topic carries; any other is invalid there."""

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class TopicSpec:
    """One topic of a run with the configs it is created with."""

    name: str
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)


def _base_configs(retention_ms: int) -> dict[str, str]:
    return {
        "retention.ms": str(retention_ms),
        "max.message.bytes": str(TOPIC_MAX_MESSAGE_BYTES),
        "message.timestamp.type": "CreateTime",
    }


def topic_name(run: str, kind: str) -> str:
    """`miles.<run>.<kind>`; the run name must be a valid Kafka topic fragment."""
    if kind not in KINDS:
        raise ConfigError(f"topic kind must be one of {KINDS}, got {kind!r}")
    validate_run_name(run)
    return f"miles.{run}.{kind}"


def topic_kind(name: str) -> str | None:
    """The kind of a run's topic `miles.<run>.<kind>`, or None for a topic that is not one."""
    prefix, _, kind = name.rpartition(".")
    return kind if prefix.startswith("miles.") and kind in KINDS else None


def validate_run_name(run: str) -> None:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
    if not run or len(run) > 200 or not set(run) <= allowed:
        raise ConfigError(f"run name must be 1-200 characters of [A-Za-z0-9_-], got {run!r}")


def run_topics(
    run: str,
    *,
    prompt_partitions: int = 8,
    trajectory_partitions: int = 8,
    trajectory_retention_ms: int = -1,
) -> list[TopicSpec]:
    """The five topics of a run.

    Trajectories keep everything by default (-1 = unlimited) so any range can be replayed.
    Control holds weight versions and commands in order, so it has one partition. Prompts,
    status and the DLQ keep a week.
    """
    if prompt_partitions < 1 or trajectory_partitions < 1:
        raise ConfigError("partitions must be >= 1")
    week = 7 * DAY_MS
    return [
        TopicSpec(name=topic_name(run, "prompts"), partitions=prompt_partitions,
                  configs=_base_configs(week)),
        TopicSpec(name=topic_name(run, "trajectories"), partitions=trajectory_partitions,
                  configs=_base_configs(trajectory_retention_ms)),
        TopicSpec(name=topic_name(run, "control"), partitions=1,
                  configs=_base_configs(-1)),
        TopicSpec(name=topic_name(run, "status"), partitions=1,
                  configs=_base_configs(DAY_MS)),
        TopicSpec(name=topic_name(run, "dlq"), partitions=1,
                  configs=_base_configs(4 * week)),
    ]
