"""Reports of a results table: summary tables, a verdict, files for people, and diffs.

The one writer of every report format. It reads the tidy table of parity.runner.run_cases
(one row per case x implementation `impl` x `reference` x tensor x step) and gives:

    summary_tables(frame)    SQNR against fp64 (beside the recipe's expected SQNR and the policy's
                             floor) and bitwise parity against the parity reference, per
                             implementation x tensor; the crashes; where the worst values are (case,
                             data, why, rerun command); then by K, distribution, layout, dtype
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

This module writes the files; the parts live in parity.report_tables (the tables and their text),
parity.report_verdict (the verdict), parity.report_plots (the plots), parity.results_file (the
results file's schema and reading it) and parity.report_diff (diff); the names above are
importable from here.
"""

from __future__ import annotations

import gzip
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from parity.outputs import atomic_write_bytes, atomic_write_text
from parity.report_diff import CHANGES, diff_results, render_diff
from parity.report_plots import standard_plots
from parity.report_tables import ACCURACY_REFERENCE, TABLE_HEADINGS, displayed, summary_tables
from parity.report_verdict import Verdict, verdict
from parity.results_file import (ADDED_LATER, ENV_FILE, KEY, REQUIRED_COLUMNS, RESULTS_FILE, ResultsError,
                                 read_results, validated)

__all__ = ["ACCURACY_REFERENCE", "ADDED_LATER", "CHANGES", "ENV_FILE", "KEY", "REQUIRED_COLUMNS", "RESULTS_FILE",
           "ResultsError", "Verdict", "diff_results", "read_results", "render_diff", "summary_tables", "verdict",
           "write_report"]

CSS = """body{font-family:system-ui,sans-serif;max-width:80rem;margin:2rem auto;padding:0 1rem;color:#222}
.headline{font-size:1.15rem;font-weight:600;padding:.6rem .8rem;border-radius:4px}
.pass{background:#e6f4ea;border-left:6px solid #1e8e3e}.fail{background:#fce8e6;border-left:6px solid #d93025}
.env{color:#555;font-family:monospace}table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0 1.5rem}
th,td{border:1px solid #ccc;padding:.2rem .5rem;text-align:right}th{background:#f1f3f4}
td:first-child,td:nth-child(2){text-align:left}img{max-width:100%;border:1px solid #eee}.note{color:#555}"""



_judge = verdict  # write_report's parameter `verdict` shadows the function


def _env_line(env: Mapping) -> str:
    return " · ".join(f"{key} {value}" for key, value in env.items() if value not in (None, ""))



def _drawn(name: str, draw: Callable[[Figure], None]) -> bytes:
    """The image file `name` (its suffix gives the format) that `draw` makes."""
    fig = Figure(layout="constrained")
    FigureCanvasAgg(fig)
    draw(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(name).suffix.lstrip(".") or "png", dpi=110)
    return buffer.getvalue()


def _markdown(title: str, judged: Verdict, env: Mapping, sections: list, images: list[Path]) -> str:
    lines = [f"# {title}", "", f"**{judged.headline}**", "", _env_line(env), "", *(f"- {d}" for d in judged.details)]
    for heading, note, table in sections:
        lines += ["", f"## {heading}", ""] + ([note, ""] if note else [])
        text, align = displayed(table)
        lines.append(text.to_markdown(index=False, disable_numparse=True, colalign=align) if len(text) else "(no rows)")
    lines += ["", "## Plots", ""] + [f"![{image.stem}]({image.name})" for image in images]
    if judged.next_step:
        lines += ["", "## What to run next", "", f"`{judged.next_step}`: {Verdict.NEXT_STEP_WHY}"]
    return "\n".join(lines) + "\n"


def _html(title: str, judged: Verdict, env: Mapping, sections: list, images: list[Path]) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>", f'<p class="headline {"pass" if judged.ok else "fail"}">{e(judged.headline)}</p>',
            f'<p class="env">{e(_env_line(env))}</p>', "<ul>", *(f"<li>{e(d)}</li>" for d in judged.details), "</ul>"]
    for heading, note, table in sections:
        body += [f"<h2>{e(heading)}</h2>"] + ([f'<p class="note">{e(note)}</p>'] if note else [])
        text, _ = displayed(table)
        body.append(text.to_html(index=False, border=0) if len(text) else "<p>(no rows)</p>")
    body += ["<h2>Plots</h2>", *(f'<p><img src="{e(i.name)}" alt="{e(i.stem)}" /></p>' for i in images)]
    if judged.next_step:
        body += ["<h2>What to run next</h2>", f"<p><code>{e(judged.next_step)}</code>: {e(Verdict.NEXT_STEP_WHY)}</p>"]
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8" />\n<title>{e(title)}</title>\n'
            f"<style>\n{CSS}\n</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")


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
    summary.md      title, the verdict's headline, the environment in one line, the evidence,
                    then the tables (GitHub Markdown)
    index.html      the same as a standalone page (inline CSS, no scripts, no external files)
    *.png           with plots=True: sqnr_vs_k.png and parity_heatmap.png (where the frame
                    has their data), then `extra_plots` (file name -> draw(fig)) in any case

    `verdict` defaults to verdict(frame, candidate=...); pass your own to
    headline another kind of report. `extra_tables` (heading -> table) follow the summary.
    `tables` ((heading, note, table) sections) replaces the parity summary: then `frame` may be
    any tidy table (a benchmark's), `verdict` is required and plots=False skips the parity plots.
    write_table=False leaves results.csv.gz and env.json as they are (`report DIR` re-renders
    from them and must never rewrite its own input); they are then not in the list returned.

    Nothing lost, nothing half-written: every file is rendered in memory first (an error in a
    table or a plot touches no file), then each is written atomically (parity.outputs): the
    table and env.json first, summary.md and index.html last, and a summary of the table being
    replaced is removed before it, so a run cut short never leaves a summary beside a table it
    does not describe (`fp8-parity report DIR` renders it again).
    """
    o = ReportOptions(**options)
    frame = _checked(frame, o)
    out = Path(out_dir)
    judged = o.verdict if o.verdict is not None else _judge(frame, candidate=o.candidate)
    env = frame.attrs.get("env", {})
    drawings = {**(standard_plots(frame, o.candidate) if o.plots else {}), **(o.extra_plots or {})}
    images = {out / name: _drawn(name, draw) for name, draw in drawings.items()}
    tables = o.tables if o.tables is not None else [(*TABLE_HEADINGS[name], table)
                                                    for name, table in summary_tables(frame).items()]
    sections = [*tables, *((name, None, table) for name, table in (o.extra_tables or {}).items())]
    pages = {out / "summary.md": _markdown(o.title, judged, env, sections, list(images)),
             out / "index.html": _html(o.title, judged, env, sections, list(images))}
    written = []
    if o.write_table:
        data = {out / RESULTS_FILE: gzip.compress(frame.to_csv(index=False).encode(), mtime=0),
                out / ENV_FILE: (json.dumps(env, indent=2, default=str) + "\n").encode()}
        for page in pages:
            page.unlink(missing_ok=True)  # it describes the table about to be replaced
        written += [atomic_write_bytes(path, content) for path, content in data.items()]
    written += [atomic_write_bytes(path, content) for path, content in images.items()]
    return written + [atomic_write_text(path, text) for path, text in pages.items()]


def _checked(frame: pd.DataFrame, o: ReportOptions) -> pd.DataFrame:
    """A parity table, validated; any tidy table with its own sections and verdict."""
    if o.tables is None:
        return validated(frame)
    if o.verdict is None:
        raise ValueError("write_report(tables=...) needs a verdict: the default one judges parity rows")
    return frame
