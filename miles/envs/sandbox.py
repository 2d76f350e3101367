"""`PythonSandbox`: runs untrusted Python code (a model's tool call) in a separate, limited process.

Each `run(code)` starts `python -I` in its own session (process group) with a throw-away working
directory, feeds the code on stdin and collects stdout/stderr, each read with a cap. Layers, from
the operating system inward (`Protections` says which are active on this machine):
- namespaces (root): `unshare --mount --net --pid`: no network (only a loopback interface,
  down); PID 1 of its own PID namespace, so killing it kills every process it started, even
  ones that left its process group; and a private root (`sandbox_root`): the system and
  interpreter directories read-only, its own tmpfs /tmp and /dev/shm, its working directory,
  nothing else of the host (no home, no out_dir or keys, no other run's directory);
- uid drop (root): the child becomes a uid of its own, held by no other run of the process
  (`uid`, `uid_count`), before the code runs, so the kernel enforces file permissions between
  runs and RLIMIT_NPROC (which never binds root) per run; its working directory is its own;
- resource limits (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE, no core
  files), set in the child by the bootstrap (`sandbox_child.py`) before the code runs;
- an audit hook in the child refusing file access outside the directory, process creation,
  sockets, ctypes and the known ways to rewrite the hook (`sandbox_child.py` lists them);
- the parent's wall clock and output caps: past either, the whole process group is SIGKILLed.
Choices: the first two need root (or CAP_SYS_ADMIN); unprivileged user namespaces could give a
non-root parent the namespaces and private root too, and are not used (the uid inside would be
the parent's own, and the probe would differ per distribution). Without root the hook is then
the only file and network barrier, and RLIMIT_NPROC is not set (it would count all of the user's
own processes). uids are unique within a process only: give concurrent producer processes on one
machine disjoint `uid` ranges. The parent never raises for the code's behaviour: every outcome
is a `SandboxResult` with a `reason`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from miles.errors import ConfigError
from miles.envs.sandbox_child import CPU_LIMIT_EXIT, SETUP_FAILED_EXIT
from miles.envs.sandbox_root import PROBE_TIMEOUT_S, private_root_prefix, visible_dirs

BOOTSTRAP_SOURCE = Path(__file__).with_name("sandbox_child.py").read_text(encoding="utf-8")
READ_CHUNK = 65536
KILL_WAIT_S = 5.0
"""How long to wait for a SIGKILLed child to be reaped before giving up on it."""
UNSHARE = ("unshare", "--mount", "--propagation", "private", "--net", "--pid", "--fork",
           "--kill-child", "--")
CHILD_ENV_PATH = "/usr/bin:/bin"
FIRST_UID = 1_000_000_000
"""The default first uid of the runs' uids: far above accounts' uids and the subordinate ranges
(100000 and up) that container runtimes hand out."""
UID_COUNT = 4096
"""How many uids a sandbox's runs take turns with: at most this many runs at a time."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one `run` may use; every limit applies to the whole child process."""

    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU): SIGXCPU ends the run, SIGKILL one second later."""
    wall_s: float = 10.0
    """Wall-clock seconds from start to exit; past it the process group is killed."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS); a larger allocation raises MemoryError in the code."""
    file_size_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE); a larger write fails with EFBIG."""
    max_processes: int = 16
    """RLIMIT_NPROC for the sandbox uid (processes and threads), applied only after a uid drop."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 65536
    """Cap of stdout and of stderr each; past it the output is truncated and the run killed."""
    tmp_mb: int = 64
    """Size of the run's own /tmp and /dev/shm each (tmpfs, in memory; with namespaces only)."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "file_size_mb", "max_processes", "max_open_files",
                     "max_output_bytes", "tmp_mb"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"sandbox.{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.wall_s) and self.wall_s > 0):
            raise ConfigError(f"sandbox.wall_s must be > 0 and finite, got {self.wall_s}")


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended. `reason`: ok, error (non-zero exit), memory_limit, cpu_limit,
    wall_timeout, output_limit, setup_failed (the sandbox's fault, not the code's: stderr says
    why) or `killed by SIGNAME`."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The child's exit status; negative: killed by that signal; None: not reaped."""
    timed_out: bool
    """The CPU or wall-clock limit ended the run."""
    truncated: bool
    """stdout or stderr reached `max_output_bytes` (the rest was dropped, the run killed)."""
    reason: str

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


@dataclass(frozen=True)
class Protections:
    """Which layers `PythonSandbox` uses on this machine (see the module docstring)."""

    namespaces: bool
    """Network, PID and mount namespaces, with the private root (`sandbox_root`)."""
    uid_drop: bool
    uids: range | None
    """The uids the runs take turns with, one per run at a time; None without a uid drop."""
    nproc_limit: bool
    audit_hook: bool

    def describe(self) -> str:
        net = "network+PID+mount namespaces, private read-only root" if self.namespaces else \
            "no namespaces (sockets and files outside refused by the audit hook only)"
        uid = (f"uid drop to a uid of its own per run ({self.uids.start}-{self.uids.stop - 1})"
               if self.uid_drop else "no uid drop (not root)")
        nproc = "RLIMIT_NPROC" if self.nproc_limit else "no RLIMIT_NPROC"
        hook = "audit hook" if self.audit_hook else "NO audit hook"
        return f"{net}; {uid}; {nproc}; {hook}; rlimits CPU/AS/FSIZE/NOFILE; wall clock; caps"


class PythonSandbox:
    """Runs code in a fresh limited child per call; safe to share between episodes."""

    def __init__(self, limits: SandboxLimits | None = None, *, python: str = sys.executable,
                 uid: int | None = None, uid_count: int = UID_COUNT, namespaces: bool = True,
                 audit_hook: bool = True, tmp_root: str | None = None):
        """`uid`: the first of the `uid_count` uids the runs take (as root); give concurrent
        processes on one machine disjoint ranges, as a run's uid is unique within its process."""
        self.limits = limits or SandboxLimits()
        self.python = python
        self.tmp_root = tmp_root
        if not (isinstance(uid_count, int) and uid_count >= 1):
            raise ConfigError(f"sandbox uid_count must be an integer >= 1, got {uid_count!r}")
        root = os.geteuid() == 0
        first = FIRST_UID if uid is None else uid
        uids = range(first, first + uid_count) if root else None
        self._visible = _private_root_dirs(python) if namespaces else None
        self.protections = Protections(
            namespaces=self._visible is not None, uid_drop=root, uids=uids, nproc_limit=root,
            audit_hook=audit_hook)

    async def run(self, code: str) -> SandboxResult:
        """Run `code` to completion or to a limit; never raises for what the code does."""
        with _RUN_UIDS.take(self.protections.uids) as uid:
            if uid is _NO_UID:
                return _setup_failed(f"no free uid in {self.protections.uids} (too many runs)")
            base = tempfile.mkdtemp(prefix="miles-sandbox-", dir=self.tmp_root)
            try:
                return await self._run_in(base, uid, code)
            finally:
                _remove_tree(base)

    async def _run_in(self, base: str, uid: int | None, code: str) -> SandboxResult:
        workdir = _make_workdir(base, uid)
        proc = await asyncio.create_subprocess_exec(
            *self._command(base, workdir, uid), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, cwd=workdir, env=_child_env(workdir))
        try:
            return await self._collect(proc, code)
        finally:
            await _kill(proc)

    def _command(self, base: str, workdir: str, uid: int | None) -> list[str]:
        mib = 1 << 20
        limits = {"cpu_s": self.limits.cpu_s, "RLIMIT_AS": self.limits.memory_mb * mib,
                  "RLIMIT_FSIZE": self.limits.file_size_mb * mib,
                  "RLIMIT_NOFILE": self.limits.max_open_files, "RLIMIT_CORE": 0,
                  "RLIMIT_NPROC": self.limits.max_processes if self.protections.nproc_limit
                  else None}
        config = {"workdir": workdir, "uid": uid, "gid": uid, "limits": limits,
                  "audit": self.protections.audit_hook}
        child = [self.python, "-I", "-c", BOOTSTRAP_SOURCE, json.dumps(config)]
        if not self.protections.namespaces:
            return child
        root = os.path.join(base, "root")
        os.mkdir(root, 0o700)
        return [*UNSHARE, *private_root_prefix(root, workdir, self._visible, self.limits.tmp_mb),
                *child]

    async def _collect(self, proc: asyncio.subprocess.Process, code: str) -> SandboxResult:
        cap = self.limits.max_output_bytes
        out, err = bytearray(), bytearray()
        overflow = []

        async def read(stream: asyncio.StreamReader, into: bytearray) -> None:
            while chunk := await stream.read(READ_CHUNK):
                room = cap - len(into)
                into.extend(chunk[:room])
                if len(chunk) > room:
                    overflow.append(True)
                    _signal_group(proc)
                    return

        timed_out = False
        try:
            async with asyncio.timeout(self.limits.wall_s):
                await asyncio.gather(_feed(proc, code), read(proc.stdout, out),
                                     read(proc.stderr, err))
                await proc.wait()
        except TimeoutError:
            timed_out = True
            await _kill(proc)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        reason = _reason(proc.returncode, stderr, wall=timed_out, truncated=bool(overflow))
        return SandboxResult(stdout, stderr, proc.returncode,
                             timed_out or reason == "cpu_limit", bool(overflow), reason)


def _reason(code: int | None, stderr: str, *, wall: bool, truncated: bool) -> str:
    if wall:
        return "wall_timeout"
    if truncated:
        return "output_limit"
    if code == SETUP_FAILED_EXIT and \
            stderr.rstrip().rpartition("\n")[2].startswith("sandbox setup failed"):
        return "setup_failed"
    if code in (CPU_LIMIT_EXIT, -signal.SIGXCPU):
        return "cpu_limit"
    if code and stderr.rstrip().rpartition("\n")[2].startswith("MemoryError"):
        return "memory_limit"
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return "error" if code else "ok"


async def _feed(proc: asyncio.subprocess.Process, code: str) -> None:
    try:
        proc.stdin.write(code.encode())
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # the child exited before reading it all
        return


def _signal_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the child's whole process group (its session, started for it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        return


async def _kill(proc: asyncio.subprocess.Process) -> None:
    _signal_group(proc)
    try:
        async with asyncio.timeout(KILL_WAIT_S):
            await proc.wait()
    except TimeoutError:  # unkillable (D state): leave it to the child watcher
        return


def _remove_tree(path: str) -> None:
    """Remove the working directory even if the code made parts of it unwritable."""
    def make_writable(function, failed_path, exc_info) -> None:
        os.chmod(os.path.dirname(failed_path), stat.S_IRWXU)
        function(failed_path)

    shutil.rmtree(path, onerror=make_writable)


def _child_env(workdir: str) -> dict[str, str]:
    return {"PATH": CHILD_ENV_PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _make_workdir(base: str, uid: int | None) -> str:
    """`base/work`, the run's own (0700, its uid's); `base`, root's, others may only pass."""
    workdir = os.path.join(base, "work")
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chmod(base, 0o711)
        os.chown(workdir, uid, uid)
    return workdir


def _setup_failed(why: str) -> SandboxResult:
    return SandboxResult("", f"sandbox setup failed: {why}\n", None, False, False, "setup_failed")


_NO_UID = object()


class _UidLease:
    """Hands each concurrent run of the process a uid no other run of it holds, so that runs
    cannot reach each other's files or processes, nor share RLIMIT_NPROC."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()

    @contextlib.contextmanager
    def take(self, uids: range | None):
        """Yields a free uid of `uids` (None when `uids` is None; `_NO_UID` when all are held)."""
        with self._lock:
            uid = next((u for u in uids if u not in self._held), _NO_UID) if uids else None
            if isinstance(uid, int):
                self._held.add(uid)
        try:
            yield uid
        finally:
            if isinstance(uid, int):
                with self._lock:
                    self._held.discard(uid)


_RUN_UIDS = _UidLease()
_PRIVATE_ROOTS: dict[str, tuple[str, ...] | None] = {}


def _private_root_dirs(python: str) -> tuple[str, ...] | None:
    """The directories the private root shows `python`, or None where namespaces or the root
    cannot be made here (not root, or a container without the capability); probed once per
    interpreter and process, by starting that interpreter in one."""
    if python not in _PRIVATE_ROOTS:
        _PRIVATE_ROOTS[python] = _probe_private_root(python)
    return _PRIVATE_ROOTS[python]


def _probe_private_root(python: str) -> tuple[str, ...] | None:
    base = tempfile.mkdtemp(prefix="miles-sandbox-probe-")
    try:
        visible = visible_dirs(python)
        workdir = _make_workdir(base, None)
        os.mkdir(os.path.join(base, "root"), 0o700)
        command = [*UNSHARE, *private_root_prefix(os.path.join(base, "root"), workdir, visible, 1),
                   python, "-I", "-c", "pass"]
        probe = subprocess.run(command, capture_output=True, timeout=PROBE_TIMEOUT_S,
                               check=False, env=_child_env(workdir))
        return visible if probe.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    finally:
        _remove_tree(base)
