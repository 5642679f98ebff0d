"""The `fp8-parity` console script (and `python -m parity`): start the worker a command will need,
then hand over to parity.cli.

A command that runs your code (check, bisect or sweep of an implementation that is not a
built-in) runs it in a worker process (parity.worker). A worker's start costs an interpreter,
torch, torchao, the harness and, on a GPU, a CUDA context: several seconds, most of a quick
bisect's wall time. Started here, before this process parses the arguments and imports torch and
the harness for the command's body (about 3 s on a 2-core laptop), the worker gets ready while they
run. The decision reads the raw arguments without importing torch: a wrong guess
costs a spare process, never a result (parity.cli.main starts what the parsed arguments need
anyway, and the check of the device and of the names happens there).
"""

from __future__ import annotations

import os
import signal
import sys

from parity.commands import RUNS_YOUR_CODE
from parity.exits import EXIT_SIGNAL, install_quiet_lost_connections
from parity.names import BUILTIN_PACKAGES  # built-ins named PACKAGE:RECIPE (parity.impls.BUILTINS)


def names_your_code(value: str) -> bool:
    """Whether an --impl / --against value names code outside the harness (path/to/file.py:attr,
    package.module:attr) rather than a built-in (fp8_impl, torchao:rowwise, emulated:blockwise, bf16)."""
    package, colon, _ = value.partition(":")
    return package.endswith(".py") or (bool(colon) and package not in BUILTIN_PACKAGES)


def _values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    values = []
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in flags:
            if equals:
                values.append(value)
            elif i + 1 < len(argv):
                values.append(argv[i + 1])
    return values


def worker_device(argv: list[str]) -> str | None:
    """The device type of the worker the command in `argv` will start, or None when it starts none.
    --device auto is decided by the presence of an NVIDIA driver (torch is not imported yet)."""
    if not argv or argv[0] not in RUNS_YOUR_CODE:
        return None
    if any(arg.partition("=")[0] == "--distributed" for arg in argv):  # its ranks load the code, no worker
        return None
    if not any(names_your_code(value) for value in _values(argv, ("--impl", "--against"))):
        return None
    device = (_values(argv, ("--device",)) or ["auto"])[-1]
    if device == "auto":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = "cuda" if os.path.exists("/dev/nvidiactl") and visible not in ("", "-1") else "cpu"
    return device if device in ("cpu", "cuda") else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # For the life of the process, not only of parity.cli.main (which restores the hook it found): the resource
    # sharer's thread may lose its worker after the command returned, between cli.main's `finally` and this
    # process's end (an EOFError or ConnectionResetError traceback after a Ctrl-C of train, CI 2026-12-07, 12-08).
    install_quiet_lost_connections()
    device = worker_device(argv)
    if device is not None:
        # standard library only, yet multiprocessing's 30 ms are a third of a --help's wall time: here
        from parity.worker import warm_up
        warm_up(device, RUNS_YOUR_CODE[argv[0]])
    # Deliberately late, after the worker's start: parity.cli's parser itself is torch-free now (a
    # --help or a bad flag is answered in a fraction of a second), but a command's body imports torch
    # and the harness (3.6 s on a 2-core machine at load 1.5, 10-12 s at load 5), time the worker
    # started above spends getting ready beside it.
    from parity.cli import main as cli_main
    code = cli_main(argv)
    if code in EXIT_SIGNAL.values():
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process at once after a Ctrl-C or SIGTERM stopped the command. By then what it keeps is written
    (atomically), its folder lock released and its workers stopped; the interpreter's teardown with torch
    loaded would add seconds (5 to 7 s after `check` at a load of 13) to a stop that must take about one.
    Spare workers (daemonic) are terminated here, as the teardown would, and so is the CPU workers' fork
    server: it ends by itself once its pipe from this process closes, but only after its preload (torch, the
    harness: 30 s under load) has imported, holding this command's stdout open until then (a `| tee` waits)."""
    import multiprocessing  # standard library; loaded already wherever workers ran
    for child in multiprocessing.active_children():
        child.terminate()
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    server_pid = getattr(server, "_forkserver_pid", None)  # the one this process started, if any
    if server_pid:
        try:
            os.kill(server_pid, signal.SIGKILL)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
