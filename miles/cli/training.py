"""`miles run`, `sft`, `feed`, `demo`, `algorithms`, `export-model`, and the commands configured
like the daemons (`produce`, `train`, `evaluate`, `record`, `replay`: `--config`/`--set`/`--algo`)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from pathlib import Path

from miles.errors import MilesError
from miles.service import configure_logging


PROMPTS_HELP = ("a built-in task (arithmetic, arithmetic-plain, multiplication), a .parquet file, a directory "
                "written by datasets' save_to_disk, or a JSONL file")


def _add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="arithmetic", help=PROMPTS_HELP)
    parser.add_argument("--prompt-field", default="prompt",
                        help="the field holding the prompt, used as is (default: prompt)")
    parser.add_argument("--template", default=None,
                        help="build the prompt with str.format over the row's fields instead, "
                             "e.g. $'Question: {question}\\nAnswer:' (bash $'' for a newline)")
    parser.add_argument("--messages-field", default="messages",
                        help="in a row without the prompt field: the conversation, a list of "
                             "{role, content} rendered by the chat template (default: messages)")
    parser.add_argument("--answer-field", default="answer",
                        help="the field holding the reference answer (default: answer)")
    parser.add_argument("--id-field", default="id",
                        help="the field holding the task id (default: id; rows without one get "
                             "<source name>-<row number>)")


def _dataset_format(args: argparse.Namespace):
    from miles.tasks.datasets import DatasetFormat

    return DatasetFormat(prompt_field=args.prompt_field, prompt_template=args.template,
                         messages_field=args.messages_field, answer_field=args.answer_field,
                         id_field=args.id_field)


def add_rl_commands(sub: argparse._SubParsersAction) -> None:
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

    run = sub.add_parser("run", help="a whole run on one machine from a config file: feeder, "
                                     "producers and trainer until max_steps, epochs or "
                                     "max_seconds; resumable")
    run.add_argument("config", type=Path, nargs="?", default=None,
                     help="TOML or YAML file (examples/); settings not in it take their defaults")
    run.add_argument("--resume", action="store_true",
                     help="carry on the run in out_dir from its newest checkpoint (after a kill "
                          "or a stop): no group trained twice or skipped")
    run.add_argument("--algo", default=None, help="algorithm preset (miles algorithms); "
                                                  "default grpo")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override one setting, e.g. --set max_steps=100")

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
    demo.add_argument("--env", default=None,
                      help="multi-turn: a built-in demo (multiplication: two-digit products "
                           "with the calculator, its warm start and limits) or an environment "
                           "for the producer (calculator, python, module:Name) with --prompts")
    demo.add_argument("--rl-seconds", type=float, default=None,
                      help="seconds of RL (max_seconds; default 120)")
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
    from miles.demo import DemoConfig, env_overrides, main_demo
    from miles.rl.algorithm import preset_layers

    flags = {"bus": args.bus, "out_dir": args.out, "max_staleness": args.max_staleness,
             "model_dir": args.model_dir, "prompts": args.prompts,
             "reward": args.reward, "max_seconds": args.rl_seconds}
    overrides = [*env_overrides(args.env), *(f"{k}={v}" for k, v in flags.items()
                                             if v is not None), *args.set]
    return main_demo(load_with_preset(DemoConfig, preset_layers(), "learner.algorithm",
                                      algo=args.algo, overrides=overrides))


def _run(args: argparse.Namespace) -> int:
    from miles.config import load_with_preset
    from miles.rl.algorithm import preset_layers
    from miles.run import RunConfig, main_run

    if args.config is not None and not args.config.is_file():
        raise MilesError(f"config file {args.config} does not exist")
    config = load_with_preset(RunConfig, preset_layers(), "learner.algorithm", algo=args.algo,
                              path=args.config, overrides=args.set)
    main_run(config, resume=args.resume)
    return 0


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


def add_export_model_command(sub: argparse._SubParsersAction) -> None:
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


def _daemon(module: str):
    def run(argv: list[str]) -> int:
        return importlib.import_module(module).main(argv)
    return run


SETTINGS_COMMANDS = {"produce": _daemon("producers.rollout"), "train": _daemon("consumers.trainer"),
                     "evaluate": _daemon("consumers.evaluator"),
                     "record": _daemon("consumers.recorder"), "replay": _replay}


COMMANDS = {"run": _run, "sft": _sft, "feed": lambda args: asyncio.run(_feed(args)), "demo": _demo,
            "algorithms": _algorithms, "export-model": _export_model}
