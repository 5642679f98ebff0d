"""`fp8-parity report` (re-render a report from a stored results table, also an interrupted
sweep's partial one) and `fp8-parity diff` (what moved beyond noise between two result sets)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from parity import cmd_inputs
from parity.exits import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS, UsageError
from parity.outputs import OutputLock, atomic_write_text
from parity.report import diff_results, read_results, render_diff, verdict, write_report
from parity.sweep_resume import PARTIAL_INFO, PARTIAL_TABLE


def cmd_report(args) -> int:
    source = args.results
    partial = (source.name == PARTIAL_TABLE or
               (source.is_dir() and (source / PARTIAL_TABLE).is_file() and not (source / "results.csv.gz").exists()))
    table = source / PARTIAL_TABLE if partial and source.is_dir() else source
    frame = _read(table)
    home = table.parent
    out = args.out or home
    cmd_inputs.writable_dir(out, "--out")
    judged = verdict(frame, candidate=args.candidate)
    headline = judged.headline
    if partial:
        info_path = home / PARTIAL_INFO
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        incomplete = (f"INCOMPLETE: an interrupted sweep's table ({info.get('done', '?')} of "
                      f"{info.get('planned', '?')} cases; `fp8-parity sweep --out {home} --resume` finishes it). "
                      f"Among the cases that ran: ")
        headline = incomplete + headline
        judged = dataclasses.replace(judged, headline=headline, brief=incomplete + judged.short)
    with OutputLock(out):  # the table read is never rewritten: a report beside it re-renders only the rest
        write_report(frame, out, candidate=args.candidate, verdict=judged,
                     write_table=out.resolve() != home.resolve())
    print(headline)
    if judged.next_step:
        print(f"next: {judged.next_step}  ({judged.NEXT_STEP_WHY})")
    print(f"report: {out}/summary.md")
    if not judged.ok:
        return EXIT_FAIL
    return EXIT_INCOMPLETE if partial else EXIT_PASS


def _read(path: Path):
    """The results table at `path` (a file or a report directory), or UsageError saying why not."""
    if not path.exists():
        raise UsageError(f"{path} does not exist (give a results.csv.gz or a report directory)")
    try:
        return read_results(path)
    except (ValueError, OSError) as err:
        raise UsageError(f"cannot read results from {path}: {err}") from None


def cmd_diff(args) -> int:
    cmd_inputs.writable_file(args.csv, "--csv")
    moves = diff_results(_read(args.a), _read(args.b), sqnr_tolerance_db=args.sqnr_tolerance)
    print(render_diff(moves))
    if args.csv:
        atomic_write_text(args.csv, moves.to_csv(index=False))
    return EXIT_PASS if moves.empty else EXIT_FAIL
