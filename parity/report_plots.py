"""The report's plots: the summary figure (one panel per implementation), SQNR against fp64 by K, and
the bitwise-parity heatmap by layout and dtype.

The SQNR plots draw the rows the verdict judges (parity.report_rows.judged_accuracy): the expected
outliers (tiny_amax data gives 0 dB by design) are counted in a title, drawn nowhere, and listed with
their reasons in the report's own section."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from parity.cases import TENSORS
from parity.report_rows import accuracy_rows, judged_accuracy, parity_rows, plural, ran, sqnr_unjudged
from parity.report_tables import dtype_label, layout_label, overall, percent

LINE_STYLES = ["-", "--", ":", "-."]
SUMMARY_PLOT = "summary.png"  # the figure of the report's first screen
PANELS_PER_ROW = 5
GREEN, RED, GREY = "#1e8e3e", "#d93025", "#444444"
MARKERS = "osD^v<>p"


def _identical_to(series: Mapping[str, pd.Series]) -> dict[str, str]:
    """impl -> the first earlier impl whose series is equal to its own (bitwise-equal implementations)."""
    same: dict[str, str] = {}
    names = list(series)
    for i, impl in enumerate(names):
        twin = next((other for other in names[:i] if other not in same and series[other].equals(series[impl])), None)
        if twin is not None:
            same[impl] = twin
    return same


def _plot_sqnr_vs_k(fig: Figure, frame: pd.DataFrame) -> None:
    """Median SQNR per K (a line per implementation) over each case (dots), a panel per tensor.
    Implementations with identical values (bitwise-equal ones) draw exactly over each other: each
    has its own marker and line style, the later ones thinner on top, and the legend says
    "identical to X", so every line stays visible and nobody reads one line as one implementation."""
    accuracy = judged_accuracy(frame)
    finite = accuracy[np.isfinite(accuracy["sqnr_db"])]
    tensors = [t for t in TENSORS if t in set(finite["tensor"])]
    impls = sorted(finite["impl"].unique())
    medians = {impl: rows.groupby(["tensor", "K"], observed=True)["sqnr_db"].median()
               for impl, rows in finite.groupby("impl")}
    twins = _identical_to(medians)
    styles = {impl: dict(color=f"C{i}", marker=MARKERS[i % len(MARKERS)], ls=LINE_STYLES[i % len(LINE_STYLES)],
                         lw=max(0.8, 2.6 - 0.6 * i), ms=4)
              for i, impl in enumerate(impls)}
    fig.set_size_inches(3.6 * len(tensors) + 1, 3.8)
    axes = fig.subplots(1, len(tensors), sharey=True, squeeze=False)[0]
    for ax, tensor in zip(axes, tensors):
        for impl, rows in finite[finite["tensor"] == tensor].groupby("impl"):
            ax.scatter(rows["K"], rows["sqnr_db"], s=6, alpha=0.25, color=styles[impl]["color"])
            median = medians[impl].loc[tensor]
            label = impl + (f" (identical to {twins[impl]})" if impl in twins else "")
            ax.plot(median.index, median.to_numpy(), label=label, mfc="none", **styles[impl])
        ax.set_xscale("log", base=2)
        ax.set(title=tensor, xlabel="K")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SQNR vs fp64 (dB)")
    handles = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(len(handles), 3), fontsize=8)
    infinite = int(np.isinf(accuracy["sqnr_db"]).sum())
    measured = ran(accuracy_rows(frame))
    outliers = int(sqnr_unjudged(measured).sum())
    fig.suptitle(f"SQNR against fp64 by K: median per K (line), each case (dots); not drawn: {plural(infinite, 'row')} "
                 f"with infinite SQNR (bitwise equal to fp64), {plural(outliers, 'row')} of expected outliers",
                 fontsize=10)


def _plot_parity_heatmap(fig: Figure, frame: pd.DataFrame, candidate: str) -> None:
    rows = ran(parity_rows(frame[frame["impl"] == candidate]))
    labelled = rows.assign(layout=layout_label(rows), dtypes=dtype_label(rows), bitwise=rows["bitwise"].astype(float))
    rate = 100 * labelled.pivot_table(index="layout", columns="dtypes", values="bitwise", aggfunc="mean")
    cases = labelled.pivot_table(index="layout", columns="dtypes", values="case_id", aggfunc="nunique")
    cases = cases.reindex(index=rate.index, columns=rate.columns)
    fig.set_size_inches(1.5 * rate.shape[1] + 3.5, 0.25 * rate.shape[0] + 1.8)
    ax = fig.subplots()
    image = ax.imshow(rate.to_numpy(dtype=float), cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(rate.shape[1]), rate.columns, fontsize=8)
    ax.set_yticks(range(rate.shape[0]), rate.index, fontsize=7, family="monospace")
    for (i, j), value in np.ndenumerate(rate.to_numpy(dtype=float)):
        if not math.isnan(value):
            ax.text(j, i, f"{percent(value, 1)}% n={int(cases.iat[i, j])}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="bitwise equal (%)")
    references = ", ".join(sorted(rows["reference"].unique()))
    ax.set_title(f"{candidate} bitwise equal to {references}\n(layout: in/w/go; n: cases; blank: not run)",
                 fontsize=9)


def standard_plots(frame: pd.DataFrame, candidate: str) -> dict[str, Callable]:
    """The built-in plots whose data the frame holds (SUMMARY_PLOT first)."""
    plots = {}
    if len(judged_accuracy(frame)):
        plots[SUMMARY_PLOT] = partial(summary_plot, frame=frame, candidate=candidate)
    if np.isfinite(judged_accuracy(frame)["sqnr_db"]).any():
        plots["sqnr_vs_k.png"] = partial(_plot_sqnr_vs_k, frame=frame)
    if len(ran(parity_rows(frame[frame["impl"] == candidate]))):
        plots["parity_heatmap.png"] = partial(_plot_parity_heatmap, frame=frame, candidate=candidate)
    return plots



def summary_plot(fig: Figure, frame: pd.DataFrame, candidate: str) -> None:
    """The report's first figure: one panel per implementation (the candidate first), a row per tensor:
    the median SQNR against fp64 of the judged rows (a dot, green at or above the floor of normal data,
    red below), the lowest judged SQNR (an open circle), the recipe's expected SQNR (grey bar) and the
    floor (red bar), and at the right the share bitwise equal to its recipe's reference. The numbers
    are the accuracy table's (parity.report_tables.overall)."""
    table = overall(frame).dropna(subset=["SQNR median (dB)"])
    impls = sorted(set(table.index.get_level_values("impl")), key=lambda impl: (impl != candidate, impl))
    present = set(table.index.get_level_values("tensor").astype(str))
    tensors = [tensor for tensor in TENSORS if tensor in present]
    columns = min(len(impls), PANELS_PER_ROW)
    rows = math.ceil(len(impls) / columns)
    fig.set_size_inches(min(2.55 * max(columns, 2) + 0.9, 12.4), rows * (0.3 * len(tensors) + 0.75)
                        + 0.3)
    axes = fig.subplots(rows, columns, sharex=True, sharey=True, squeeze=False).ravel()
    limits = _summary_limits(table)
    for ax, impl in zip(axes, impls):
        _summary_panel(ax, table.xs(impl, level="impl"), tensors, limits, impl, impl == candidate)
    for ax in axes[len(impls):]:
        ax.set_axis_off()
    handles = [Line2D([], [], color=GREEN, marker="o", ls="none", ms=5, label="median SQNR vs fp64 (dB)"),
               Line2D([], [], color=GREY, marker="o", mfc="none", ls="none", ms=5, label="lowest"),
               Line2D([], [], color=GREY, marker="|", ls="none", ms=9, mew=2, label="expected"),
               Line2D([], [], color=RED, marker="|", ls="none", ms=9, mew=2, label="floor"),
               Line2D([], [], ls="none", label="right: % bitwise equal")]
    fig.legend(handles=handles, loc="outside upper left", ncol=len(handles), fontsize=7,
               frameon=False, handletextpad=0.3, columnspacing=1.2)


def _summary_limits(table: pd.DataFrame) -> tuple[float, float]:
    """The SQNR range every panel shares: the floors and expected values with room around them, widened
    to the measured values unless those lie far off (such a value is drawn at the edge, its number
    written beside it)."""
    marks = pd.concat([table["SQNR floor (dB)"], table["expected SQNR (dB)"]]).dropna()
    measured = pd.concat([table["SQNR median (dB)"], table["SQNR min (dB)"]])
    measured = measured[np.isfinite(measured)]
    low, high = marks.min() - 8, marks.max() + 10
    if len(measured):
        low = max(min(low, measured.min() - 3), marks.min() - 30)
        high = min(max(high, measured.max() + 3), marks.max() + 30)
    return low, high


def _summary_panel(ax, rows: pd.DataFrame, tensors: list[str], limits: tuple[float, float], impl: str,
                   is_candidate: bool) -> None:
    """One implementation's panel of summary_plot: `rows` its accuracy table rows, by tensor."""
    low, high = limits
    rows = rows.set_axis(rows.index.astype(str))
    for y, tensor in enumerate(tensors):
        if tensor not in rows.index:
            continue
        row = rows.loc[tensor]
        floor, median, lowest = row["SQNR floor (dB)"], row["SQNR median (dB)"], row["SQNR min (dB)"]
        ax.plot([floor], [y], marker="|", ms=11, mew=2.2, color=RED, ls="none")
        ax.plot([row["expected SQNR (dB)"]], [y], marker="|", ms=11, mew=2.2, color=GREY, ls="none")
        shown = {name: min(max(value, low), high) for name, value in (("median", median), ("lowest", lowest))}
        ax.plot([shown["lowest"], shown["median"]], [y, y], color=GREY, lw=1, alpha=0.6)
        ax.plot([shown["lowest"]], [y], marker="o", mfc="none", color=GREY, ms=5, ls="none")
        ax.plot([shown["median"]], [y], marker="o", color=GREEN if median >= floor else RED, ms=6, ls="none")
        for name, value, dy in (("median", median, 4), ("lowest", lowest, -4)):
            if shown[name] == value or (name == "lowest" and value == median):
                continue  # on the shared range, or said by the median's label
            ax.annotate(f"{name} {value:.0f}", (shown[name], y), xytext=(4 if value < low else -4, dy),
                        textcoords="offset points", ha="left" if value < low else "right",
                        va="bottom" if dy > 0 else "top", fontsize=6.5, color=RED if value < floor else GREY)
        bitwise = row["bitwise vs its recipe's reference (%)"]
        ax.text(1.03, y, "–" if math.isnan(bitwise) else f"{percent(bitwise, 1)}%", transform=ax.get_yaxis_transform(),
                va="center", fontsize=7, color=GREY if math.isnan(bitwise) else GREEN if bitwise == 100 else RED)
    ax.set_yticks(range(len(tensors)), tensors, fontsize=7)
    ax.set_ylim(len(tensors) - 0.5, -0.6)  # output on top
    ax.set_xlim(low, high)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    name = impl.rsplit("/", 1)[-1]  # a file path's directories add width, not information
    recipe = rows["recipe"].iloc[0]
    ax.set_title(f"{name}\n{recipe}" + (" · candidate" if is_candidate else ""), fontsize=8, loc="left",
                 fontweight="bold" if is_candidate else "normal")
