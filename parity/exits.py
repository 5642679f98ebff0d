"""The exit codes of `fp8-parity` and the exceptions a command raises to choose one.

Exit codes (all commands): 0 success / parity holds, 1 a violation was found, 2 bad usage or
input, 3 an internal error of fp8-parity (one line; FP8_PARITY_TRACEBACK=1 shows the traceback),
4 `report` of an interrupted sweep's partial table in which nothing failed (not a pass: cases are
missing), 125 cannot run here (e.g. a GPU-only command without a GPU; what `git bisect run` reads
as "skip this commit"), 130 / 143 interrupted by SIGINT / SIGTERM.

parity.cli.main turns UsageError into 2 and CannotRun into 125, each as one line; the command
modules (parity.cmd_*) return the others. Standard library only: parity.cli and every command
module import it, and it imports neither.
"""

from __future__ import annotations

import signal

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL, EXIT_INCOMPLETE, EXIT_CANNOT_RUN = 0, 1, 2, 3, 4, 125
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class UsageError(Exception):
    """Bad input from the user: printed as one clear message, exit 2."""


class CannotRun(Exception):
    """The command cannot run on this machine (no GPU, ...): one clear message, exit 125."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like a Ctrl-C so that every command stops the same way (workers killed, partial
    results kept)."""


def interrupted_by(err: KeyboardInterrupt) -> signal.Signals:
    """The signal that stopped a command: SIGTERM (Terminated) or SIGINT (a Ctrl-C)."""
    return signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
