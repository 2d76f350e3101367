"""`miles export`, `stats`, `tail`, `status`: reading a run's topics from a Kafka bus."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from miles.cli.cluster import kafka_url
from miles.service import configure_logging


RANGE_HELP = "earliest, latest, an offset (in every partition), @EPOCH_MS or an ISO 8601 time"


def add_experience_commands(sub: argparse._SubParsersAction) -> None:
    from miles.protocol.topics import KINDS

    export = sub.add_parser("export", help="write a range of a run's trajectories to JSONL or "
                                           "Parquet, one row per sample")
    stats = sub.add_parser("stats", help="summarise a range of a run's trajectories")
    tail = sub.add_parser("tail", help="print a run's records as they arrive")
    for parser in (export, stats, tail):
        parser.add_argument("--bus", required=True, help="kafka://HOST:PORT")
        parser.add_argument("--run", required=True, help="run name: topics are miles.RUN.*")
    for parser in (export, stats):
        parser.add_argument("--from", dest="start", default="earliest",
                            help=f"first record (inclusive): {RANGE_HELP}")
        parser.add_argument("--to", dest="end", default="latest",
                            help=f"end of the range (exclusive): {RANGE_HELP}")
    export.add_argument("--out", type=Path, required=True, help="file to write")
    export.add_argument("--format", choices=("jsonl", "parquet"), default=None,
                        help="default: from the file's suffix (.jsonl, .parquet)")
    stats.add_argument("--json", action="store_true", help="print the summary as JSON")
    tail.add_argument("--topic", choices=KINDS, default="trajectories")
    tail.add_argument("--raw", action="store_true",
                      help="show the msgpack envelope as plain data, unchecked")
    tail.add_argument("--from", dest="start", default="latest",
                      help=f"where to start: {RANGE_HELP}")
    tail.add_argument("--limit", type=int, default=None, help="stop after this many records")
    tail.add_argument("--model-dir", type=Path, default=None,
                      help="decode trajectories with this checkpoint's tokenizer: each turn's "
                           "model and environment text, reward and finish reason")


def add_status_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("status", help="a run at a glance: producers, trainer, consumer "
                                           "lag, DLQ")
    address = parser.add_mutually_exclusive_group(required=True)
    address.add_argument("--bootstrap", help="Kafka address HOST:PORT")
    address.add_argument("--bus", help="kafka://HOST:PORT")
    parser.add_argument("--run", required=True, help="run name: topics are miles.RUN.*")
    parser.add_argument("--watch", type=float, nargs="?", const=2.0, default=None,
                        metavar="SECONDS", help="refresh every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--window", type=float, default=60.0, metavar="SECONDS",
                        help="read the heartbeats of the last SECONDS (default 60)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (one object per line with --watch)")


def _status(args: argparse.Namespace) -> int:
    from miles.service import run_service, wait_or_stop
    from miles.status import collect_status, format_status

    from miles.errors import ConfigError

    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch must be > 0 seconds, got {args.watch:g}")
    url = args.bus or kafka_url(args.bootstrap)
    clear = args.watch is not None and sys.stdout.isatty()

    async def show(stop: asyncio.Event) -> int:
        async with _reading_bus(url) as bus:
            while True:
                status = await collect_status(bus, args.run, window_s=args.window)
                if args.json:
                    text = json.dumps(status, indent=None if args.watch is not None else 2)
                else:
                    text = format_status(status)
                print(("\033[H\033[2J" if clear else "") + text, flush=True)
                if args.watch is None or await wait_or_stop(stop, args.watch):
                    return 0

    return run_service(show)


def _reading_bus(url: str):
    from miles.bus import open_bus
    from miles.errors import ConfigError

    if not url.startswith("kafka://"):
        raise ConfigError(f"--bus must be kafka://HOST:PORT, got {url!r}: the embedded bus "
                          "lives inside one process (call miles.experience from there)")
    return open_bus(url)


def _log_progress() -> None:
    configure_logging(logging.WARNING)
    logging.getLogger("miles").setLevel(logging.INFO)


async def _export(args: argparse.Namespace) -> int:
    from miles.experience import export

    _log_progress()
    async with _reading_bus(args.bus) as bus:
        summary = await export(bus, args.run, args.start, args.end, args.out, args.format)
    print(json.dumps(summary, indent=2))
    return 0


async def _stats(args: argparse.Namespace) -> int:
    from miles.experience import format_stats, stats

    _log_progress()
    async with _reading_bus(args.bus) as bus:
        summary = await stats(bus, args.run, args.start, args.end)
    print(json.dumps(summary, indent=2) if args.json else format_stats(summary))
    return 0


def _tail(args: argparse.Namespace) -> int:
    from miles.experience import tail
    from miles.service import run_service

    tokenizer = None
    if args.model_dir is not None:
        from transformers import AutoTokenizer

        from miles.errors import ConfigError
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--model-dir {args.model_dir}: no tokenizer to load ({err})") from None

    async def follow(stop: asyncio.Event) -> int:
        async with _reading_bus(args.bus) as bus:
            async for line in tail(bus, args.run, args.topic, raw=args.raw, start=args.start,
                                   limit=args.limit, stop=stop, tokenizer=tokenizer):
                print(line, flush=True)
        return 0

    return run_service(follow)


COMMANDS = {"export": lambda args: asyncio.run(_export(args)),
            "stats": lambda args: asyncio.run(_stats(args)), "tail": _tail, "status": _status}
