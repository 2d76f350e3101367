"""PythonSandbox against real child processes: limits, refusals, clean-up.

Each hostile test asserts the specific way it was stopped. Tests of one OS layer alone (the
audit hook switched off) need root, as the uid drop and RLIMIT_NPROC only exist then; they run
under a uid no account uses (TEST_UID), so "no process left" is exact, and with a process
limit of a handful so a fork bomb stays tiny on a shared machine.
"""

import asyncio
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from miles.envs.sandbox import PythonSandbox, SandboxLimits
from miles.errors import ConfigError

TEST_UID = 61234
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the uid drop and RLIMIT_NPROC need root")
FAST = SandboxLimits(cpu_s=2, wall_s=10, max_processes=4)


def processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                pids.append(int(entry))
        except FileNotFoundError:
            continue
    return pids


async def wait_until_no_processes(uid: int, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(uid)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


@pytest.fixture
def sandbox():
    return PythonSandbox(FAST, uid=TEST_UID)


async def test_ordinary_code_works_and_its_directory_is_removed(sandbox):
    code = ("import math, os\n"
            "open('notes.txt', 'w').write(str(math.factorial(20)))\n"
            "print(open('notes.txt').read(), os.getcwd())\n")
    result = await sandbox.run(code)
    value, workdir = result.stdout.split()
    assert (result.reason, result.exit_code, result.stderr) == ("ok", 0, "")
    assert value == "2432902008176640000"
    assert Path(workdir).parent.name.startswith("miles-sandbox-")
    assert not Path(workdir).exists()


async def test_a_python_error_is_reported_not_raised(sandbox):
    result = await sandbox.run("print('before')\n1 / 0\n")
    assert (result.reason, result.exit_code, result.stdout) == ("error", 1, "before\n")
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


@needs_root
async def test_the_code_runs_as_the_unprivileged_uid(sandbox):
    result = await sandbox.run("import os; print(os.getuid(), os.geteuid())")
    assert result.stdout.split() == [str(TEST_UID)] * 2
    assert sandbox.protections.uid_drop and sandbox.protections.nproc_limit


async def test_fork_is_refused_by_the_audit_hook(sandbox):
    result = await sandbox.run("import os\nwhile True:\n    os.fork()\n")
    assert result.reason == "error"
    assert "PermissionError: sandbox: os.fork is not allowed" in result.stderr


@needs_root
async def test_a_fork_bomb_is_contained_by_rlimit_nproc_alone():
    bomb = PythonSandbox(SandboxLimits(cpu_s=2, wall_s=2, max_processes=4), uid=TEST_UID,
                         audit_hook=False)
    code = ("import os\nreported = False\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError as err:\n        if not reported:\n"
            "            print('refused', err.errno, flush=True)\n            reported = True\n")
    result = await bomb.run(code)
    assert result.reason in ("wall_timeout", "cpu_limit") and result.timed_out
    assert "refused 11" in result.stdout  # EAGAIN: the kernel refused more processes
    assert len(result.stdout.splitlines()) <= 4  # each process reports once, at most 4 existed
    assert await wait_until_no_processes(TEST_UID) == []
    after = await PythonSandbox(FAST, uid=TEST_UID).run("print(6 * 7)")
    assert (after.reason, after.stdout) == ("ok", "42\n")


async def test_an_endless_loop_is_stopped_by_the_cpu_limit():
    started = time.monotonic()
    result = await PythonSandbox(SandboxLimits(cpu_s=1, wall_s=30)).run("while True: pass")
    assert (result.reason, result.timed_out, result.exit_code) == ("cpu_limit", True, 152)
    assert time.monotonic() - started < 20


async def test_a_sleeping_child_is_killed_at_the_wall_clock():
    started = time.monotonic()
    result = await PythonSandbox(SandboxLimits(wall_s=1)).run("import time; time.sleep(60)")
    assert (result.reason, result.timed_out, result.exit_code) == \
        ("wall_timeout", True, -signal.SIGKILL)
    assert time.monotonic() - started < 10


async def test_a_huge_output_is_truncated_and_the_child_killed():
    sandbox = PythonSandbox(SandboxLimits(max_output_bytes=1000, wall_s=30))
    result = await sandbox.run("print('x' * 10**8)\nprint('never reached')")
    assert (result.reason, result.truncated, result.exit_code) == \
        ("output_limit", True, -signal.SIGKILL)
    assert result.stdout == "x" * 1000


async def test_a_gigabyte_string_does_not_fit_the_default_memory_limit(sandbox):
    result = await sandbox.run("print('x' * 10**9)")
    assert (result.reason, result.stdout) == ("memory_limit", "")
    assert result.stderr.rstrip().endswith("MemoryError")


async def test_a_10_gb_allocation_fails_with_memory_error(sandbox):
    result = await sandbox.run("block = bytearray(10 * 1024**3)")
    assert (result.reason, result.exit_code) == ("memory_limit", 1)
    assert result.stderr.rstrip().endswith("MemoryError")


async def test_a_file_larger_than_the_limit_cannot_be_written():
    sandbox = PythonSandbox(SandboxLimits(file_size_mb=1))
    result = await sandbox.run("open('big', 'wb').write(b'x' * (2 << 20))")
    assert result.reason == "error"
    assert "OSError: [Errno 27] File too large" in result.stderr


async def test_reading_outside_the_directory_is_refused(sandbox):
    result = await sandbox.run("print(open('/etc/passwd').read())")
    assert "root:" not in result.stdout
    assert "PermissionError: sandbox: reading '/etc/passwd' is not allowed" in result.stderr
    listing = await sandbox.run("import os; print(os.listdir('/'))")
    assert "PermissionError: sandbox: listing '/' is not allowed" in listing.stderr


@pytest.fixture
def secret_beside_the_sandboxes():
    """A root-only file in the directory the sandboxes' directories are created in."""
    path = Path("/tmp") / f"miles-secret-{uuid.uuid4().hex}"
    path.write_text("secret")
    path.chmod(0o600)
    yield path
    path.unlink()


def layers(hook: str, private_root: str, uid_drop: str) -> list:
    """(audit_hook, namespaces, the refusal expected): each layer alone, the hook first."""
    return [(True, True, hook), pytest.param(False, True, private_root, marks=needs_root),
            pytest.param(False, False, uid_drop, marks=needs_root)]


@pytest.mark.parametrize("audit_hook, namespaces, expected", layers(
    "sandbox: reading", "FileNotFoundError: [Errno 2]", "PermissionError: [Errno 13]"))
async def test_reading_a_file_next_door_is_refused(secret_beside_the_sandboxes, audit_hook,
                                                   namespaces, expected):
    sandbox = PythonSandbox(FAST, uid=TEST_UID, audit_hook=audit_hook, namespaces=namespaces)
    result = await sandbox.run(f"print(open('../../{secret_beside_the_sandboxes.name}').read())")
    assert "secret" not in result.stdout and result.reason == "error"
    assert expected in result.stderr


@pytest.mark.parametrize("audit_hook, namespaces, expected", layers(
    "sandbox: writing", "OSError: [Errno 30] Read-only file system",
    "PermissionError: [Errno 13]"))
async def test_writing_outside_the_directory_is_refused(audit_hook, namespaces, expected):
    target = Path("/usr/local") / f"miles-escape-{uuid.uuid4().hex}"
    sandbox = PythonSandbox(FAST, uid=TEST_UID, audit_hook=audit_hook, namespaces=namespaces)
    result = await sandbox.run(f"open({str(target)!r}, 'w').write('escaped')")
    assert not target.exists() and result.reason == "error"
    assert expected in result.stderr


async def test_writing_into_tmp_beside_the_directory_is_refused_by_the_hook(sandbox):
    target = Path("/tmp") / f"miles-escape-{uuid.uuid4().hex}"
    result = await sandbox.run(f"open({str(target)!r}, 'w').write('escaped')")
    assert not target.exists()
    assert "PermissionError: sandbox: writing" in result.stderr


async def test_opening_a_socket_is_refused(sandbox):
    result = await sandbox.run("import socket; socket.socket()")
    assert "PermissionError: sandbox: socket.__new__ is not allowed" in result.stderr


@needs_root
async def test_without_the_hook_the_network_namespace_has_no_route():
    sandbox = PythonSandbox(FAST, uid=TEST_UID, audit_hook=False)
    if not sandbox.protections.namespaces:
        pytest.skip("unshare --net is not permitted here")
    code = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))"
    result = await sandbox.run(code)
    assert "OSError: [Errno 101] Network is unreachable" in result.stderr


@pytest.mark.parametrize("code, refusal", [
    ("import ctypes", "ImportError: sandbox: import of 'ctypes' is not allowed"),
    ("import _posixsubprocess", "import of '_posixsubprocess' is not allowed"),
    ("import os; os.system('true')", "sandbox: os.system is not allowed"),
    ("import os; os.execv('/bin/true', ['true'])", "sandbox: os.exec is not allowed"),
    ("import os; os.kill(1, 9)", "sandbox: os.kill is not allowed"),
    ("import os; os.symlink('/etc/passwd', 'p')", "sandbox: os.symlink is not allowed"),
    ("import resource; resource.setrlimit(resource.RLIMIT_CPU, (9, 9))",
     "sandbox: resource.setrlimit is not allowed"),
])
async def test_escapes_are_refused(sandbox, code, refusal):
    result = await sandbox.run(code)
    assert result.reason == "error" and refusal in result.stderr


@needs_root
async def test_a_directory_the_uid_cannot_enter_is_reported_as_setup_failed(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    sandbox = PythonSandbox(FAST, uid=TEST_UID, tmp_root=str(private), namespaces=False)
    result = await sandbox.run("print(1)")  # with namespaces, the private root shows it anyway
    assert result.reason == "setup_failed" and result.stdout == ""
    assert "sandbox setup failed: PermissionError" in result.stderr
    assert list(private.iterdir()) == []


@pytest.fixture
def run_secret():
    """A producer's out_dir with a signing key any uid could read (a umask of 022): only a view
    of the file system without it keeps the code from reading it."""
    out_dir = Path("/tmp") / f"miles-out-{uuid.uuid4().hex}"
    (out_dir / "keys").mkdir(parents=True)
    for path in (out_dir, out_dir / "keys"):
        path.chmod(0o755)
    key = out_dir / "keys" / "control.key"
    key.write_text("SECRET-KEY-MATERIAL")
    key.chmod(0o644)
    yield key
    shutil.rmtree(out_dir)


def escape_payload(secret: Path, marker: str) -> str:
    """Code that reads `secret` and writes `marker` into /tmp and /dev/shm, printing each error."""
    return (f"for action in (lambda: print(open({str(secret)!r}).read()),\n"
            f"               lambda: open('/tmp/{marker}', 'w').write('escaped'),\n"
            f"               lambda: open('/dev/shm/{marker}', 'w').write('escaped')):\n"
            "    try:\n        action()\n    except OSError as err:\n"
            "        print('refused:', err)\n")


def assert_contained(result, secret: Path, marker: str) -> None:
    assert "SECRET-KEY-MATERIAL" not in result.stdout, result.stdout
    for directory in ("/tmp", "/dev/shm"):
        leaked = Path(directory) / marker
        assert not leaked.exists(), f"{leaked} written from inside the sandbox"


NO_OP_HOOK = ("def make(own, readable):\n    def hook(event, args):\n        (own, readable)\n"
              "    return hook\n")
HOOK_ESCAPES = {  # each tries to switch the audit hook off; the payload runs whatever happened
    "gc.get_objects (the audit of issue 17)":
        "import gc\nhook = next(f for f in gc.get_objects() if type(f).__name__ == 'function'"
        " and f.__name__ == 'hook')\nhook.__code__ = make(1, 2).__code__\n",
    "gc.get_referrers of the bootstrap's globals":
        "import gc, sys\nboot = sys.modules['__main__'].__dict__\nhook = next(f for f in "
        "gc.get_referrers(boot) if getattr(f, '__name__', '') == 'hook')\n"
        "hook.__code__ = make(1, 2).__code__\n",
    "walking the frames":
        "import sys\nframe = sys._getframe()\nwhile 'hook' not in frame.f_locals:\n"
        "    frame = frame.f_back\nframe.f_locals['hook'].__code__ = make(1, 2).__code__\n",
    "patching the bootstrap's globals":
        "import sys\nsys.modules['__main__']._inside = lambda path, roots: True\n",
    "patching a builtin": "import builtins\nbuiltins.any = lambda items: True\n",
    "patching os.path.realpath": "import os\nos.path.realpath = lambda path: os.getcwd()\n",
    "rebinding what the hook's functions hold, from a refusal's traceback":
        "try:\n    open('/etc/hostname')\nexcept PermissionError as err:\n"
        "    tb = err.__traceback__\nwhile tb:\n"
        "    for value in list(tb.tb_frame.f_locals.values()):\n"
        "        for cell in getattr(value, '__closure__', None) or ():\n"
        "            if type(cell.cell_contents) is tuple:\n"
        "                cell.cell_contents = ('',)\n"
        "        if getattr(value, '__kwdefaults__', None):\n"
        "            value.__kwdefaults__ = {k: ('',) if type(v) is tuple else v\n"
        "                                    for k, v in value.__kwdefaults__.items()}\n"
        "    tb = tb.tb_next\n",
}


@pytest.mark.parametrize("escape", HOOK_ESCAPES.values(), ids=HOOK_ESCAPES.keys())
async def test_the_audit_hook_cannot_be_switched_off(sandbox, run_secret, escape):
    marker = f"miles-escape-{uuid.uuid4().hex}"
    attempt = "try:\n" + "".join(f"    {line}\n" for line in escape.splitlines()) + \
        "except Exception as err:\n    print('escape failed:', type(err).__name__, err)\n"
    result = await sandbox.run(NO_OP_HOOK + attempt + escape_payload(run_secret, marker))
    assert_contained(result, run_secret, marker)
    assert "refused: sandbox: reading" in result.stdout, result.stdout


@needs_root
async def test_with_the_hook_off_the_run_sees_neither_secrets_nor_shared_directories(run_secret):
    sandbox = PythonSandbox(FAST, uid=TEST_UID, audit_hook=False)
    if not sandbox.protections.namespaces:
        pytest.skip("mount namespaces are not permitted here")
    marker = f"miles-escape-{uuid.uuid4().hex}"
    result = await sandbox.run(escape_payload(run_secret, marker) +
                               "import os\nprint([name for name in os.listdir('/tmp') "
                               "if not name.startswith('miles-sandbox-')])\n"
                               f"open({sys.prefix + '/escape'!r}, 'w')\n")
    assert_contained(result, run_secret, marker)
    assert "refused: [Errno 2] No such file or directory" in result.stdout
    assert f"[{marker!r}]" in result.stdout  # its /tmp holds its own write only
    assert "OSError: [Errno 30] Read-only file system" in result.stderr


@needs_root
async def test_concurrent_runs_get_distinct_uids_and_cannot_see_each_other():
    sandbox = PythonSandbox(FAST, uid=TEST_UID, audit_hook=False)
    victim = ("import os, time\nopen('private', 'w').write('VICTIM-DATA')\n"
              "os.chmod('private', 0o644)\nprint(os.getuid(), flush=True)\ntime.sleep(3)\n")
    attacker = ("import os, time\ntime.sleep(1)\nprint(os.getuid())\n"
                "for top, _, files in os.walk('/tmp'):\n"
                "    if 'miles-sandbox-' in top and 'private' in files:\n"
                "        print(open(top + '/private').read())\n")
    first, second = await asyncio.gather(sandbox.run(victim), sandbox.run(attacker))
    assert first.ok and second.ok, (first.stderr, second.stderr)
    assert first.stdout.split()[0] != second.stdout.split()[0]
    assert "VICTIM-DATA" not in second.stdout


@pytest.mark.parametrize("field, value", [("cpu_s", 0), ("memory_mb", -1), ("wall_s", 0.0),
                                          ("wall_s", float("inf")), ("max_output_bytes", 1.5)])
def test_limits_are_validated(field, value):
    with pytest.raises(ConfigError, match=f"sandbox.{field} must be"):
        SandboxLimits(**{field: value})
