"""The commands of `fp8-parity`: the module and function that run each, and which of them run
your code in a worker process.

Read by parity.entry before torch is imported (which workers to start) and by parity.cli (which
command to run): standard library only, and it imports neither of them.
"""

from __future__ import annotations

import importlib
from typing import Callable

# The commands that run an implementation in a worker, and how many fresh CUDA workers each wants at
# once: the one its cases run in; for check and bisect one for the minimal case rerun alone (state
# that earlier calls left); for bisect one more, for that rerun when a rounding of the scales makes it
# localize again (bisect's step 4). Spawned together, each is ready when the first is: on the H200 a
# bisect's triggers had waited 5-10 s for a worker spawned only when the one before was taken. (No
# more processes than before: taking a worker spawns its replacement anyway, only later.)
# train: its four runs (candidate, against, baseline, baseline from another seed), each in its own worker.
RUNS_YOUR_CODE = {"check": 2, "bisect": 3, "sweep": 1, "train": 4}

# command -> "module:function" of its body.
COMMANDS = {
    "check": "parity.cmd_check:cmd_check",
    "test": "parity.cmd_test:cmd_test",
    "sweep": "parity.cmd_sweep:cmd_sweep",
    "bisect": "parity.cmd_check:cmd_bisect",
    "bench": "parity.cmd_bench:cmd_bench",
    "throughput": "parity.cmd_bench:cmd_throughput",
    "train": "parity.cmd_train:cmd_train",
    "report": "parity.cmd_report:cmd_report",
    "diff": "parity.cmd_report:cmd_diff",
    "calibrate": "parity.cmd_calibrate:cmd_calibrate",
}


def command(name: str) -> Callable[[object], int]:
    """The body of command `name`, its module imported now: the one place a command module loads.

    Lazily because it costs: the bodies import check, bisect, report, the pytest plugin, train's
    report and throughput, 128 modules that `fp8-parity --help` and every other command do not
    need. Importing all of them after parity.cli took 0.11 s of 3.65 s (3%) on a 2-core machine at
    load 1.5, and 0.36-0.41 s of 10.4-11.9 s (3.1-3.7%, five runs) at load 5 (import parity.cli and
    build_parser, then the six parity.cmd_* modules, timed in one process). The wall time of
    `python -m parity --help`, median of 5 interleaved runs at load 1.8: 4.92 s before the command
    modules existed (commit 0a3a719), 5.04 s loading them here, 5.66 s importing them all in
    parity.cli; median of 9 at load 1.7: 4.08 s before, 4.16 s here (runs spread 3.9-5.1 s)."""
    module, _, function = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)
