"""The private file system a `PythonSandbox` child sees: a new root in its own mount namespace.

`unshare --mount --propagation private` gives the child a copy of the mount table that nothing
it does propagates out of; `MOUNT_SCRIPT` (run there as root, before the bootstrap drops to the
run's uid) then builds a root holding only:
- the system directories (`SYSTEM_DIRS`) and the interpreter's own (prefix, libraries),
  bound read-only, nosuid, nodev;
- null, zero, full, random, urandom in /dev; a fresh /proc of the child's PID namespace;
- a fresh tmpfs on /tmp and on /dev/shm, `tmp_mb` each, seen by this run only;
- the run's working directory, bound read-write at the same path it has outside;
and `pivot_root`s into it, detaching the old root, so nothing else of the host's file system
(home directories, /work, the producer's out_dir and keys, /var, other runs' directories)
exists for the code, whatever it does in the interpreter. The root itself is an empty tmpfs
remounted read-only.

A shell script rather than Python: mounting needs mount(2), which the stdlib does not expose, and
ctypes in the child would be one more thing for the code to find. Paths reach the script as
arguments, never spliced into its text. A failure ends it with the bootstrap's setup-failed
status and message, so the run reports `setup_failed`.
"""

from __future__ import annotations

import json
import os
import subprocess

PROBE_TIMEOUT_S = 10.0
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""Host directories every child sees (read-only): programs, shared libraries (and /etc for the
loader's cache, locale and time zone). Files the run must not read do not belong there."""
DEVICES = ("null", "zero", "full", "random", "urandom")
MOUNT_SCRIPT = r"""
set -eu
trap 'status=$?; [ "$status" = 0 ] || echo "sandbox setup failed: building the private root \
(exit $status)" >&2; [ "$status" = 0 ] || exit 125' EXIT
child_path=$PATH
PATH=/usr/sbin:/usr/bin:/sbin:/bin
new=$1 work=$2 size=$3
shift 3
mount -t tmpfs -o mode=755,size=1m miles-root "$new"
while [ "$1" != -- ]; do
  mkdir -p "$new$1"
  mount --bind "$1" "$new$1"
  mount -o remount,bind,ro,nosuid,nodev "$new$1"
  shift
done
shift
mkdir -p "$new/dev/shm" "$new/proc" "$new/tmp" "$new/.old"
for name in null zero full random urandom; do
  touch "$new/dev/$name"
  mount --bind "/dev/$name" "$new/dev/$name"
done
mount -t tmpfs -o "mode=1777,nosuid,nodev,size=${size}m" miles-tmp "$new/tmp"
mount -t tmpfs -o "mode=1777,nosuid,nodev,noexec,size=${size}m" miles-shm "$new/dev/shm"
mkdir -p "$new$work"
mount --bind "$work" "$new$work"
mount -o remount,bind,nosuid,nodev "$new$work"
mount -t proc -o nosuid,nodev,noexec proc "$new/proc"
cd "$new"
pivot_root . .old
umount -l /.old
rmdir /.old
mount -o remount,bind,ro /
cd "$work"
trap - EXIT
PATH=$child_path
exec "$@"
"""
INTERPRETER_PROBE = ("import json, sys, sysconfig; paths = sysconfig.get_paths(); "
                     "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
                     "sys.base_exec_prefix, paths['stdlib'], paths['platstdlib'], "
                     "paths['purelib'], paths['platlib']]))")


def private_root_prefix(root: str, workdir: str, visible: tuple[str, ...],
                        tmp_mb: int) -> list[str]:
    """The command line that builds the private root in `root` (an empty directory) and then
    execs the command that follows it; run it inside `unshare --mount --propagation private`."""
    return ["sh", "-c", MOUNT_SCRIPT, "sh", root, workdir, str(tmp_mb), *visible, "--"]


def visible_dirs(python: str) -> tuple[str, ...]:
    """The directories bound into the root for `python`: `SYSTEM_DIRS` and the interpreter's
    own (asked of the interpreter itself: a venv's prefix and its base install differ), each
    once, none inside another (a read-only bind cannot take a mount point)."""
    probe = subprocess.run([python, "-I", "-c", INTERPRETER_PROBE], capture_output=True,
                           text=True, timeout=PROBE_TIMEOUT_S, check=True)
    interpreter = [os.path.dirname(os.path.abspath(python)), *json.loads(probe.stdout)]
    candidates = sorted({os.path.normpath(path) for path in (*SYSTEM_DIRS, *interpreter)
                         if os.path.isdir(path)})
    kept: list[str] = []
    for path in candidates:  # sorted: a directory comes before everything inside it
        if not any(path.startswith(parent.rstrip("/") + "/") for parent in kept):
            kept.append(path)
    return tuple(kept)
