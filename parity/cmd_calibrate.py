"""`fp8-parity calibrate`: measure parity.hopper's model against this GPU, configuration by configuration,
and write the table parity.calibration reads (commit it under parity/calibration/ to make it the GPU's)."""

from __future__ import annotations

import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from parity import calibration, hopper
from parity.exits import EXIT_INCOMPLETE, EXIT_PASS, CannotRun, UsageError
from parity.progress import Progress


def _header(gpu: str, measured: int, planned: int, complete: bool) -> list[str]:
    mmaemu = hopper.mmaemu_module()
    return [f"# fp8-parity calibrate: parity.hopper's model against {gpu}, bit for bit, per configuration",
            f"# command: {shlex.join(['fp8-parity', *sys.argv[1:]])}",
            f"# date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, mmaemu {getattr(mmaemu, '__version__', '?')}",
            f"# measured {measured} of {planned} configurations of the grid"
            + ("" if complete else " (INCOMPLETE: cut short by --seconds or --limit; the rest was not measured)")]


def cmd_calibrate(args) -> int:
    if not torch.cuda.is_available():
        raise CannotRun("no CUDA device is available: calibrate measures a GPU's FP8 GEMMs against the Hopper model")
    try:
        hopper.mmaemu_module()
    except hopper.HopperModelError as err:
        raise CannotRun(str(err)) from None
    gpu = torch.cuda.get_device_name()
    out = args.out or Path(f"calibration-{calibration.gpu_slug(gpu)}.csv")
    if out.exists():
        raise UsageError(f"--out {out} exists; it is never overwritten: pass another path or remove it")
    grid = calibration.grid()
    planned = grid[: args.limit] if args.limit else grid
    deadline = time.monotonic() + (args.seconds or float("inf"))
    rows = []
    with Progress(True, "configurations") as progress:
        for index, config in enumerate(planned):
            if time.monotonic() > deadline:
                break
            rows.append(calibration.measure(config))
            progress(index + 1, len(planned))
    import pandas as pd  # for the table once measured (the command body's only use of it)
    complete = len(rows) == len(grid)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as handle:
        handle.write("\n".join(_header(gpu, len(rows), len(grid), complete)) + "\n")
        pd.DataFrame.from_records(rows).to_csv(handle, index=False)
    table = pd.DataFrame.from_records(rows)
    for kind, group in table.groupby("kind", sort=False):
        print(f"{kind}: bit-equal on {int(group['bitwise'].sum())} of {len(group)} configurations"
              f"{'' if not group['error'].astype(bool).any() else f'; {int(group.error.astype(bool).sum())} raised'}")
    print(f"table: {out} ({len(rows)} of {len(grid)} configurations{'' if complete else ', INCOMPLETE'})")
    return EXIT_PASS if complete else EXIT_INCOMPLETE
