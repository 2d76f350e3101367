"""The files of a durable embedded bus (`embedded://PATH`): what lets `miles run --resume` on
the embedded bus keep the daemons' exactly-once guarantees after the process is killed.

Layout under PATH:
- `topics/<topic>/spec.json`: the topic's partitions and configs;
- `topics/<topic>/<partition>.log`: its records, appended as frames of
  `>II` (payload length, CRC-32 of the payload) + msgpack `[key, value, headers, timestamp_ms]`;
- `groups/<group id>.json`: the group's committed offsets, replaced atomically on each commit.

Each frame goes to the file in one unbuffered write before the send is acknowledged, so what a
killed process acknowledged is on disk (in the page cache: a kill, not a power loss; nothing is
fsynced). A frame torn by a kill mid-write, or one whose checksum fails, ends the log: it and
anything after it are cut off when the bus opens again.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import msgpack

from miles.bus.base import Record, TopicInfo, TopicPartition
from miles.errors import BusError

FRAME = struct.Struct(">II")


def _frame(record: Record) -> bytes:
    payload = msgpack.packb([record.key, record.value, [list(h) for h in record.headers],
                             record.timestamp_ms], use_bin_type=True)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _read_frames(path: Path, topic: str, partition: int) -> list[Record]:
    """The whole frames of `path`; a torn or damaged tail is cut off the file."""
    data = path.read_bytes() if path.exists() else b""
    records, at = [], 0
    while at + FRAME.size <= len(data):
        length, crc = FRAME.unpack_from(data, at)
        payload = data[at + FRAME.size:at + FRAME.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        key, value, headers, timestamp_ms = msgpack.unpackb(payload, raw=False)
        records.append(Record(topic=topic, partition=partition, offset=len(records), key=key,
                              value=value, headers=tuple((k, v) for k, v in headers),
                              timestamp_ms=timestamp_ms))
        at += FRAME.size + length
    if at < len(data):
        with open(path, "r+b") as f:
            f.truncate(at)
    return records


class BusFiles:
    """Reads and appends the files of one durable embedded bus."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._appenders: dict[TopicPartition, object] = {}

    def _topic_dir(self, name: str) -> Path:
        if not name or "/" in name or name in (".", ".."):
            raise BusError(f"topic name {name!r} cannot be stored on a durable embedded bus")
        return self.root / "topics" / name

    def topics(self) -> dict[str, tuple[TopicInfo, list[list[Record]]]]:
        """Every stored topic: its info and each partition's records."""
        found = {}
        for spec_file in sorted((self.root / "topics").glob("*/spec.json")):
            spec = json.loads(spec_file.read_text())
            info = TopicInfo(name=spec["name"], partitions=spec["partitions"],
                             configs=spec["configs"])
            found[info.name] = (info, [_read_frames(spec_file.parent / f"{p}.log", info.name, p)
                                       for p in range(info.partitions)])
        return found

    def groups(self) -> dict[str, dict[TopicPartition, int]]:
        """Every group's committed offsets."""
        found = {}
        for path in sorted((self.root / "groups").glob("*.json")):
            committed = json.loads(path.read_text())
            found[committed["group_id"]] = {
                TopicPartition(topic, int(p)): offset
                for topic, partitions in committed["offsets"].items()
                for p, offset in partitions.items()}
        return found

    def add_topic(self, info: TopicInfo) -> None:
        folder = self._topic_dir(info.name)
        folder.mkdir(parents=True, exist_ok=True)
        _replace(folder / "spec.json", {"name": info.name, "partitions": info.partitions,
                                        "configs": dict(info.configs)})

    def append(self, record: Record) -> None:
        tp = record.tp
        if tp not in self._appenders:
            path = self._topic_dir(tp.topic) / f"{tp.partition}.log"
            self._appenders[tp] = open(path, "ab", buffering=0)
        self._appenders[tp].write(_frame(record))

    def commit(self, group_id: str, committed: dict[TopicPartition, int]) -> None:
        offsets: dict[str, dict[str, int]] = {}
        for tp, offset in committed.items():
            offsets.setdefault(tp.topic, {})[str(tp.partition)] = offset
        folder = self.root / "groups"
        folder.mkdir(parents=True, exist_ok=True)
        name = group_id.replace("/", "_")
        _replace(folder / f"{name}.json", {"group_id": group_id, "offsets": offsets})

    def close(self) -> None:
        for appender in self._appenders.values():
            appender.close()
        self._appenders.clear()


def _replace(path: Path, content: dict) -> None:
    """Write `path` whole or not at all (a kill leaves the old file or the new one)."""
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(content))
    os.replace(staging, path)
