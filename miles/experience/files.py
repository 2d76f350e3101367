"""`export`: a range of a run's trajectories to a JSONL or Parquet file, one row per sample.

Rows are those of `miles.experience.rows`. JSONL writes one JSON object per line, arrays as
lists (float32 logprobs as the shortest decimal of their float64 value, so they read back
exactly). Parquet has the fixed columns with fixed types (token ids and versions
`list<int32>`, logprobs and token rewards `list<float32>`), then the flattened `sampling_*` and
`timing_*` columns with types from their values.

Choices:
- Memory stays bounded: rows are written in batches of `BATCH_ROWS` (one Parquet row group
  each), off the event loop (Kafka heartbeats run there).
- A Parquet file has one schema, but which `sampling_*`/`timing_*` keys exist, and their types,
  is only known once read. Batches go to a part file until a batch brings a new column or type;
  then a new part starts, and at the end the parts are merged into one file with a common
  schema (ints and floats widen to float64, any other mix becomes text, missing columns null).
  A run whose producers agree on their keys writes one part and no merge.
- The file appears only when complete: writers fill a temporary sibling and rename it.
- pyarrow is imported here only, and only for Parquet (the `export` extra).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from miles.bus.base import Bus
from miles.bus.ranges import Bound, parse_bound, reader_group
from miles.errors import ConfigError
from miles.experience.rows import COLUMNS, TIMING_PREFIX, read_groups, rows
from miles.protocol.topics import topic_name

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
BATCH_ROWS = 1_000
PROGRESS_RECORDS = 10_000
PARQUET_COMPRESSION = "zstd"


def format_for(path: Path, fmt: str | None = None) -> str:
    """`fmt` if given, else the format named by the file's suffix."""
    if fmt is None:
        fmt = SUFFIXES.get(Path(path).suffix.lower())
        if fmt is None:
            raise ConfigError(f"cannot tell the export format from {str(path)!r}: use a "
                              f"{', '.join(SUFFIXES)} file name or --format {'|'.join(FORMATS)}")
    if fmt not in FORMATS:
        raise ConfigError(f"export format must be one of {FORMATS}, got {fmt!r}")
    return fmt


async def export(bus: Bus, run: str, start: Bound | str, end: Bound | str, out: Path | str,
                 fmt: str | None = None) -> dict:
    """Write the samples of the run's trajectories in [start, end) to `out`; a summary
    {out, format, rows, records, groups, invalid, invalid_fields, seconds}."""
    out = Path(out)
    fmt = format_for(out, fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    sink = ParquetSink(out) if fmt == "parquet" else JsonlSink(out)
    began = time.perf_counter()
    counts: dict = {}
    invalid: Counter[str] = Counter()
    written = groups = records = 0
    batch: list[dict] = []
    try:
        async for record, group in read_groups(
                bus, topic_name(run, "trajectories"), parse_bound(start), parse_bound(end),
                group_id=reader_group(run, "export"), invalid=invalid, counts=counts):
            records += 1
            if group is not None:
                groups += 1
                batch.extend(rows(group, record))
            if len(batch) >= BATCH_ROWS:
                await asyncio.to_thread(sink.write, batch)
                written, batch = written + len(batch), []
            if records % PROGRESS_RECORDS == 0:
                log.info("export: %d/%d records, %d rows", records,
                         counts.get("range/records", 0), written + len(batch))
        if batch:
            await asyncio.to_thread(sink.write, batch)
            written += len(batch)
        await asyncio.to_thread(sink.finish)
    except BaseException:
        sink.abort()
        raise
    summary = {"out": str(out), "format": fmt, "rows": written, "records": records,
               "groups": groups, "invalid": invalid.total(), "invalid_fields": dict(invalid),
               "seconds": round(time.perf_counter() - began, 3)}
    log.info("export: %d rows from %d records (%d invalid, skipped) to %s in %.1f s",
             written, records, invalid.total(), out, summary["seconds"])
    return summary


def _temporary_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.part")


class JsonlSink:
    """One JSON object per row and line."""

    def __init__(self, path: Path):
        self.path = path
        self.partial = _temporary_sibling(path)
        self.file = open(self.partial, "w", encoding="utf-8")

    def write(self, batch: list[dict]) -> None:
        self.file.write("".join(json.dumps(jsonable(row), ensure_ascii=False) + "\n"
                                for row in batch))

    def finish(self) -> None:
        self.file.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def jsonable(row: dict) -> dict:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()}


def import_pyarrow():
    """(pyarrow, pyarrow.parquet), or a ConfigError naming the extra to install."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("Parquet export needs pyarrow: pip install 'miles[export]' "
                          "(or export to .jsonl)") from None
    return pyarrow, pyarrow.parquet


class ParquetSink:
    """Row groups of `BATCH_ROWS` rows in part files, merged at the end if their schemas differ."""

    def __init__(self, path: Path):
        self.pa, self.pq = import_pyarrow()
        self.path = path
        self.kinds = {"str": self.pa.string(), "int": self.pa.int64(),
                      "float": self.pa.float64(), "ints": self.pa.list_(self.pa.int32()),
                      "floats": self.pa.list_(self.pa.float32())}
        self.folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        self.parts: list[Path] = []
        self.writer = None
        self.schema = self.pa.schema([(name, self.kinds[kind]) for name, kind in COLUMNS.items()])

    def write(self, batch: list[dict]) -> None:
        table = self._table(batch)
        if self.writer is None or not table.schema.equals(self.schema):
            self._close_part()
            self.parts.append(self.folder / f"part-{len(self.parts)}.parquet")
            self.schema = table.schema
            self.writer = self.pq.ParquetWriter(self.parts[-1], self.schema,
                                                compression=PARQUET_COMPRESSION)
        self.writer.write_table(table)

    def finish(self) -> None:
        self._close_part()
        done = self.folder / "export.parquet"
        if not self.parts:
            self.pq.write_table(self.schema.empty_table(), done)
        elif len(self.parts) == 1:
            done = self.parts[0]
        else:
            self._merge(done)
        os.replace(done, self.path)
        shutil.rmtree(self.folder)

    def abort(self) -> None:
        self._close_part()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _close_part(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _table(self, batch: list[dict]):
        """The batch under the current schema where it fits; new keys are appended, sorted."""
        known = list(self.schema.names)
        new = sorted({k for row in batch for k in row} - set(known))
        arrays = [self._array(name, [row.get(name) for row in batch]) for name in known + new]
        return self.pa.Table.from_arrays(arrays, names=known + new)

    def _array(self, name: str, values: list):
        pa = self.pa
        if name in COLUMNS:
            return pa.array(values, type=self.kinds[COLUMNS[name]])
        if name.startswith(TIMING_PREFIX):
            return pa.array(values, type=pa.float64())
        if name in self.schema.names and self.schema.field(name).type != pa.null():
            try:
                return pa.array(values, type=self.schema.field(name).type)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                pass  # a new type for this column: a new part, widened by the merge
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # a mix such as numbers and text
            return pa.array([None if v is None else str(v) for v in values], type=pa.string())

    def _merge(self, out: Path) -> None:
        pa = self.pa
        schemas = [self.pq.read_schema(part) for part in self.parts]
        names = list(dict.fromkeys(name for schema in schemas for name in schema.names))
        schema = pa.schema([(name, common_type(pa, [s.field(name).type for s in schemas
                                                     if name in s.names])) for name in names])
        with self.pq.ParquetWriter(out, schema, compression=PARQUET_COMPRESSION) as writer:
            for part in self.parts:
                for batch in self.pq.ParquetFile(part).iter_batches(batch_size=BATCH_ROWS):
                    columns = [batch.column(f.name).cast(f.type) if f.name in batch.schema.names
                               else pa.nulls(batch.num_rows, f.type) for f in schema]
                    writer.write_table(pa.Table.from_arrays(columns, schema=schema))


def common_type(pa, types: list):
    """One type for a column the parts typed differently: nulls ignored, ints and floats to
    float64, any other mix to text."""
    types = [t for t in dict.fromkeys(types) if t != pa.null()]
    if not types:
        return pa.null()
    if len(types) == 1:
        return types[0]
    if all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in types):
        return pa.float64()
    return pa.string()
