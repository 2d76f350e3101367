"""The `miles` command: one entry point, a sub-command per job.

Sub-commands parse their own flags and call library functions; nothing here holds logic that a
test would want to reach without a command line. The sub-commands live by group: `cluster`
(broker, its ACLs, topics, smoke, keys), `training` (sft, feed, demo, algorithms, export-model
and the commands configured like the daemons), `reading` (export, stats, tail, status).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from miles.cli import cluster, reading, training
from miles.errors import MilesError

COMMANDS = {**cluster.COMMANDS, **training.COMMANDS, **reading.COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cluster.add_broker_commands(sub)
    cluster.add_topic_commands(sub)
    cluster.add_smoke_command(sub)
    training.add_rl_commands(sub)
    reading.add_experience_commands(sub)
    reading.add_status_command(sub)
    training.add_export_model_command(sub)
    cluster.add_keys_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in training.SETTINGS_COMMANDS:  # commands configured like the daemons
        return training.SETTINGS_COMMANDS[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        command = COMMANDS.get(args.command)
        if command is not None:
            return command(args)
    except MilesError as err:
        print(f"miles {args.command}: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")
