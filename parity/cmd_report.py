"""`fp8-parity report` (re-render a report from a stored results table, also an interrupted
sweep's partial one) and `fp8-parity diff` (what moved beyond noise between two result sets).

A table is judged only when it is known whole: it carries the seal fp8-parity wrote into it (its
row count and checksum, parity.table_seal), or the user says --unverified and the verdict says
UNVERIFIED. A report is written only where fp8-parity may write (parity.folder_manifest): beside
the table it reads, in a report folder of its own, or in --out.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from parity import cmd_inputs
from parity.exits import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS, UsageError, one_line
from parity.outputs import OutputLock, atomic_write_text
from parity.report import RESULTS_FILE, diff_results, read_results, render_diff, verdict, write_report
from parity.results_file import encoded
from parity.sweep_resume import PARTIAL_INFO, PARTIAL_TABLE, partial_progress

UNSEALED = ("carries no seal (its row count and checksum): fp8-parity cannot tell whether it is complete (a table "
            "written before fp8-parity sealed its tables, compressed again, cut short, or a plain CSV)")


def _table_of(source: Path) -> tuple[Path, bool]:
    """The table file `report SOURCE` reads, and whether it is an interrupted sweep's partial one."""
    if not source.exists():
        raise UsageError(f"{source} does not exist (give a results.csv.gz or a report directory)")
    if source.is_dir():
        partial = (source / PARTIAL_TABLE).is_file() and not (source / RESULTS_FILE).exists()
        table = source / (PARTIAL_TABLE if partial else RESULTS_FILE)
        if not table.exists():
            raise UsageError(f"cannot read results from {source}: no results file at {table}: give a report "
                             f"directory or a .csv/.csv.gz/.parquet file")
        return table, partial
    return source, source.name == PARTIAL_TABLE


def cmd_report(args) -> int:
    table, partial = _table_of(args.results)
    frame = _read(table)
    if frame.attrs["seal"] is None and not args.unverified:
        raise UsageError(f"{table} {UNSEALED}; re-run the sweep, or pass --unverified to report it anyway, headed "
                         f"UNVERIFIED (exit 4 where it would pass)")
    home = table.parent
    caveats = ([_incomplete(home)] if partial else []) + ([f"UNVERIFIED: {table} {UNSEALED}. "]
                                                          if frame.attrs["seal"] is None else [])
    out = args.out or home
    beside = out.resolve() == home.resolve()  # a report beside its table re-renders the rest, never the table
    new_table = None if beside else encoded(frame)
    cmd_inputs.report_folder(out, "--out" if args.out else "the table's folder", force=args.force,
                             protected=_protected(out, new_table),
                             fix=None if args.out else "give --out with a new or empty folder")
    judged = verdict(frame, candidate=args.candidate)
    if caveats:
        prefix = "".join(caveats) + "Among its rows: "
        judged = dataclasses.replace(judged, headline=prefix + judged.headline, brief=prefix + judged.short)
    with OutputLock(out):
        write_report(frame, out, candidate=args.candidate, verdict=judged, write_table=not beside)
    print(judged.headline)
    if judged.next_step:
        print(f"next: {judged.next_step}  ({judged.NEXT_STEP_WHY})")
    print(f"report: {out}/summary.md")
    if not judged.ok:
        return EXIT_FAIL
    return EXIT_INCOMPLETE if caveats else EXIT_PASS


def _protected(out: Path, new_table: bytes | None) -> dict[str, str]:
    """What a report written into `out` must not replace: another run's results table (not the one being
    written) and an interrupted sweep's rows, when it writes a table there."""
    if new_table is None:
        return {}
    protected = {PARTIAL_TABLE: "the rows of an interrupted sweep (`fp8-parity sweep --resume` continues it)"}
    existing = out / RESULTS_FILE
    if not (existing.is_file() and existing.read_bytes() == new_table):
        protected[RESULTS_FILE] = "another report's results"
    return protected


def _incomplete(home: Path) -> str:
    """The INCOMPLETE line of an interrupted sweep's table: how many cases of how many, and how to finish it."""
    try:
        progress = partial_progress(home)
    except ValueError as err:
        raise UsageError(f"{home / PARTIAL_INFO} is {err}: re-run the sweep") from None
    ran = f"{progress[0]} of {progress[1]} cases" if progress else f"how many cases ran is unknown: no {PARTIAL_INFO}"
    return f"INCOMPLETE: an interrupted sweep's table ({ran}; `fp8-parity sweep --out {home} --resume` finishes it). "


def _read(path: Path):
    """The results table at `path` (a file or a report directory), or UsageError saying why not."""
    if not path.exists():
        raise UsageError(f"{path} does not exist (give a results.csv.gz or a report directory)")
    try:
        return read_results(path)
    except (ValueError, OSError) as err:
        raise UsageError(f"cannot read results from {path}: {one_line(err)}") from None


def cmd_diff(args) -> int:
    cmd_inputs.writable_file(args.csv, "--csv")
    before, after = _read(args.a), _read(args.b)
    for name, frame in ((args.a, before), (args.b, after)):
        if frame.attrs["seal"] is None:  # diff lists the rows only in one: a missing row shows, but say so first
            print(f"fp8-parity diff: note: {name} {UNSEALED}", file=sys.stderr)
    moves = diff_results(before, after, sqnr_tolerance_db=args.sqnr_tolerance)
    print(render_diff(moves))
    if args.csv:
        atomic_write_text(args.csv, moves.to_csv(index=False))
    return EXIT_PASS if moves.empty else EXIT_FAIL
