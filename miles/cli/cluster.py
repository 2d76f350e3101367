"""`miles broker`, `miles topics`, `miles smoke`, `miles keys`: the broker, its ACLs, a run's
topics and its signing keys."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from miles import acls as acl_rules
from miles import broker, broker_security


def add_broker_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("broker", help="run a local single-node Apache Kafka broker")
    actions = parser.add_subparsers(dest="action", required=True)
    start = actions.add_parser("start", help="start the broker in the background")
    start.add_argument("--port", type=int, default=broker.DEFAULT_PORT)
    start.add_argument("--data-dir", type=Path, default=None,
                       help="where the broker keeps its log (default: $MILES_BROKER_DIR or "
                            "~/.local/share/miles/broker)")
    start.add_argument("--heap", default=broker.DEFAULT_HEAP, help="JVM heap, e.g. 1g")
    start.add_argument("--secure", action="store_true",
                       help="SASL_SSL (SCRAM) with a keytool CA, SCRAM users admin/trainer/"
                            "producer/feeder/reader and ACLs (docs/security.md)")
    start.add_argument("--acl-run", action="append", default=[], metavar="RUN",
                       help="with --secure: give each built-in user its role's ACLs for run "
                            "RUN (repeatable; default: demo)")
    acls = actions.add_parser("acls", help="grant a user a role's ACLs for a run (secured "
                                           "broker), or print them as kafka-acls commands")
    acls.add_argument("--role", required=True, help=acl_rules.ROLE_HELP)
    acls.add_argument("--user", required=True, help="the SCRAM user (principal User:USER)")
    acls.add_argument("--run", required=True)
    acls.add_argument("--data-dir", type=Path, default=None)
    acls.add_argument("--print", action="store_true",
                      help="only print the equivalent kafka-acls commands")
    for name, text in (("stop", "stop the broker (controlled shutdown)"),
                       ("status", "say whether the broker runs and where")):
        action = actions.add_parser(name, help=text)
        action.add_argument("--data-dir", type=Path, default=None)


def _broker(args: argparse.Namespace) -> int:
    if args.action == "start":
        info = broker.start_broker(data_dir=args.data_dir, port=args.port, heap=args.heap,
                                   secure=args.secure)
        if not args.secure:
            print(info.bootstrap)
            return 0
        for run in args.acl_run or ["demo"]:
            broker_security.grant_builtin_roles(Path(info.data_dir), run)
        print(broker_security.connect_hint(Path(info.data_dir)))
        return 0
    if args.action == "acls":
        rules = acl_rules.role_acls(args.role, args.user, args.run)
        if args.print:
            print("\n".join(acl_rules.kafka_acls_commands(rules)))
            return 0
        print(f"{broker_security.grant(broker.resolve_dir(args.data_dir), rules)} ACLs granted")
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


def add_topic_commands(sub: argparse._SubParsersAction) -> None:
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


def kafka_url(bootstrap: str) -> str:
    """`kafka://HOST:PORT` from a `--bootstrap` given with or without the scheme."""
    return f"kafka://{bootstrap.removeprefix('kafka://')}"


async def _topics(args: argparse.Namespace) -> int:
    from miles.bus import open_bus
    from miles.protocol.topics import run_topics

    specs = run_topics(args.run, **({
        "prompt_partitions": args.prompt_partitions,
        "trajectory_partitions": args.trajectory_partitions,
        "trajectory_retention_ms": args.trajectory_retention_ms,
    } if args.action == "create" else {}))
    url = kafka_url(args.bootstrap)
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


def add_smoke_command(sub: argparse._SubParsersAction) -> None:
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


def add_keys_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("keys", help="the Ed25519 key pair that signs a run's control "
                                         "records (docs/control-plane.md)")
    actions = parser.add_subparsers(dest="action", required=True)
    generate = actions.add_parser("generate", help="write control.key (the trainer's "
                                                   "loop.signing_key) and control.pub (the "
                                                   "followers' weights.public_key) into DIR")
    generate.add_argument("dir", type=Path)


def _keys(args: argparse.Namespace) -> int:
    from miles.weights.signing import generate_key_pair

    private, public = generate_key_pair(args.dir)
    print(f"wrote {private} (the trainer's loop.signing_key; keep it secret)")
    print(f"wrote {public} (rollout.weights.public_key of producers, weights.public_key of the "
          "evaluator)")
    return 0


COMMANDS = {"broker": _broker, "topics": lambda args: asyncio.run(_topics(args)),
            "smoke": lambda args: asyncio.run(_smoke(args)), "keys": _keys}
