"""The `miles` command: one entry point, a sub-command per job.

Sub-commands parse their own flags and call library functions; nothing here holds logic that a
test would want to reach without a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from miles import broker
from miles.errors import MilesError


def _add_broker_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("broker", help="run a local single-node Apache Kafka broker")
    actions = parser.add_subparsers(dest="action", required=True)
    start = actions.add_parser("start", help="start the broker in the background")
    start.add_argument("--port", type=int, default=broker.DEFAULT_PORT)
    start.add_argument("--data-dir", type=Path, default=None,
                       help="where the broker keeps its log (default: $MILES_BROKER_DIR or "
                            "~/.local/share/miles/broker)")
    start.add_argument("--heap", default=broker.DEFAULT_HEAP, help="JVM heap, e.g. 1g")
    for name, text in (("stop", "stop the broker (controlled shutdown)"),
                       ("status", "say whether the broker runs and where")):
        action = actions.add_parser(name, help=text)
        action.add_argument("--data-dir", type=Path, default=None)


def _broker(args: argparse.Namespace) -> int:
    if args.action == "start":
        info = broker.start_broker(data_dir=args.data_dir, port=args.port, heap=args.heap)
        print(info.bootstrap)
        return 0
    if args.action == "stop":
        stopped = broker.stop_broker(data_dir=args.data_dir)
        print("stopped" if stopped else "not running")
        return 0
    info = broker.running_info(args.data_dir)
    if info is None:
        print("not running")
        return 1
    print(json.dumps({"running": True, **info.__dict__}, indent=2))
    return 0


def _add_topic_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("topics", help="create or describe the topics of a run")
    actions = parser.add_subparsers(dest="action", required=True)
    for name in ("create", "describe"):
        action = actions.add_parser(name)
        action.add_argument("--bootstrap", required=True, help="Kafka address HOST:PORT")
        action.add_argument("--run", required=True, help="run name: topics are miles.RUN.*")
        if name == "create":
            action.add_argument("--prompt-partitions", type=int, default=8)
            action.add_argument("--trajectory-partitions", type=int, default=8)
            action.add_argument("--trajectory-retention-ms", type=int, default=-1,
                                help="-1 keeps trajectories forever (replayable)")


async def _topics(args: argparse.Namespace) -> int:
    from miles.bus import open_bus
    from miles.protocol.topics import run_topics

    specs = run_topics(args.run, **({
        "prompt_partitions": args.prompt_partitions,
        "trajectory_partitions": args.trajectory_partitions,
        "trajectory_retention_ms": args.trajectory_retention_ms,
    } if args.action == "create" else {}))
    url = args.bootstrap if args.bootstrap.startswith("kafka://") else f"kafka://{args.bootstrap}"
    async with open_bus(url) as bus:
        if args.action == "create":
            created = set(await bus.create_topics(specs))
            for spec in specs:
                print(f"{spec.name}: {'created' if spec.name in created else 'exists'}")
            return 0
        for name, info in (await bus.describe_topics([s.name for s in specs])).items():
            keys = ("retention.ms", "max.message.bytes", "cleanup.policy")
            shown = " ".join(f"{k}={info.configs.get(k)}" for k in keys)
            print(f"{name}: partitions={info.partitions} {shown}")
    return 0


def _add_smoke_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("smoke", help="push trajectory groups through the bus and back")
    parser.add_argument("--bus", default=None,
                        help="kafka://HOST:PORT or embedded:// (default: start the local "
                             "broker and use it)")
    parser.add_argument("--groups", type=int, default=200)


async def _smoke(args: argparse.Namespace) -> int:
    from miles.smoke import run_smoke

    url = args.bus
    if url is None:
        info = broker.start_broker()
        url = f"kafka://{info.bootstrap}"
    report = await run_smoke(url, groups=args.groups)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_broker_commands(sub)
    _add_topic_commands(sub)
    _add_smoke_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "broker":
            return _broker(args)
        if args.command == "topics":
            return asyncio.run(_topics(args))
        if args.command == "smoke":
            return asyncio.run(_smoke(args))
    except MilesError as err:
        print(f"miles {args.command}: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
