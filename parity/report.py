"""Reports of a results table: summary tables, a verdict, files for people, and diffs.

The one writer of every report format. It reads the tidy table of parity.runner.run_cases
(one row per case x implementation `impl` x `reference` x tensor x step) and gives:

    summary_tables(frame)    over the rows the verdict judges: SQNR against fp64 (beside the
                             recipe's expected SQNR and the policy's floor) and bitwise parity
                             against the parity reference, per implementation x tensor; the
                             crashes; where the worst judged values are (case, data, why, rerun
                             command); the expected outliers apart, with their reasons; then by K,
                             distribution, layout, dtype
    verdict(frame)           PASS/FAIL of one candidate in one sentence, with the evidence
    write_report(frame, d)   results.csv.gz, summary.md, index.html, env.json and PNG plots in d
    read_results(path)       a results file or report directory -> the same table, or a
                             ResultsError that says what the file is instead
    diff_results(a, b)       the rows whose metrics moved between two runs, and those only in one
                             (render_diff prints counts, then the largest moves, bounded)

SQNR statistics are order statistics (pandas' interpolation="lower"): every number shown was
measured on some case, and SQNR = inf (the candidate equals the fp64 result bitwise, as on
all-zero data) is a legitimate value that sorts last, never a NaN from interpolating inf - inf.
A row whose implementation raised has no metrics: it counts as a crash, not in the accuracy.

A report opens with its summary (parity.report_summary), made to be read in thirty seconds: the
verdict, one figure panel per implementation, the candidate's worst judged values with their
cases and rerun commands, and what to run next; the tables follow.

This module writes the files; the parts live in parity.report_rows (which rows each part reads:
judged, expected outliers, crashes), parity.report_tables (the tables and their text),
parity.report_worst (the worst judged values), parity.report_verdict (the verdict),
parity.report_summary (the first screen), parity.report_plots (the plots), parity.report_pages (the
Markdown and HTML pages), parity.results_file (the results file's schema and reading it) and
parity.report_diff (diff); the names above are importable from here.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from parity.folder_manifest import write_files
from parity.report_diff import CHANGES, diff_results, render_diff
from parity.report_pages import Section, html_page, markdown_page
from parity.report_plots import SUMMARY_PLOT, standard_plots
from parity.report_summary import summarize
from parity.policy import ACCURACY_REFERENCE
from parity.report_tables import TABLE_HEADINGS, section_note, summary_tables
from parity.report_verdict import Verdict, verdict
from parity.results_file import (encoded, ADDED_LATER, ENV_FILE, KEY, REQUIRED_COLUMNS, RESULTS_FILE, ResultsError,
                                 read_results, validated)

__all__ = ["ACCURACY_REFERENCE", "ADDED_LATER", "CHANGES", "ENV_FILE", "KEY", "REQUIRED_COLUMNS", "RESULTS_FILE",
           "ResultsError", "Verdict", "diff_results", "read_results", "render_diff", "summary_tables", "verdict",
           "write_report"]

FOLDED = {"worst", "by_k", "by_dist", "by_layout", "by_dtype"}  # long lists a reader opens when they need them


_judge = verdict  # write_report's parameter `verdict` shadows the function


def _drawn(name: str, draw: Callable[[Figure], None]) -> bytes:
    """The image file `name` (its suffix gives the format) that `draw` makes."""
    fig = Figure(layout="constrained")
    FigureCanvasAgg(fig)
    draw(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(name).suffix.lstrip(".") or "png", dpi=110)
    return buffer.getvalue()


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG (from its IHDR chunk): the page reserves the image's box before it loads."""
    if not data.startswith(b"\x89PNG"):
        return 0, 0
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _sections(frame: pd.DataFrame, o: "ReportOptions") -> list[Section]:
    """The report's sections: the parity tables (or the caller's own `tables`), then `extra_tables`."""
    if o.tables is not None:
        tables = [Section(heading, note, table) for heading, note, table in o.tables]
    else:
        tables = [Section(TABLE_HEADINGS[name][0], section_note(name, table), table, folded=name in FOLDED)
                  for name, table in summary_tables(frame).items()]
    return [*tables, *(Section(name, None, table, folded=True) for name, table in (o.extra_tables or {}).items())]


@dataclass(frozen=True)
class ReportOptions:
    """What write_report writes beside the table's own report (see write_report)."""

    title: str = "fp8-parity report"
    candidate: str = "fp8_impl"
    verdict: Verdict | None = None
    extra_tables: Mapping[str, pd.DataFrame] | None = None
    plots: bool = True
    extra_plots: Mapping[str, Callable[[Figure], None]] | None = None
    tables: Sequence[tuple[str, str | None, pd.DataFrame]] | None = None
    write_table: bool = True


def write_report(frame: pd.DataFrame, out_dir: str | Path, **options) -> list[Path]:
    """Write the report of `frame` into `out_dir` (created) and return the paths written. `options`
    (ReportOptions): title, candidate, verdict, extra_tables, plots, extra_plots, tables, write_table.

    results.csv.gz  the full tidy table (tuples as text; read it back with read_results)
    env.json        frame.attrs["env"]: versions, device, git commit
    summary.md      title, the summary (the verdict's short headline, the figure, the worst
                    judged values, what to run next), the environment in one line, the
                    evidence, then the tables (GitHub Markdown; parity.report_pages)
    index.html      the same as a standalone page (inline CSS, no scripts, no external files),
                    whose summary fits the first screen and whose tables scroll in their own box
    *.png           with plots=True: summary.png (the summary's figure), sqnr_vs_k.png and
                    parity_heatmap.png (where the frame has their data), then `extra_plots`
                    (file name -> draw(fig)) in any case

    `verdict` defaults to verdict(frame, candidate=...); pass your own to
    headline another kind of report. `extra_tables` (heading -> table) follow the tables, folded
    in the HTML. A section whose table is empty is left out.
    `tables` ((heading, note, table) sections) replaces the parity summary: then `frame` may be
    any tidy table (a benchmark's), `verdict` is required and plots=False skips the parity plots.
    write_table=False leaves results.csv.gz and env.json as they are (`report DIR` re-renders
    from them and must never rewrite its own input); they are then not in the list returned.

    Nothing lost, nothing half-written: every file is rendered in memory first (an error in a
    table or a plot touches no file), then each is written atomically and listed in the folder's
    manifest (parity.folder_manifest: the proof that fp8-parity wrote them, which a later run's
    check of the folder reads): the table and env.json first, summary.md and index.html last, and
    a summary of the table being replaced is removed before it, so a run cut short never leaves a
    summary beside a table it does not describe (`fp8-parity report DIR` renders it again).
    Writes into `out_dir` whatever it holds: the command checks the folder first (check_folder).
    """
    o = ReportOptions(**options)
    frame = _checked(frame, o)
    out = Path(out_dir)
    judged = o.verdict if o.verdict is not None else _judge(frame, candidate=o.candidate)
    env = frame.attrs.get("env", {})
    drawings = {**(standard_plots(frame, o.candidate) if o.plots else {}), **(o.extra_plots or {})}
    images = {out / name: _drawn(name, draw) for name, draw in drawings.items()}
    summary = summarize(frame, judged, o.candidate, parity=o.tables is None,
                        figure=SUMMARY_PLOT if out / SUMMARY_PLOT in images else None)
    sections = _sections(frame, o)
    sizes = {path.name: _png_size(data) for path, data in images.items()}
    pages = {out / "summary.md": markdown_page(o.title, summary, env, sections, list(images)),
             out / "index.html": html_page(o.title, summary, env, sections, list(images), sizes)}
    files = {}
    if o.write_table:
        files = {RESULTS_FILE: encoded(frame), ENV_FILE: (json.dumps(env, indent=2, default=str) + "\n").encode()}
        for page in pages:
            page.unlink(missing_ok=True)  # it describes the table about to be replaced
    files.update({path.name: content for path, content in images.items()})
    files.update({path.name: text.encode() for path, text in pages.items()})
    return write_files(out, files)  # in this order: the table first, the pages last


def _checked(frame: pd.DataFrame, o: ReportOptions) -> pd.DataFrame:
    """A parity table, validated; any tidy table with its own sections and verdict."""
    if o.tables is None:
        return validated(frame)
    if o.verdict is None:
        raise ValueError("write_report(tables=...) needs a verdict: the default one judges parity rows")
    return frame
