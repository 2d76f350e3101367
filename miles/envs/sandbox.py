"""`PythonSandbox`: runs untrusted Python code (a model's tool call) in a separate, limited process.

Each `run(code)` starts `python -I` in its own session (process group) with a throw-away working
directory, feeds the code on stdin and collects stdout/stderr, each read with a cap. Layers, from
the operating system inward (`Protections` says which are active on this machine):
- namespaces: when `unshare --net --pid` works (root, or where permitted), the child has no
  network (only a loopback interface, down) and is PID 1 of its own PID namespace, so killing
  it kills every process it started, even ones that left its process group;
- uid drop: started as root, the child becomes an unprivileged uid (`nobody` by default) before
  the user's code runs, so the kernel enforces file permissions and RLIMIT_NPROC (which never
  binds root); the working directory is chowned to that uid;
- resource limits (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE, no core
  files), set in the child by the bootstrap (`sandbox_child.py`) before the code runs;
- an audit hook in the child refusing file access outside the directory, process creation,
  sockets and ctypes (`sandbox_child.py` lists them);
- the parent's wall clock and output caps: past either, the whole process group is SIGKILLed.
Choices: RLIMIT_NPROC counts every process and thread of the uid machine-wide, so concurrent
sandboxes under one uid share `max_processes` (give each pool its own `uid` if that matters);
without root no uid drop happens and RLIMIT_NPROC is not set (it would count all of the user's
own processes), leaving the audit hook to refuse fork. The parent never raises for the code's
behaviour: every outcome is a `SandboxResult` with a `reason`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from miles.errors import ConfigError
from miles.envs.sandbox_child import CPU_LIMIT_EXIT, SETUP_FAILED_EXIT

BOOTSTRAP_SOURCE = Path(__file__).with_name("sandbox_child.py").read_text(encoding="utf-8")
READ_CHUNK = 65536
KILL_WAIT_S = 5.0
"""How long to wait for a SIGKILLed child to be reaped before giving up on it."""
PROBE_TIMEOUT_S = 10.0
UNSHARE = ("unshare", "--net", "--pid", "--fork", "--kill-child", "--")
CHILD_ENV_PATH = "/usr/bin:/bin"
FALLBACK_UID = 65534


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

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "file_size_mb", "max_processes", "max_open_files",
                     "max_output_bytes"):
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
    uid_drop: bool
    uid: int | None
    nproc_limit: bool
    audit_hook: bool

    def describe(self) -> str:
        net = "network+PID namespaces" if self.namespaces else \
            "no namespaces (sockets refused by the audit hook only)"
        uid = f"uid drop to {self.uid}" if self.uid_drop else "no uid drop (not root)"
        nproc = "RLIMIT_NPROC" if self.nproc_limit else "no RLIMIT_NPROC"
        hook = "audit hook" if self.audit_hook else "NO audit hook"
        return f"{net}; {uid}; {nproc}; {hook}; rlimits CPU/AS/FSIZE/NOFILE; wall clock; caps"


class PythonSandbox:
    """Runs code in a fresh limited child per call; safe to share between episodes."""

    def __init__(self, limits: SandboxLimits | None = None, *, python: str = sys.executable,
                 uid: int | None = None, namespaces: bool = True, audit_hook: bool = True,
                 tmp_root: str | None = None):
        self.limits = limits or SandboxLimits()
        self.python = python
        self.tmp_root = tmp_root
        root = os.geteuid() == 0
        self._uid, self._gid = _unprivileged_ids(uid) if root else (None, None)
        self.protections = Protections(
            namespaces=namespaces and _namespaces_work(), uid_drop=root, uid=self._uid,
            nproc_limit=root, audit_hook=audit_hook)

    async def run(self, code: str) -> SandboxResult:
        """Run `code` to completion or to a limit; never raises for what the code does."""
        workdir = tempfile.mkdtemp(prefix="miles-sandbox-", dir=self.tmp_root)
        try:
            if self._uid is not None:
                os.chown(workdir, self._uid, self._gid)
            proc = await asyncio.create_subprocess_exec(
                *self._command(workdir), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, cwd=workdir, env=_child_env(workdir))
            try:
                return await self._collect(proc, code)
            finally:
                await _kill(proc)
        finally:
            _remove_tree(workdir)

    def _command(self, workdir: str) -> list[str]:
        mib = 1 << 20
        limits = {"cpu_s": self.limits.cpu_s, "RLIMIT_AS": self.limits.memory_mb * mib,
                  "RLIMIT_FSIZE": self.limits.file_size_mb * mib,
                  "RLIMIT_NOFILE": self.limits.max_open_files, "RLIMIT_CORE": 0,
                  "RLIMIT_NPROC": self.limits.max_processes if self.protections.nproc_limit
                  else None}
        config = {"workdir": workdir, "uid": self._uid, "gid": self._gid, "limits": limits,
                  "audit": self.protections.audit_hook}
        prefix = list(UNSHARE) if self.protections.namespaces else []
        return [*prefix, self.python, "-I", "-c", BOOTSTRAP_SOURCE, json.dumps(config)]

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
    if code == SETUP_FAILED_EXIT and stderr.startswith("sandbox setup failed"):
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


def _unprivileged_ids(uid: int | None) -> tuple[int, int]:
    if uid is not None:
        return uid, uid
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return FALLBACK_UID, FALLBACK_UID
    return entry.pw_uid, entry.pw_gid


_NAMESPACES: list[bool] = []


def _namespaces_work() -> bool:
    """Whether `unshare --net --pid` can be used here (probed once per process)."""
    if not _NAMESPACES:
        try:
            probe = subprocess.run([*UNSHARE, "true"], capture_output=True,
                                   timeout=PROBE_TIMEOUT_S, check=False)
            _NAMESPACES.append(probe.returncode == 0)
        except (OSError, subprocess.TimeoutExpired):
            _NAMESPACES.append(False)
    return _NAMESPACES[0]
