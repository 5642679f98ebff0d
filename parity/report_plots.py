"""The report's plots: SQNR against fp64 by K, and the bitwise-parity heatmap by layout and dtype."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from parity.cases import TENSORS
from parity.report_tables import accuracy_rows, dtype_label, layout_label, parity_rows, percent, plural, ran

LINE_STYLES = ["-", "--", ":", "-."]
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
    accuracy = accuracy_rows(frame)
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
    fig.suptitle(f"SQNR against fp64 by K: median per K (line), each case (dots); {plural(infinite, 'row')} "
                 f"with infinite SQNR (inf: bitwise equal to fp64) not drawn", fontsize=10)


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
    """The built-in plots whose data the frame holds."""
    plots = {}
    if np.isfinite(ran(accuracy_rows(frame))["sqnr_db"]).any():
        plots["sqnr_vs_k.png"] = partial(_plot_sqnr_vs_k, frame=frame)
    if len(ran(parity_rows(frame[frame["impl"] == candidate]))):
        plots["parity_heatmap.png"] = partial(_plot_parity_heatmap, frame=frame, candidate=candidate)
    return plots

