"""The `miles` command: one entry point, a sub-command per job.

Sub-commands parse their own flags and call library functions; nothing here holds logic that a
test would want to reach without a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from miles import acls as acl_rules
from miles import broker, broker_security
from miles.service import configure_logging
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


PROMPTS_HELP = ("a built-in task (arithmetic, arithmetic-plain), a .parquet file, a directory "
                "written by datasets' save_to_disk, or a JSONL file")


def _add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="arithmetic", help=PROMPTS_HELP)
    parser.add_argument("--prompt-field", default="prompt",
                        help="the field holding the prompt, used as is (default: prompt)")
    parser.add_argument("--template", default=None,
                        help="build the prompt with str.format over the row's fields instead, "
                             "e.g. $'Question: {question}\\nAnswer:' (bash $'' for a newline)")
    parser.add_argument("--answer-field", default="answer",
                        help="the field holding the reference answer (default: answer)")
    parser.add_argument("--id-field", default="id",
                        help="the field holding the task id (default: id; rows without one get "
                             "<source name>-<row number>)")


def _dataset_format(args: argparse.Namespace):
    from miles.tasks.datasets import DatasetFormat

    return DatasetFormat(prompt_field=args.prompt_field, prompt_template=args.template,
                         answer_field=args.answer_field, id_field=args.id_field)


def _add_rl_commands(sub: argparse._SubParsersAction) -> None:
    sft = sub.add_parser("sft", help="build the tiny model and its supervised warm start")
    sft.add_argument("--out", type=Path, required=True, help="directory to save the model to")
    sft.add_argument("--model", type=Path, default=None,
                     help="start from this model directory (default: a fresh tiny model)")
    _add_dataset_flags(sft)
    sft.add_argument("--steps", type=int, default=None)

    feed = sub.add_parser("feed", help="publish a dataset's prompts to a run's prompts topic")
    feed.add_argument("--bus", required=True, help="kafka://HOST:PORT")
    feed.add_argument("--run", required=True)
    _add_dataset_flags(feed)
    feed.add_argument("--split", default="train",
                      help="split of a built-in task or of a saved DatasetDict (train, test, ...); "
                           "a file or a single saved Dataset serves every split")
    feed.add_argument("--epochs", type=int, default=1)
    feed.add_argument("--seed", type=int, default=0)
    feed.add_argument("--no-shuffle", action="store_true")
    feed.add_argument("--limit", type=int, default=None)

    for name, text in (("produce", "run a rollout producer (python -m producers.rollout)"),
                       ("train", "run the trainer (torchrun -m consumers.trainer)"),
                       ("replay", "train a fresh trainer on a recorded trajectories topic "
                                  "(--config/--set/--algo as the trainer)"),
                       ("evaluate", "follow a live run: stream rewards and held-out accuracy "
                                    "(python -m consumers.evaluator)"),
                       ("record", "archive a run's trajectories to Parquet files "
                                  "(python -m consumers.recorder)")):
        daemon = sub.add_parser(name, help=text, add_help=False)
        daemon.add_argument("rest", nargs=argparse.REMAINDER)

    sub.add_parser("algorithms", help="list the algorithm presets (--algo NAME)")

    demo = sub.add_parser("demo", help="the whole RL loop on one machine, with a report")
    demo.add_argument("--bus", default="embedded://", help="embedded:// or kafka://HOST:PORT")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument("--max-staleness", type=int, default=None)
    demo.add_argument("--algo", default=None, help="algorithm preset (miles algorithms); "
                                                   "default grpo")
    demo.add_argument("--model-dir", type=Path, default=None,
                      help="start from this checkpoint instead of the built-in warm start")
    demo.add_argument("--prompts", default=None, help=f"{PROMPTS_HELP}, with prompt and answer "
                                                      "fields (default: arithmetic)")
    demo.add_argument("--reward", default=None)
    demo.add_argument("--rl-seconds", type=float, default=None)
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def _sft(args: argparse.Namespace) -> int:
    from miles.sft import SFTConfig, supervised_warm_start
    from miles.tasks.datasets import load_problems
    from miles.tasks.tiny_model import build_tiny_model

    config = SFTConfig() if args.steps is None else SFTConfig(steps=args.steps)
    base = args.model or build_tiny_model(args.out.with_name(args.out.name + "-base"))
    problems = load_problems(args.prompts, "train", fmt=_dataset_format(args))
    supervised_warm_start(base, args.out, problems, config)
    print(args.out)
    return 0


async def _feed(args: argparse.Namespace) -> int:
    from miles.bus import open_bus
    from miles.feeder import feed
    from miles.tasks.datasets import load_problems

    problems = load_problems(args.prompts, args.split, fmt=_dataset_format(args))
    async with open_bus(args.bus) as bus:
        count = await feed(bus, args.run, problems, epochs=args.epochs,
                           shuffle=not args.no_shuffle, seed=args.seed, limit=args.limit)
    print(f"published {count} prompts to miles.{args.run}.prompts")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from miles.config import load_with_preset
    from miles.demo import DemoConfig, main_demo
    from miles.rl.algorithm import preset_layers

    flags = {"bus": args.bus, "out_dir": args.out, "max_staleness": args.max_staleness,
             "model_dir": args.model_dir, "prompts": args.prompts,
             "reward": args.reward, "rl_seconds": args.rl_seconds}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + args.set
    return main_demo(load_with_preset(DemoConfig, preset_layers(), "learner.algorithm",
                                      algo=args.algo, overrides=overrides))


def _replay(argv: list[str]) -> int:
    from miles.config import log_config, parse_config_args
    from miles.rl.algorithm import preset_layers
    from miles.trainer.replay import ReplaySettings, run_replay

    configure_logging()
    try:
        settings = parse_config_args(ReplaySettings, argv, prog="miles replay",
                                     description="Train a fresh trainer on a recorded "
                                                 "trajectories topic.",
                                     presets=preset_layers(), algo_at="learner.algorithm")
        log_config(settings)
        summary = asyncio.run(run_replay(settings))
    except MilesError as err:
        print(f"miles replay: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


def _algorithms(args: argparse.Namespace) -> int:
    from miles.rl.algorithm import PRESETS

    for name, spec in PRESETS.items():
        print(f"{name:<13} {spec.summary}\n{'':<13} [{spec.paper}]")
    return 0


RANGE_HELP = "earliest, latest, an offset (in every partition), @EPOCH_MS or an ISO 8601 time"


def _add_experience_commands(sub: argparse._SubParsersAction) -> None:
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


def _add_export_model_command(sub: argparse._SubParsersAction) -> None:
    from miles.weights.export import DTYPES

    parser = sub.add_parser("export-model", help="write a trained policy as a Hugging Face "
                                                 "checkpoint (merged LoRA) or a peft adapter")
    parser.add_argument("--model-dir", type=Path, required=True,
                        help="the base model the run trained (trainer.model_dir)")
    parser.add_argument("--weights", type=Path, required=True,
                        help="a weight version folder (OUT_DIR/weights/vN), or the store "
                             "OUT_DIR/weights for its newest version")
    parser.add_argument("--out", type=Path, required=True, help="folder to create")
    parser.add_argument("--adapter-only", action="store_true",
                        help="write the LoRA adapter (peft format) instead of merged weights")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="dtype of the merged weights (auto: the base config's)")


def _export_model(args) -> int:
    from miles.weights.export import export_model

    version = export_model(args.model_dir, args.weights, args.out,
                           adapter_only=args.adapter_only, dtype=args.dtype)
    what = "adapter of" if args.adapter_only else "merged policy of"
    print(f"wrote the {what} {version} to {args.out}")
    return 0


def _add_keys_command(sub: argparse._SubParsersAction) -> None:
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


def _add_status_command(sub: argparse._SubParsersAction) -> None:
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

    async def follow(stop: asyncio.Event) -> int:
        async with _reading_bus(args.bus) as bus:
            async for line in tail(bus, args.run, args.topic, raw=args.raw, start=args.start,
                                   limit=args.limit, stop=stop):
                print(line, flush=True)
        return 0

    return run_service(follow)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_broker_commands(sub)
    _add_topic_commands(sub)
    _add_smoke_command(sub)
    _add_rl_commands(sub)
    _add_experience_commands(sub)
    _add_status_command(sub)
    _add_export_model_command(sub)
    _add_keys_command(sub)
    return parser


def _daemon(module: str):
    def run(argv: list[str]) -> int:
        return importlib.import_module(module).main(argv)
    return run


SETTINGS_COMMANDS = {"produce": _daemon("producers.rollout"), "train": _daemon("consumers.trainer"),
                     "evaluate": _daemon("consumers.evaluator"),
                     "record": _daemon("consumers.recorder"), "replay": _replay}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SETTINGS_COMMANDS:  # commands configured like the daemons
        return SETTINGS_COMMANDS[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "broker":
            return _broker(args)
        if args.command == "topics":
            return asyncio.run(_topics(args))
        if args.command == "smoke":
            return asyncio.run(_smoke(args))
        if args.command == "sft":
            return _sft(args)
        if args.command == "feed":
            return asyncio.run(_feed(args))
        if args.command == "demo":
            return _demo(args)
        if args.command == "algorithms":
            return _algorithms(args)
        if args.command == "export":
            return asyncio.run(_export(args))
        if args.command == "stats":
            return asyncio.run(_stats(args))
        if args.command == "tail":
            return _tail(args)
        if args.command == "status":
            return _status(args)
        if args.command == "export-model":
            return _export_model(args)
        if args.command == "keys":
            return _keys(args)
    except MilesError as err:
        print(f"miles {args.command}: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
