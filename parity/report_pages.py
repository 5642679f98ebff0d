"""The report's two pages, summary.md and index.html, from the same parts in the same order.

    the summary     the verdict (Verdict.short), the per-implementation figure, the candidate's
                    worst judged values with their cases and rerun commands, what to run next
                    (parity.report_summary): in the HTML one <section id="summary"> that fits the
                    first screen of a 1280x800 window (property_tests/test_browser.py checks it)
    the context     the environment in one line; the evidence: the verdict's details, and its
                    full headline where the summary shortened it
    the sections    one per table (heading, note, table); an empty table's section is left out
                    (a reader should never meet "(no rows)"), and a folded one (the per-group
                    breakdowns, the long per-tensor lists) sits in a <details> the reader opens
    the plots

The HTML is standalone (inline CSS, no scripts, no external files) and well-formed XML. Every
table sits in a box that scrolls sideways on its own (overflow-x: auto), so a wide table never
widens the page; prose cells keep a readable width, case ids may wrap at their "|" and commands at
their spaces.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import pandas as pd

from parity.report_summary import Summary
from parity.report_tables import displayed

CSS = """body{font-family:system-ui,sans-serif;max-width:80rem;margin:.8rem auto;padding:0 1rem;color:#222;
line-height:1.35}h1{font-size:1.35rem;margin:.2rem 0 .4rem}h2{font-size:1.15rem;margin:1.6rem 0 .4rem}
.headline{font-size:1.02rem;font-weight:600;padding:.45rem .7rem;border-radius:4px;margin:.3rem 0}
.pass{background:#e6f4ea;border-left:6px solid #1e8e3e}.fail{background:#fce8e6;border-left:6px solid #d93025}
figure{margin:.4rem 0}figcaption{font-size:.78rem;color:#555}.extremes{font-size:.88rem;margin:.3rem 0;
padding-left:1.2rem}.extremes li{margin:.15rem 0}.finding::marker{color:#d93025}.within::marker{color:#1e8e3e}
.next{font-size:.9rem;margin:.3rem 0}code{font-size:.82em;overflow-wrap:anywhere}
.env{color:#555;font-family:monospace;font-size:.78rem;overflow-wrap:anywhere}.note{color:#555;font-size:.9rem}
.scroll{overflow-x:auto;max-width:100%;margin:.4rem 0 1.2rem}table{border-collapse:collapse;font-size:.8rem}
th,td{border:1px solid #ccc;padding:.2rem .45rem;text-align:left;vertical-align:top}th{background:#f1f3f4}
td.num{text-align:right;white-space:nowrap}td.prose{min-width:18rem}td.id{font-family:monospace;min-width:12rem}
td.cmd{font-family:monospace;font-size:.75rem;min-width:24rem}details>summary{cursor:pointer;font-weight:600;
font-size:1.05rem;margin:1.2rem 0 .4rem}img{max-width:100%;height:auto;border:1px solid #eee}"""
PROSE_COLUMNS = {"why", "exception", "tensors"}  # text a reader reads: kept wide enough to read
ID_COLUMNS = {"case", "example case", "case_id"}  # case ids: may wrap at their "|"
COMMAND_COLUMNS = {"rerun"}
EVIDENCE_OPEN = 6  # evidence of at most this many lines is shown open; a longer one is folded


@dataclass(frozen=True)
class Section:
    """One table of a report: its heading, a note under it, the table; `folded` puts it in a
    <details> the reader opens (the Markdown page shows every section)."""

    heading: str
    note: str | None
    table: pd.DataFrame
    folded: bool = False


def env_line(env: Mapping) -> str:
    return " · ".join(f"{key} {value}" for key, value in env.items() if value not in (None, ""))


def _extreme_md(extreme) -> str:
    mark = "within its limit" if extreme.ok else "finding"
    where = (f"; rerun: `{extreme.rerun}`" if extreme.rerun else  # the rerun names the case
             f"; case `{extreme.case_id}`" if extreme.case_id else "")
    return f"- **{extreme.judged}** ({mark}): {extreme.value}{where}"


def markdown_page(title: str, summary: Summary, env: Mapping, sections: list[Section], images: list[Path]) -> str:
    judged = summary.verdict
    lines = [f"# {title}", "", f"**{judged.short}**", ""]
    if summary.figure:
        lines += [f"![{Path(summary.figure).stem}]({summary.figure})", "", f"_{summary.caption}_", ""]
    if summary.extremes:
        lines += [f"Worst judged values of {summary.candidate}:", "", *map(_extreme_md, summary.extremes), ""]
    if summary.next_command:
        lines += [f"**What to run next:** `{summary.next_command}`: {summary.next_why}", ""]
    lines += [env_line(env), ""]
    lines += [f"The verdict in full: {judged.headline}", ""] if judged.short != judged.headline else []
    lines += [f"- {detail}" for detail in judged.details]  # the evidence
    for section in sections:
        if not len(section.table):
            continue
        lines += ["", f"## {section.heading}", ""] + ([section.note, ""] if section.note else [])
        text, align = displayed(section.table)
        lines.append(text.to_markdown(index=False, disable_numparse=True, colalign=align))
    shown = [image for image in images if image.name != summary.figure]
    if shown:
        lines += ["", "## Plots", ""] + [f"![{image.stem}]({image.name})" for image in shown]
    return "\n".join(lines) + "\n"


def html_table(table: pd.DataFrame) -> str:
    """`table` as text (parity.report_tables.displayed) in a box that scrolls sideways on its own;
    each cell's class says how it may wrap (see CSS)."""
    e = html.escape
    text, align = displayed(table)
    kinds = ["num" if side == "right" else "prose" if name in PROSE_COLUMNS else "id" if name in ID_COLUMNS
             else "cmd" if name in COMMAND_COLUMNS else "" for name, side in zip(text.columns, align)]

    def cell(value: str, kind: str) -> str:
        shown = e(value).replace("|", "|<wbr />") if kind == "id" else e(value)
        return f'<td class="{kind}">{shown}</td>' if kind else f"<td>{shown}</td>"

    head = "".join(f"<th>{e(name)}</th>" for name in text.columns)
    body = "\n".join("<tr>" + "".join(cell(v, k) for v, k in zip(row, kinds)) + "</tr>"
                     for row in text.itertuples(index=False, name=None))
    return f'<div class="scroll"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table></div>'


def _summary_html(summary: Summary, sizes: Mapping[str, tuple[int, int]]) -> list[str]:
    e, judged = html.escape, summary.verdict
    body = ['<section id="summary">', f'<p class="headline {"pass" if judged.ok else "fail"}">{e(judged.short)}</p>']
    if summary.figure:
        width, height = sizes.get(summary.figure, (0, 0))
        size = f' width="{width}" height="{height}"' if width else ""
        body += [f'<figure><img src="{e(summary.figure)}"{size} alt="SQNR and bitwise parity per implementation" />',
                 f"<figcaption>{e(summary.caption)}</figcaption></figure>"]
    if summary.extremes:
        body.append(f'<p class="next">Worst judged values of <b>{e(summary.candidate)}</b>:</p><ul class="extremes">')
        for x in summary.extremes:
            where = (f" · rerun: <code>{e(x.rerun)}</code>" if x.rerun else
                     f" · case <code>{e(x.case_id)}</code>" if x.case_id else "")
            body.append(f'<li class="{"within" if x.ok else "finding"}"><b>{e(x.judged)}</b>: {e(x.value)}{where}</li>')
        body.append("</ul>")
    if summary.next_command:
        body.append(f'<p class="next"><b>What to run next:</b> <code>{e(summary.next_command)}</code>: '
                    f"{e(summary.next_why)}</p>")
    return body + ["</section>"]


def html_page(title: str, summary: Summary, env: Mapping, sections: list[Section], images: list[Path],
              sizes: Mapping[str, tuple[int, int]]) -> str:
    e, judged = html.escape, summary.verdict
    body = [f"<h1>{e(title)}</h1>", *_summary_html(summary, sizes), f'<p class="env">{e(env_line(env))}</p>']
    if judged.details or judged.short != judged.headline:
        opened = ' open="open"' if len(judged.details) <= EVIDENCE_OPEN else ""  # a long list would bury the tables
        body += [f"<details{opened}><summary>Evidence ({len(judged.details)} lines)</summary>"]
        body += [f"<p>{e(judged.headline)}</p>"] if judged.short != judged.headline else []
        body += ["<ul>", *(f"<li>{e(d)}</li>" for d in judged.details), "</ul></details>"]
    for section in sections:
        if not len(section.table):
            continue
        note = [f'<p class="note">{e(section.note)}</p>'] if section.note else []
        if section.folded:
            body += [f"<details><summary>{e(section.heading)} ({len(section.table)} rows)</summary>", *note,
                     html_table(section.table), "</details>"]
        else:
            body += [f"<h2>{e(section.heading)}</h2>", *note, html_table(section.table)]
    shown = [image for image in images if image.name != summary.figure]
    if shown:
        body += ["<h2>Plots</h2>", *(f'<p><img src="{e(i.name)}" alt="{e(i.stem)}" /></p>' for i in shown)]
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8" />\n<title>{e(title)}</title>\n'
            f"<style>\n{CSS}\n</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")
