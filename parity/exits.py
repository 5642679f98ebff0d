"""The exit codes of `fp8-parity` and the exceptions a command raises to choose one.

Exit codes (all commands): 0 success / parity holds, 1 a violation was found, 2 bad usage or input,
3 an internal error of fp8-parity (one line; FP8_PARITY_TRACEBACK=1 shows the traceback too), 4
`report` of an interrupted sweep's partial table, or of an unverified one (no seal), in which
nothing failed (not a pass: cases are missing, or may be), 125 cannot run here (e.g. a GPU-only
command without a GPU; what `git bisect run` reads as "skip this commit"), 130 / 143 interrupted by
SIGINT / SIGTERM.

parity.cli.main turns UsageError into 2 and CannotRun into 125, each as one line; the command
modules (parity.cmd_*) return the others. Standard library only: parity.cli and every command
module import it, and it imports neither.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL, EXIT_INCOMPLETE, EXIT_CANNOT_RUN = 0, 1, 2, 3, 4, 125
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class UsageError(Exception):
    """Bad input from the user: printed as one clear message, exit 2."""


class CannotRun(Exception):
    """The command cannot run on this machine (no GPU, ...): one clear message, exit 125."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like a Ctrl-C so that every command stops the same way (workers killed, partial
    results kept)."""


TRACEBACK_ENV = "FP8_PARITY_TRACEBACK"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
MESSAGE_CHARS = 600  # one printed error line at most: an exception can carry megabytes (a 50 MiB message)


def traceback_requested() -> bool:
    """Whether FP8_PARITY_TRACEBACK asks for the traceback of an internal error: 1, true, yes or on (any
    case). 0, false, no, off and unset mean no; any other value is a UsageError (a typo must not turn it
    on, nor silently off)."""
    value = os.environ.get(TRACEBACK_ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise UsageError(f"{TRACEBACK_ENV}={os.environ[TRACEBACK_ENV]!r}: expected 1 (show the traceback of an internal "
                     f"error) or 0 (one line)")


def one_line(text: object, limit: int = MESSAGE_CHARS) -> str:
    """`text` as one line of at most about `limit` characters: line breaks become " / ", and a longer text
    is cut and says how long it was (an exception's message may be megabytes long)."""
    raw = str(text)
    flat = " / ".join(part.strip() for part in raw[:2 * limit].splitlines() if part.strip())
    if len(raw) <= 2 * limit and len(flat) <= limit:
        return flat
    return f"{flat[:limit]}... ({len(raw)} characters in all)"


# The stop signals this process received (parity.cli.main's handler records each before it raises). Python runs
# a handler between two bytecodes of the main thread, wherever that is: inside an object's __del__ or a weakref
# callback the exception it raises is printed as "Exception ignored" and lost, and the run would go on to a
# verdict (issue 29: a check given SIGTERM printed PASS and exited 0 ten minutes later). The record is not lost:
# loops call raise_if_stopped between cases, and cli.main turns any verdict reached after a signal into 130/143.
_STOPS: list[signal.Signals] = []


def stop_on_signal(signum: int, frame) -> None:
    """The SIGINT and SIGTERM handler of fp8-parity's commands: record the signal, then raise KeyboardInterrupt
    (Terminated for SIGTERM), so that every command stops the same way (workers killed, partial results kept)."""
    _STOPS.append(signal.Signals(signum))
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def quiet_lost_stops(previous_hook):
    """A sys.unraisablehook that says nothing of a stop signal's exception Python could not raise (the handler
    ran inside a finalizer or a gc callback, hypothesis's among them: "Exception ignored ... Traceback" reached
    the user) and passes everything else to `previous_hook`: the signal is recorded and acted on anyway."""
    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and _STOPS):
            previous_hook(unraisable)
    return hook


def stopped_by() -> signal.Signals | None:
    """The first stop signal received since clear_stops (None: none)."""
    return _STOPS[0] if _STOPS else None


def raise_if_stopped() -> None:
    """Raise the interrupt of a stop signal received since clear_stops again: its first exception may have been
    lost (see _STOPS). Called between cases, where a run can stop cleanly."""
    if _STOPS:
        raise Terminated() if _STOPS[0] == signal.SIGTERM else KeyboardInterrupt()


def clear_stops() -> None:
    _STOPS.clear()


def interrupted_by(err: KeyboardInterrupt) -> signal.Signals:
    """The signal that stopped a command: SIGTERM (Terminated) or SIGINT (a Ctrl-C)."""
    return signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT


def handled_stop(err: KeyboardInterrupt) -> signal.Signals:
    """interrupted_by, for a command that answers the stop itself (train's INCOMPLETE report, exit 4 or 1):
    the recorded signal is consumed, so cli.main does not void that answer. A stop whose exception was lost
    never reaches such a handler, and stays recorded."""
    clear_stops()
    return interrupted_by(err)


def _lost_in_resource_sharer(exc_type, exc_traceback) -> bool:
    """A lost connection (reset, broken pipe, end of file) raised in multiprocessing's resource sharer."""
    frames = traceback.extract_tb(exc_traceback) if exc_traceback is not None else []
    shared = any(frame.filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for frame in frames)
    return shared and issubclass(exc_type, (ConnectionError, EOFError))


def quiet_lost_connections(previous_hook):
    """A sys.excepthook that says nothing of a lost connection in multiprocessing's resource sharer (the thread
    that hands a worker the file descriptors of shared tensors): a worker killed by a stop, or dead, during the
    handshake. That worker's end is the stop's or already a finding; its traceback reached the user after a
    Ctrl-C of train (CI, 2026-12-07 and 12-08). The sharer's thread catches every exception itself and hands it
    to sys.excepthook (multiprocessing/resource_sharer.py, _serve), never to threading.excepthook. Everything
    else goes to `previous_hook`."""
    def hook(exc_type, exc_value, exc_traceback):
        if not _lost_in_resource_sharer(exc_type, exc_traceback):
            previous_hook(exc_type, exc_value, exc_traceback)
    hook.quiet_lost_connections = True
    return hook


def install_quiet_lost_connections() -> None:
    """sys.excepthook silent about the resource sharer's lost connections (quiet_lost_connections), once."""
    if not getattr(sys.excepthook, "quiet_lost_connections", False):
        sys.excepthook = quiet_lost_connections(sys.excepthook)
