"""The bootstrap that runs first inside a `PythonSandbox` child, before the user's code.

`sandbox.py` passes this file's source to `python -I -c` with a JSON argument (limits, the
working directory, the uid to become); the user's code arrives on stdin. In order it: reads the
code, sets the resource limits, preloads common stdlib modules (after the uid drop an interpreter
installed under an unreadable home, such as pyenv under /root, could not import them), drops to
the unprivileged uid when started as root, enters the working directory, and installs an audit
hook (PEP 578) that refuses: file access outside the working directory (the interpreter's own
library directories stay readable, never writable), process creation, signals to other
processes, sockets, ctypes and raw subprocess imports, and raising resource limits. Then it
runs the code as `__main__`.

Stdlib only, no Miles imports: it runs in an isolated interpreter. The hook is defence in depth;
audit hooks are not a security boundary on their own (see docs/environments.md).
"""

import json
import os
import resource
import signal
import sys
import sysconfig
import traceback

CPU_LIMIT_EXIT = 152
"""Exit status when the CPU-time limit hits (128 + SIGXCPU, as a shell reports it)."""
SETUP_FAILED_EXIT = 125
"""Exit status when the bootstrap itself failed, before any user code ran."""
PRELOAD_MODULES = ("math", "cmath", "socket", "json", "re", "collections", "itertools", "functools",
                   "fractions", "decimal", "statistics", "random", "string", "datetime", "heapq",
                   "bisect", "operator", "copy", "textwrap", "dataclasses", "typing", "array")
DENIED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
    "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link", "os.chroot",
    "sys.remote_exec"})
DENIED_PREFIXES = ("socket.", "ctypes.", "_ctypes.")
DENIED_MODULES = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_testcapi",
                            "_testinternalcapi", "_xxsubinterpreters"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {  # event -> positions of its path arguments; all must be inside the directory
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
    "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.chdir": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (0, 1), "os.chflags": (0,)}
LIST_EVENTS = ("os.listdir", "os.scandir")


def main() -> None:
    try:
        code, hook = _set_up(json.loads(sys.argv[1]))
    except BaseException as err:  # noqa: BLE001 - reported to the parent as a setup failure
        os.write(2, f"sandbox setup failed: {type(err).__name__}: {err}\n".encode())
        os._exit(SETUP_FAILED_EXIT)
    if hook is not None:
        sys.addaudithook(hook)
    _run(code)


def _set_up(config: dict):
    """Everything before the user's code: (the code, the audit hook to install or None)."""
    code = sys.stdin.read()
    set_limits(config["limits"])
    library = _library_dirs()  # sysconfig imports modules: before the uid drop
    for name in PRELOAD_MODULES:
        __import__(name)
    if os.getuid() == 0 and config["uid"] is not None:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])
    workdir = os.path.realpath(config["workdir"])
    os.chdir(workdir)
    signal.signal(signal.SIGXCPU, _on_cpu_limit)
    sys.dont_write_bytecode = True
    return code, _audit_hook(workdir, library) if config["audit"] else None


def set_limits(limits: dict) -> None:
    """Each limit as soft and hard: a hard limit cannot be raised again without root."""
    cpu = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL after
    for name in ("RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CORE"):
        value = limits.get(name)
        if value is not None:
            resource.setrlimit(getattr(resource, name), (value, value))


def _library_dirs() -> tuple[str, ...]:
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(paths[n]) for n in names if n in paths}))


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _resolve(path: object) -> str | None:
    """The real absolute path of a path argument; None for a file descriptor (already open)."""
    if path is None:
        return os.getcwd()
    if isinstance(path, int):
        return None
    return os.path.realpath(os.fsdecode(path))


def _audit_hook(workdir: str, library: tuple[str, ...]):
    own = (workdir,)
    readable = own + library

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path = _resolve(args[0])
            mode, flags = args[1], args[2]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & WRITE_FLAGS)
            if path is not None and not _inside(path, own if writes else readable):
                raise PermissionError(f"sandbox: {'writing' if writes else 'reading'} "
                                      f"{args[0]!r} is not allowed (outside the working directory)")
        elif event == "import":
            if args[0].partition(".")[0] in DENIED_MODULES:
                raise ImportError(f"sandbox: import of {args[0]!r} is not allowed")
        elif event in DENIED_EVENTS or event.startswith(DENIED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event in PATH_EVENTS:
            for position in PATH_EVENTS[event]:
                path = _resolve(args[position]) if position < len(args) else None
                if path is not None and not _inside(path, own):
                    raise PermissionError(f"sandbox: {event} on {args[position]!r} is not "
                                          "allowed (outside the working directory)")
        elif event in LIST_EVENTS:
            path = _resolve(args[0] if args else None)
            if path is not None and not _inside(path, readable):
                raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")

    return hook


def _on_cpu_limit(signum: int, frame: object) -> None:
    os.write(2, b"\nsandbox: CPU time limit exceeded\n")
    os._exit(CPU_LIMIT_EXIT)


def _run(code: str) -> None:
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<sandbox>", "exec"), namespace)  # noqa: S102 - the sandbox's job
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - reported like the interpreter would
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
