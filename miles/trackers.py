"""Experiment trackers: the numbers Miles already writes, also sent to TensorBoard, Weights &
Biases or MLflow, and sample tables of what the trainer trained on.

`TrackerSettings.report_to` names the trackers (none by default). Each is an optional extra,
imported here and nowhere else, and only when named; a name that is unknown, or whose library is
not installed, is a ConfigError when the settings are read, so a daemon fails before it loads a
model. Every process is one tracker run, `<run_name>-<role>` (roles: `trainer`, the producer's
id, `evaluator`), grouped by `run_name` (a W&B group, an MLflow tag, a TensorBoard folder), and
keeps the metric names Miles uses elsewhere (`trainer/loss`, `producer/generate_s`,
`held_out/accuracy`), so a curve in a tracker is the same series as in metrics.jsonl.

Simplifications: only numbers are logged (the lag histogram and the like stay in the JSONL
files); each library reads its own environment for where to send data (`WANDB_MODE=offline`,
W&B credentials, `MLFLOW_TRACKING_URI`), and without MLFLOW_TRACKING_URI MLflow writes a SQLite
store in `dir` (its plain-file store is in maintenance mode). No call waits on the network or
the disk, nor on the trackers' own work: every call is made by one worker thread per process
(`Trackers`), in order; besides, TensorBoard writes files from its own thread, W&B hands
records to its service process, MLflow logs metrics asynchronously.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Protocol

from miles.errors import ConfigError, MilesError

SAMPLES_KEY = "samples"  # the sample tables' name in every tracker
MLFLOW_PENDING = 64  # asynchronous MLflow batches in flight before one waits for them
TRACKERS: dict[str, tuple[str, ...]] = {  # name (and pip extra) -> the modules it needs
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic", "pandas"),
}


@dataclass(frozen=True, kw_only=True)
class TrackerSettings:
    report_to: tuple[str, ...] = ()  # trackers: tensorboard, wandb, mlflow (each a pip extra)
    project: str = "miles"  # the W&B project and the MLflow experiment
    run_name: str = ""  # groups this run's processes in the trackers ("": the run, miles.<run>.*)
    dir: Path | None = None  # tracker files (TensorBoard, W&B offline, MLflow's SQLite store);
    # None: <out_dir>/trackers for the trainer, beside the evaluator's `out`, runs/<run>/trackers
    samples_every: int = 0  # trainer: a table of trained samples every this many steps (0: none)
    samples_rows: int = 16  # rows per sample table

    def __post_init__(self) -> None:
        for name in self.report_to:
            if name not in TRACKERS:
                raise ConfigError(f"report_to: unknown tracker {name!r}; choices: "
                                  f"{', '.join(TRACKERS)}")
            missing = [m for m in TRACKERS[name] if importlib.util.find_spec(m) is None]
            if missing:
                raise ConfigError(f"report_to names {name!r}, but {', '.join(missing)} is not "
                                  f"installed: pip install 'miles[{name}]' (all trackers: "
                                  f"'miles[trackers]')")
        if self.samples_every < 0:
            raise ConfigError(f"samples_every must be >= 0, got {self.samples_every}")
        if self.samples_rows < 1:
            raise ConfigError(f"samples_rows must be >= 1, got {self.samples_rows}")


@dataclass(frozen=True)
class TrackedRun:
    """What every tracker is told about the process it tracks."""

    project: str
    group: str  # the Miles run
    role: str  # trainer, a producer id, evaluator
    dir: Path
    config: dict[str, Any]  # the process's resolved settings

    @property
    def name(self) -> str:
        return f"{self.group}-{self.role}"


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def table(self, rows: list[dict[str, Any]], step: int) -> None: ...

    def close(self) -> None: ...


class Trackers:
    """The trackers of one process; with none, every call does nothing. Calls return at once:
    one worker thread makes them, in order, so a tracker's own work (building a table, a
    protobuf, a SQLite write) never lengthens the caller's step. A tracker that raises stops
    this object: the error is raised to the caller at its next call (or at `close`)."""

    def __init__(self, settings: TrackerSettings | None = None, backends: Iterable[Tracker] = ()):
        self.settings = settings or TrackerSettings()
        self.backends = list(backends)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trackers") \
            if self.backends else None
        self._error: BaseException | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Send the numbers of `metrics` (other values are left out) at x = `step`."""
        if self._worker is None:
            return
        numbers = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._submit("log", numbers, step)

    def samples_due(self, step: int) -> bool:
        every = self.settings.samples_every
        return bool(every) and step % every == 0

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """One sample table (rows of equal keys, not changed afterwards) at x = `step`."""
        if rows and self._worker is not None:
            self._submit("table", rows, step)

    def close(self) -> None:
        """Make the calls still queued, close every tracker, then raise a tracker's error."""
        if self._worker is not None:
            self._worker.submit(self._close_all)
            self._worker.shutdown(wait=True)
            self._worker = None
            self._raise()

    def _submit(self, method: str, *args: Any) -> None:
        self._raise()
        self._worker.submit(self._call, method, args)

    def _call(self, method: str, args: tuple) -> None:
        """In the worker thread: `method` of every tracker, unless one has failed."""
        if self._error is not None:
            return
        try:
            for backend in self.backends:
                getattr(backend, method)(*args)
        except BaseException as err:  # handed to the caller's thread by `_raise`
            self._error = err

    def _close_all(self) -> None:
        """In the worker thread: close every tracker, also after one failed (W&B, MLflow end
        their runs)."""
        for backend in self.backends:
            try:
                backend.close()
            except BaseException as err:  # raised by `close` in the caller's thread
                self._error = self._error or err

    def _raise(self) -> None:
        if self._error is not None:
            raise MilesError(f"trackers: {type(self._error).__name__}: {self._error}") \
                from self._error

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trackers(settings: TrackerSettings, *, role: str, run: str, default_dir: Path,
                  config: Any = None) -> Trackers:
    """Start one tracker run per name in `settings.report_to` for this process (`role` of Miles
    run `run`); `config`, a settings dataclass, is recorded with it. Close the result."""
    run_info = TrackedRun(project=settings.project, group=settings.run_name or run, role=role,
                          dir=Path(settings.dir or default_dir), config=_plain(config))
    backends: list[Tracker] = []
    try:
        for name in settings.report_to:
            backends.append(_start(name, run_info))
    except BaseException:
        for backend in backends:
            backend.close()
        raise
    return Trackers(settings, backends)


def _plain(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    data = asdict(config) if is_dataclass(config) else dict(config)
    return json.loads(json.dumps(data, default=str))


def _start(name: str, run: TrackedRun) -> Tracker:
    run.dir.mkdir(parents=True, exist_ok=True)
    try:
        return BACKENDS[name](run)
    except ConfigError:
        raise
    except Exception as err:  # the library's own errors (no login, a bad URI): at start-up
        raise ConfigError(f"trackers: {name} did not start: {type(err).__name__}: {err}") from err


class TensorBoardTracker:
    """Event files in <dir>/tensorboard/<group>/<role> (`tensorboard --logdir <dir>/tensorboard`
    shows every process of every run side by side); sample tables as markdown text."""

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.dir / "tensorboard" / run.group / run.role))
        self.writer.add_text("config", f"```\n{json.dumps(run.config, indent=2)}\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        wall = time.time()
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step, walltime=wall)

    def table(self, rows: list[dict[str, Any]], step: int) -> None:
        self.writer.add_text(SAMPLES_KEY, markdown_table(rows), step)

    def close(self) -> None:
        self.writer.close()


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """`rows` as a markdown table (what TensorBoard's text tab renders)."""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class WandbTracker:
    """A W&B run of the project, in the run's group; its mode (online, `offline`) and account
    come from W&B's environment. Several in one process (the demo) are separate runs."""

    def __init__(self, run: TrackedRun):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=run.project, name=run.name, group=run.group,
                              job_type=run.role, dir=str(run.dir), config=run.config,
                              reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def table(self, rows: list[dict[str, Any]], step: int) -> None:
        columns = list(rows[0])
        table = self.wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self.run.log({SAMPLES_KEY: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in the project's experiment, tagged with the Miles run and role; metrics
    logged asynchronously, sample tables as `samples/step_NNNNNN.json` (`mlflow.load_table`)."""

    def __init__(self, run: TrackedRun):
        from mlflow.tracking import MlflowClient

        uri = mlflow_uri(run.dir)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            run.project, artifact_location=mlflow_artifacts(uri, run.dir))
        self.run_id = self.client.create_run(
            experiment_id, run_name=run.name,
            tags={"miles.run": run.group, "miles.role": run.role}).info.run_id
        self.client.log_dict(self.run_id, run.config, "config.json")
        self.pending = []  # the asynchronous metric batches not known to be written

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        if len(self.pending) >= MLFLOW_PENDING:
            self._wait()  # long written by now, unless the store falls behind (then: wait)
        self.pending.append(self.client.log_batch(
            self.run_id, [Metric(k, v, stamp, step) for k, v in metrics.items()],
            synchronous=False))

    def table(self, rows: list[dict[str, Any]], step: int) -> None:
        self.client.log_table(self.run_id, {c: [r[c] for r in rows] for c in rows[0]},
                              f"{SAMPLES_KEY}/step_{step:06d}.json")

    def close(self) -> None:
        self._wait()
        self.client.set_terminated(self.run_id)

    def _wait(self) -> None:
        """Until the pending batches are written (`mlflow.flush_async_logging` would open the
        default store, an mlflow.db in the working directory)."""
        for operations in self.pending:
            operations.wait()
        self.pending = []


def mlflow_uri(directory: Path) -> str:
    """MLFLOW_TRACKING_URI when set (a server, a database), else a SQLite store in `directory`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(directory / 'mlflow.db').resolve()}"


def mlflow_artifacts(uri: str, directory: Path) -> str | None:
    """Artifacts of a new experiment beside its local SQLite store (a server decides its own)."""
    return (directory / "mlflow-artifacts").resolve().as_uri() if uri.startswith("sqlite:") \
        else None


BACKENDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
