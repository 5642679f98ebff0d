"""Writing output files safely: checked before the work, written whole or not at all, one writer.

Why: a run cut short (Ctrl-C, a crash, a full disk) must never leave a summary that disagrees
with its table, nor a half-written file that a later `report` or `diff` reads as results; and
a run that cannot write its output should say so before it spends an hour computing it.

    check_writable_file(path)  before any work: a file can be written at `path` (nothing created)
    check_writable_dir(path)   the same for an output directory
    atomic_write_bytes/_text   a temp file in the same directory, fsync'ed, then os.replace: a
                               reader sees the old file or the new one, never a part of it
    OutputLock(dir)            one fp8-parity run writes a directory at a time; the lock of a
                               run that died (its pid is gone) is taken over

Permissions are checked by trying (a temporary file that is never linked in, or unlinked at
once), not only with os.access: as root, os.access says yes to /proc and read-only mounts.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import tempfile
from pathlib import Path

LOCK_FILE = ".fp8-parity.lock"


class OutputError(Exception):
    """An output cannot be written: one line for the user (what, the path, how to fix)."""


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unwritable_dir(directory: Path) -> str | None:
    """Why no file can be created in the existing path `directory`, or None if one can."""
    if not directory.is_dir():
        return f"{directory} is a file, not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    try:  # root passes os.access on /proc, /sys and read-only mounts: try for real
        with tempfile.TemporaryFile(dir=directory, prefix=".fp8-parity-probe."):
            pass
    except OSError as err:
        return f"{directory} is not writable: {err.strerror or err}"
    return None


def _refuse(path: Path, option: str | None, reason: str, fix: str) -> OutputError:
    return OutputError(f"{option + ' ' if option else ''}{path}: cannot write there ({reason}); {fix}")


def check_writable_file(path: str | Path, *, option: str | None = None) -> Path:
    """`path`, once it is sure a file can be written there: not a directory, writable if it
    exists, and its directory exists or can be created (its nearest existing ancestor is a
    writable directory). Creates nothing. `option` ("--json") prefixes the message."""
    path = Path(path)
    fix = "give a path in a writable directory"
    if path.is_dir():
        raise _refuse(path, option, f"{path} is a directory", "give a file name")
    unfit = _not_a_regular_file(path)
    if unfit:
        raise _refuse(path, option, unfit, "give a new path or a regular file")
    if path.exists() and not os.access(path, os.W_OK):
        raise _refuse(path, option, f"{path} is not writable", fix)
    reason = _unwritable_dir(_nearest_existing(path.parent))
    if reason:
        raise _refuse(path, option, reason, fix)
    return path


def _not_a_regular_file(path: Path) -> str | None:
    """Why an existing `path` must not be written (None: it is new, or a regular file). A file is written by
    renaming a new one over it: that would replace a device node (as root, /dev/null itself), a pipe, a
    socket, or a symbolic link with a regular file, and writing into one instead is no file at all."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # new (or under a file: the directory check says so)
        return None
    except OSError as err:
        return f"{path} cannot be examined: {err.strerror or err}"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return f"{path} is a symbolic link, which would be replaced by a file; give the path it points to"
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    return f"{path} is {kind}, not a regular file: fp8-parity writes only regular files and never replaces another kind"


def check_writable_dir(path: str | Path, *, option: str | None = None) -> Path:
    """`path`, once it is sure it is (or can be created as) a writable directory. Creates nothing."""
    path = Path(path)
    reason = _unwritable_dir(_nearest_existing(path))
    if reason:
        raise _refuse(path, option, reason, "give a directory that can be written")
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` whole or not at all (parent directories created). OutputError when `path` is
    there and is not a regular file (a device, a pipe, a link that appeared since the check): never replaced."""
    path = Path(path)
    unfit = _not_a_regular_file(path)
    if unfit:
        raise OutputError(f"{path}: cannot write there ({unfit})")
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = tempfile.NamedTemporaryFile(dir=path.parent, delete=False, prefix=f".{path.name}.")
    try:
        with temp:
            temp.write(data)
            temp.flush()
            os.fsync(temp.fileno())
        os.chmod(temp.name, 0o666 & ~_umask())  # NamedTemporaryFile makes 0600; a report is for others too
        os.replace(temp.name, path)
    except BaseException:
        Path(temp.name).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, *, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` whole or not at all (parent directories created)."""
    return atomic_write_bytes(path, text.encode(encoding))


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0 or -n) signals process groups: never a run's pid
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class OutputLock:
    """`with OutputLock(out_dir, command):` holds `<out_dir>/.fp8-parity.lock` (the directory is
    created) so that two runs never write one directory at once; removed on exit.

    The lock holds the pid, the host and the command. A lock whose pid is alive on this host, or
    that was taken on another host (its pid cannot be checked from here), refuses with an
    OutputError; one whose process is gone (a run that was killed) is taken over."""

    def __init__(self, directory: str | Path, command: str | None = None):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.command = command if command is not None else " ".join(sys.argv)
        self._mine: bytes | None = None

    def _holder(self) -> dict | None:
        """The lock's content: pid, host, command; None when it cannot be parsed (a stale lock)."""
        try:
            held = json.loads(self.path.read_text())
        except ValueError:
            return None
        return held if isinstance(held, dict) and isinstance(held.get("pid"), int) else None

    def __enter__(self) -> OutputLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        mine = json.dumps({"pid": os.getpid(), "host": host, "command": self.command}).encode()
        for _ in range(3):  # the lock vanished between two looks (its run ended, or another took it over)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = self._holder()
                except FileNotFoundError:
                    continue
                if holder is not None:
                    elsewhere = holder.get("host", host) != host  # its pid cannot be checked from here
                    if elsewhere or _alive(holder["pid"]):
                        where = f" on {holder['host']}" if elsewhere else ""
                        raise OutputError(
                            f"{self.directory} is being written by another fp8-parity run (pid {holder['pid']}"
                            f"{where}: {holder.get('command', '?')}); wait for it or give another --out "
                            f"(or delete {self.path} if no such run is going)") from None
                self.path.unlink(missing_ok=True)  # stale: the run that took it is gone
                continue
            with os.fdopen(fd, "wb") as file:
                file.write(mine)
            self._mine = mine
            return self
        raise OutputError(f"{self.directory}: cannot take its lock {self.path} (other runs keep taking it); "
                          f"wait for them or give another --out")

    def __exit__(self, *exc) -> None:
        try:  # only our own lock: never one another run took over
            if self._mine is not None and self.path.read_bytes() == self._mine:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._mine = None
