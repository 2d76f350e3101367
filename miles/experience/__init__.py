"""Looking at recorded experience: export a range to a file, summarise it, follow a topic.

`export` writes one row per sample (every field, `rows.COLUMNS` then the flattened sampling and
timing maps) to JSONL or Parquet; `stats` summarises a range (rewards by policy version, lengths,
lag, producers, dead letters); `tail` describes records as they arrive. All take a started
`Bus`, so they work on Kafka and, inside the process that owns it, on the embedded bus; the
`miles export|stats|tail` commands are their command-line form for Kafka. Ranges are read with
`miles.bus.ranges` in a fresh consumer group that commits nothing.
"""

from miles.experience.files import export
from miles.experience.rows import COLUMNS, rows
from miles.experience.stats import format_stats, stats
from miles.experience.tail import tail

__all__ = ["COLUMNS", "export", "format_stats", "rows", "stats", "tail"]
