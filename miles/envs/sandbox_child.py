"""The bootstrap that runs first inside a `PythonSandbox` child, before the user's code.

`sandbox.py` passes this file's source to `python -I -c` with a JSON argument (limits, the
working directory, the uid to become); the user's code arrives on stdin. In order it: reads the
code, sets the resource limits, preloads common stdlib modules (after the uid drop an interpreter
installed under an unreadable home, such as pyenv under /root, could not import them), drops to
the unprivileged uid when started as root, enters the working directory, and installs an audit
hook (PEP 578) that refuses: file access outside the working directory (the interpreter's own
library directories stay readable, never writable), process creation, signals to other
processes, sockets, ctypes and raw subprocess imports, raising resource limits, and the ways
to reach or rewrite the hook itself (`gc.get_objects`/`get_referrers`/`get_referents`, setting
a function's `__code__`). Then it runs the code as a fresh `__main__` module.

The hook cannot be rewritten from the code as far as CPython allows: gc's object walks are
refused, no running frame holds it, this module is not `sys.modules["__main__"]`, and it reads
nothing at call time that the code could rebind (module attributes, builtins, this module's
globals, closure cells); its frame is visible in a refusal's traceback, its functions are not
changeable. What stays open: the pure-Python path helpers it calls (`posixpath.realpath`) read
`os` and `posixpath` globals, which the code can rebind. The hook is defence in depth, not a
security boundary (see docs/environments.md): the private root and the uid hold without it.

Stdlib only, no Miles imports: it runs in an isolated interpreter.
"""

import json
import os
import resource
import signal
import sys
import sysconfig
import traceback
import types

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
    "sys.remote_exec", "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
DENIED_ATTRIBUTES = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
"""Function attributes the code may not set (`object.__setattr__` event), so that no function,
the hook included, can be rewritten in place."""
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
        code = _set_up(json.loads(sys.argv[1]))
    except BaseException as err:  # noqa: BLE001 - reported to the parent as a setup failure
        os.write(2, f"sandbox setup failed: {type(err).__name__}: {err}\n".encode())
        os._exit(SETUP_FAILED_EXIT)
    _run(code)


def _set_up(config: dict) -> str:
    """Everything before the user's code, which it returns. The hook is installed here so that
    no frame still running when the code runs holds it (the code can walk its frames)."""
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
    if config["audit"]:
        sys.addaudithook(_audit_hook(workdir, library))
    return code


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


def _audit_hook(workdir: str, library: tuple[str, ...]):
    """The hook. Everything it uses is bound when it is made, as keyword-only defaults (which
    the code cannot set: `DENIED_ATTRIBUTES`), never looked up in a module, the builtins or a
    closure cell when it runs: the code can see the hook's frame (in a refusal's traceback) but
    rebinding `builtins.len`, `os.path.realpath`, this module's globals or a cell changes
    nothing it runs."""
    inside, resolve = _path_checks()
    refuse_open = _open_check(inside, resolve, (workdir,), (workdir, *library))

    def hook(event: str, args: tuple, *, refuse_open=refuse_open, inside=inside,
             resolve=resolve, own=(workdir,), readable=(workdir, *library),
             denied_events=DENIED_EVENTS, denied_prefixes=DENIED_PREFIXES,
             denied_modules=DENIED_MODULES, denied_attributes=DENIED_ATTRIBUTES,
             path_events=PATH_EVENTS, list_events=LIST_EVENTS, len=len,
             refused=PermissionError, refused_import=ImportError) -> None:
        if event == "open":
            refuse_open(args)
        elif event == "import":
            if args[0].partition(".")[0] in denied_modules:
                raise refused_import(f"sandbox: import of {args[0]!r} is not allowed")
        elif event in denied_events or event.startswith(denied_prefixes):
            raise refused(f"sandbox: {event} is not allowed")
        elif event == "object.__setattr__" and args[1] in denied_attributes:
            raise refused(f"sandbox: setting {args[1]} is not allowed")
        elif event in path_events:
            for position in path_events[event]:
                path = resolve(args[position]) if position < len(args) else None
                if path is not None and not inside(path, own):
                    raise refused(f"sandbox: {event} on {args[position]!r} is not allowed "
                                  "(outside the working directory)")
        elif event in list_events:
            path = resolve(args[0] if args else None)
            if path is not None and not inside(path, readable):
                raise refused(f"sandbox: listing {args[0]!r} is not allowed")

    return hook


def _path_checks():
    """(inside(path, roots), resolve(path argument): its real absolute path, None for a file
    descriptor), bound to today's `os` functions rather than the module attributes later."""
    def inside(path: str, roots: tuple[str, ...], *, sep=os.sep) -> bool:
        for root in roots:
            if path == root or path.startswith(root + sep):
                return True
        return False

    def resolve(path: object, *, getcwd=os.getcwd, fsdecode=os.fsdecode,
                realpath=os.path.realpath, type=type, int=int) -> str | None:
        if path is None:
            return getcwd()
        if type(path) is int:
            return None
        return realpath(fsdecode(path))

    return inside, resolve


def _open_check(inside, resolve, own: tuple[str, ...], readable: tuple[str, ...]):
    """The `open` event's check: writing only inside `own`, reading inside `readable`."""
    def refuse_open(args: tuple, *, inside=inside, resolve=resolve, own=own, readable=readable,
                    isinstance=isinstance, str=str, int=int, write_modes=frozenset("wax+"),
                    write_flags=WRITE_FLAGS, refused=PermissionError) -> None:
        path = resolve(args[0])
        mode, flags = args[1], args[2]
        writes = (isinstance(mode, str) and not write_modes.isdisjoint(mode)) or \
            (isinstance(flags, int) and flags & write_flags)
        if path is not None and not inside(path, own if writes else readable):
            raise refused(f"sandbox: {'writing' if writes else 'reading'} {args[0]!r} is not "
                          "allowed (outside the working directory)")

    return refuse_open


def _on_cpu_limit(signum: int, frame: object) -> None:
    os.write(2, b"\nsandbox: CPU time limit exceeded\n")
    os._exit(CPU_LIMIT_EXIT)


def _run(code: str) -> None:
    """Runs the code as a fresh `__main__` module: `sys.modules["__main__"]` is not this one."""
    module = types.ModuleType("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    try:
        exec(compile(code, "<sandbox>", "exec"), module.__dict__)  # noqa: S102 - its job
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - reported like the interpreter would
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
