"""Recorder daemon: `python -m consumers.recorder --config recorder.yaml` (`miles record`).

A fan-out consumer that archives a run's trajectories to Parquet files, in its own consumer
group (`miles.<run>.recorder`), so the trainer never waits for it. Rows are those of
`miles export` (one per sample, every field). A file is closed once it holds `file_rows` rows
(give or take one poll) or after `file_seconds` seconds, whichever comes first, as
`<out_dir>/part-<UTC time>-<n>.parquet` (written under a temporary name and renamed), and only
then are the offsets of the records in it committed. A restarted recorder continues from the
last commit: a recorder killed between a file's rename and its commit writes those records
again into its next file (at-least-once; `group_id` + `sample_index` identify a row). Invalid
records are counted and skipped (the trainer dead-letters them). Stops on SIGTERM, closing the
open file first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.bus.security import KafkaSecurity
from miles.service import daemon_main

log = logging.getLogger("consumers.recorder")


@dataclass(frozen=True, kw_only=True)
class RecorderSettings:
    bus: str = "kafka://127.0.0.1:9092"  # kafka://HOST:PORT
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS/SASL (MILES_KAFKA__*)
    run: str = "demo"  # the run to archive: reads miles.<run>.trajectories
    out_dir: Path = Path("runs/archive")  # Parquet files land here
    file_rows: int = 100_000  # a file closes once it holds this many rows (samples)
    file_seconds: float = 300.0  # a file is closed at least this often while data arrives

    def __post_init__(self) -> None:
        from miles.errors import ConfigError

        if self.file_rows < 1:
            raise ConfigError(f"file_rows must be >= 1, got {self.file_rows}")
        if not self.file_seconds > 0:
            raise ConfigError(f"file_seconds must be > 0, got {self.file_seconds}")


class Recorder:
    def __init__(self, bus, settings: RecorderSettings):
        self.bus, self.settings = bus, settings
        self.files = 0
        self.rows = 0
        self.invalid = 0

    async def run(self, stop: asyncio.Event) -> dict:
        from miles.protocol.topics import topic_name

        self.settings.out_dir.mkdir(parents=True, exist_ok=True)
        consumer = self.bus.consumer([topic_name(self.settings.run, "trajectories")],
                                     group_id=f"miles.{self.settings.run}.recorder")
        async with consumer:
            while not stop.is_set():
                await self._one_file(consumer, stop)
        return {"files": self.files, "rows": self.rows, "invalid": self.invalid}

    async def _one_file(self, consumer, stop: asyncio.Event) -> None:
        """Stream rows into one Parquet file (`BATCH_ROWS` at a time) until it is full, old or
        the recorder stops; put it in place; then commit the offsets of its records."""
        from miles.errors import CodecError
        from miles.experience import rows
        from miles.experience.files import BATCH_ROWS
        from miles.protocol import TrajectoryGroup, decode

        sink, pending, written, offsets = None, [], 0, {}
        opened = time.monotonic()
        try:
            while (written + len(pending) < self.settings.file_rows and not stop.is_set()
                   and time.monotonic() - opened < self.settings.file_seconds):
                for record in await consumer.poll(timeout_s=0.5):
                    offsets[record.tp] = record.offset + 1
                    try:
                        pending.extend(rows(decode(record.value, TrajectoryGroup), record))
                    except CodecError:
                        self.invalid += 1
                if len(pending) >= BATCH_ROWS:
                    sink = sink or self._new_sink()
                    await asyncio.to_thread(sink.write, pending)
                    written, pending = written + len(pending), []
            if pending:
                sink = sink or self._new_sink()
                await asyncio.to_thread(sink.write, pending)
                written += len(pending)
            if sink is not None:
                await asyncio.to_thread(sink.finish)
        except BaseException:
            if sink is not None:
                sink.abort()
            raise
        if sink is not None:
            self.files += 1
            self.rows += written
            log.info("recorded %d rows to %s", written, sink.path)
        if offsets:
            await consumer.commit(offsets)

    def _new_sink(self):
        from miles.experience.files import ParquetSink

        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        return ParquetSink(self.settings.out_dir / f"part-{stamp}-{self.files:06d}.parquet")


async def run_recorder(settings: RecorderSettings, stop: asyncio.Event) -> dict:
    from miles.bus import open_bus
    from miles.experience.files import import_pyarrow

    import_pyarrow()  # fail at start, not at the first file, without the extra
    async with open_bus(settings.bus, settings.kafka) as bus:
        return await Recorder(bus, settings).run(stop)


def main(argv=None) -> int:
    return daemon_main(RecorderSettings, argv, prog="consumers.recorder", doc=__doc__,
                       run=run_recorder)


if __name__ == "__main__":
    raise SystemExit(main())
