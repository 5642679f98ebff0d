"""The report of `fp8-parity train`: its tables and plots, written through the one report writer.

parity.train trains and judges (TrainResult, its verdict); this module turns a TrainResult into
what a reader sees: the first divergence first, then the loss table, bitwise equality per GEMM,
the numerics per layer and GEMM, the time per step, the loss curves with the loss gap to the
baseline (the seed-to-seed band, DeepSeek-V3's 0.25%), and layer x step heatmaps of SQNR and
underflow. Runs that are bitwise equal draw the same curve; the line styles keep each visible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from parity.recipes import GEMMS, get_recipe
from parity.report import write_report
from parity.train_plan import DEEPSEEK_RELATIVE_LOSS_GAP, ROLES, TrainResult
from parity.train_verdict import loss_table, loss_window, losses_per_step

# Heatmaps write each cell's value into it while the grid is small enough to read them.
ANNOTATE_MAX_LAYERS, ANNOTATE_MAX_STEPS = 16, 12


def divergence_table(result: TrainResult) -> pd.DataFrame:
    """The first divergence in one row (the report's first section), or a row that says there is none."""
    divergence = result.divergence
    if divergence is None:
        what = (f"none: the loss differs from step {result.loss_differs_at} while every GEMM agrees"
                if result.loss_differs_at is not None else "none: bitwise equal in every GEMM at every step")
        return pd.DataFrame.from_records([dict(finding=what)])
    return pd.DataFrame.from_records([dict(
        step=divergence.step, **({"micro-batch": divergence.micro} if result.plan.grad_accum > 1 else {}),
        layer=divergence.layer, GEMM=divergence.gemm, against=result.runs["against"],
        **{"case file": str(divergence.case_file or "(not saved: no --out)")})])


def bitwise_table(result: TrainResult) -> pd.DataFrame:
    rows = result.frame[result.frame["role"] == "candidate"]
    grouped = rows.groupby("gemm", sort=False)
    differing = rows[~rows["bitwise"].astype(bool)].groupby("gemm", sort=False)["step"].min()
    return pd.DataFrame({"layer x calls": grouped.size(), "bitwise %": grouped["bitwise"].mean().mul(100).round(2),
                         "first step differing": differing}).reset_index()


def numerics_table(result: TrainResult, role: str = "candidate") -> pd.DataFrame:
    rows = result.frame[(result.frame["role"] == role) & result.frame["sampled"]]
    grouped = rows.groupby(["layer", "gemm"], sort=False)
    return pd.DataFrame({
        "min SQNR dB": grouped["sqnr_db"].min().round(2), "median SQNR dB": grouped["sqnr_db"].median().round(2),
        "max amax a": grouped["a_amax"].max(), "max underflow % a": grouped["a_underflow_pct"].max().round(3),
        "max saturated % a": grouped["a_saturated_pct"].max().round(3), "max amax b": grouped["b_amax"].max(),
        "max underflow % b": grouped["b_underflow_pct"].max().round(3),
        "max saturated % b": grouped["b_saturated_pct"].max().round(3),
    }).reset_index()


def curve_table(result: TrainResult) -> pd.DataFrame:
    steps = losses_per_step(result.frame)
    sampled = steps[steps["sampled"]]
    return sampled.pivot(index="step", columns="role", values="loss")[list(ROLES)].round(5).reset_index()


def timing_table(result: TrainResult) -> pd.DataFrame:
    """One row, in seconds: all steps, per step (mean and median: a shared machine's stalls move the
    mean only), per step with and without numerics, and each phase's share of the time."""
    timing = result.timing
    total = float(timing["seconds"].sum())
    sampled, plain = timing[timing["sampled"]], timing[~timing["sampled"]]
    shares = {f"{phase.removesuffix('_s')} (%)": round(100 * float(timing[phase].sum()) / total, 1) if total else None
              for phase in ("train_s", "compare_s", "numerics_s")}
    return pd.DataFrame.from_records([{
        "steps": len(timing), "seconds": round(total, 2), "s/step mean": round(float(timing["seconds"].mean()), 4),
        "s/step median": round(float(timing["seconds"].median()), 4),
        "s/sampled step": round(float(sampled["seconds"].mean()), 4) if len(sampled) else None,
        "s/other step": round(float(plain["seconds"].mean()), 4) if len(plain) else None, **shares}])


# Each role's line style: runs that are bitwise equal draw the same curve, so the styles (and widths)
# keep every one of them visible where they overlap.
LINE_STYLES = {"candidate": dict(linestyle="-", linewidth=3.0, alpha=0.6),
               "against": dict(linestyle="--", linewidth=1.5),
               "baseline": dict(linestyle=":", linewidth=1.5),
               "baseline_seed": dict(linestyle="-.", linewidth=1.0)}


def plot_loss(fig, result: TrainResult) -> None:
    """Top: each run's loss and the floor. Bottom: each run's loss relative to the baseline's, step
    by step, with the seed-to-seed noise (the baseline from another seed) as a band and DeepSeek-V3's
    0.25% as lines."""
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw=dict(height_ratios=(3, 2)))
    steps = losses_per_step(result.frame)
    losses = steps.pivot_table(index="step", columns="role", values="loss")
    for role in ROLES:
        if role in losses:
            top.plot(losses.index, losses[role], label=f"{role}: {result.runs[role]}", **LINE_STYLES[role])
    if result.source.entropy_rate is not None:
        top.axhline(result.source.entropy_rate, color="gray", linestyle="--", label="entropy rate (floor)")
    top.set_ylabel("loss (nats)")
    top.legend()
    if "baseline" in losses:
        gap = (losses.div(losses["baseline"], axis=0) - 1) * 100
        if "baseline_seed" in gap:
            noise = gap["baseline_seed"].abs()
            bottom.fill_between(gap.index, -noise, noise, color="gray", alpha=0.25, label="seed-to-seed noise")
        for role in ("candidate", "against"):
            if role in gap:
                bottom.plot(gap.index, gap[role], label=role, **LINE_STYLES[role])
        for sign in (1, -1):
            bottom.axhline(sign * DEEPSEEK_RELATIVE_LOSS_GAP * 100, color="red", linewidth=0.8,
                           label="DeepSeek-V3's 0.25%" if sign > 0 else None)
        # early steps differ by tens of percent and the end by hundredths: linear within DeepSeek's line
        bottom.set_yscale("symlog", linthresh=DEEPSEEK_RELATIVE_LOSS_GAP * 100)
        bottom.set_ylabel("loss vs baseline (%)")
        bottom.legend(fontsize="small")
    bottom.set_xlabel("step")


def layer_step_grid(result: TrainResult, column: str, gemm: str, *, worst: str) -> pd.DataFrame:
    """The candidate's `column` of `gemm` as a [layer (model order) x sampled step] grid; over the
    micro-batches of a step, the worst value (`worst`: "min" for SQNR, "max" for underflow)."""
    rows = result.frame[(result.frame["role"] == "candidate") & result.frame["sampled"]
                        & (result.frame["gemm"] == gemm)]
    grid = rows.pivot_table(index="layer", columns="step", values=column, aggfunc=worst, dropna=False)
    return grid.reindex(index=[name for name in result.layers if name in grid.index])


@dataclass(frozen=True)
class HeatScale:
    """How a heatmap colours and writes its values: the colour map over [low, high], the format of a
    value written into its cell, and whether zeros are written (not in an underflow map: it is
    mostly zeros, and the few cells that are not are what the reader looks for)."""

    cmap: str
    low: float
    high: float
    fmt: str
    annotate_zero: bool = True


def _draw_grid(axes, grid: pd.DataFrame, scale: HeatScale, *, title: str, show_layers: bool):
    """One heatmap panel: layers down, sampled steps across; blank where there is no value. Small grids
    get each cell's value written in."""
    values = grid.to_numpy(dtype=float)
    image = axes.imshow(np.where(np.isfinite(values), values, np.nan), cmap=scale.cmap, vmin=scale.low,
                        vmax=scale.high, aspect="auto", interpolation="nearest")
    steps = list(grid.columns)
    stride = max(1, math.ceil(len(steps) / 12))  # at most ~12 step labels
    axes.set_xticks(range(0, len(steps), stride), [str(s) for s in steps[::stride]], fontsize=7)
    if show_layers:  # the panels share the y axis: the first names the layers, the others hide the labels
        axes.set_yticks(range(len(grid.index)), list(grid.index), fontsize=6, family="monospace")
    else:
        axes.tick_params(labelleft=False)
    axes.set_xlabel("step", fontsize=8)
    axes.set_title(title, fontsize=8)
    if len(grid.index) <= ANNOTATE_MAX_LAYERS and len(steps) <= ANNOTATE_MAX_STEPS:
        for (i, j), value in np.ndenumerate(values):
            if np.isfinite(value) and (scale.annotate_zero or value != 0):
                red, green, blue, _ = image.cmap(image.norm(value))
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5  # white text on a dark cell
                axes.text(j, i, format(value, scale.fmt), ha="center", va="center", fontsize=5,
                          color="white" if dark else "black")
    return image


def _finite_range(grids: list[pd.DataFrame], *, floor: float | None = None) -> tuple[float, float]:
    values = np.concatenate([grid.to_numpy(dtype=float).ravel() for grid in grids])
    values = values[np.isfinite(values)]
    if not len(values):
        return 0.0, 1.0
    low, high = float(values.min()), float(values.max())
    low = floor if floor is not None else low
    return low, high if high > low else low + 1.0


def _grid_size(fig, result: TrainResult, columns: int, rows: int) -> None:
    steps = int(result.frame.loc[result.frame["sampled"], "step"].nunique())
    width = columns * (0.3 * steps + 2.2) + 3.0  # a panel's title, and the layer names on the left
    height = rows * (0.16 * len(result.layers) + 1.4) + 1.0
    fig.set_size_inches(min(max(width, 11.0), 24.0), min(max(height, 4.0), 30.0))


def plot_sqnr_heatmap(fig, result: TrainResult) -> None:
    """SQNR of the candidate against float64, one panel per GEMM: layers x sampled steps."""
    grids = {gemm: layer_step_grid(result, "sqnr_db", gemm, worst="min") for gemm in GEMMS}
    low, high = _finite_range(list(grids.values()))
    _grid_size(fig, result, len(GEMMS), 1)
    axes = fig.subplots(1, len(GEMMS), sharey=True, squeeze=False)[0]
    image = None
    for index, (ax, (gemm, grid)) in enumerate(zip(axes, grids.items())):
        image = _draw_grid(ax, grid, HeatScale("viridis", low, high, ".0f"), title=gemm, show_layers=index == 0)
    fig.colorbar(image, ax=list(axes), label="SQNR vs float64 (dB)", shrink=0.9)
    micro = "; the worst micro-batch of a step" if result.plan.grad_accum > 1 else ""
    fig.suptitle(f"SQNR against float64 per layer and sampled step{micro}\n{result.runs['candidate']} "
                 f"(blank: not run, or bitwise equal to float64)", fontsize=9)


def plot_underflow_heatmap(fig, result: TrainResult) -> None:
    """Underflow % of the candidate's operands: a row per operand side (a, b), a column per GEMM."""
    rows = result.frame[result.frame["role"] == "candidate"]
    recipe = get_recipe(rows["recipe"].iloc[0])
    grids = {(side, gemm): layer_step_grid(result, f"{side}_underflow_pct", gemm, worst="max")
             for side in "ab" for gemm in GEMMS}
    low, high = _finite_range(list(grids.values()), floor=0.0)
    _grid_size(fig, result, len(GEMMS), 2)
    axes = fig.subplots(2, len(GEMMS), sharey=True, squeeze=False)
    image = None
    for (side, gemm), grid in grids.items():
        row, column = "ab".index(side), GEMMS.index(gemm)
        cast = getattr(recipe.gemm(gemm), side)
        operand = recipe.gemm(gemm).operands["ab".index(side)]
        image = _draw_grid(axes[row][column], grid, HeatScale("magma_r", low, high, ".2g", annotate_zero=False),
                           title=f"{gemm}\n{side} = {operand} ({cast.short_str()})", show_layers=column == 0)
    fig.colorbar(image, ax=[ax for line in axes for ax in line], label="non-zero values quantized to zero (%)",
                 shrink=0.9)
    micro = "; the worst micro-batch of a step" if result.plan.grad_accum > 1 else ""
    fig.suptitle(f"Underflow per GEMM operand, layer and sampled step{micro}\n{result.runs['candidate']} "
                 f"(blank: a high-precision operand)", fontsize=9)


def write_train_report(result: TrainResult, out_dir: str | Path) -> list[Path]:
    """results.csv.gz, env.json, loss.png, sqnr_heatmap.png, underflow_heatmap.png, summary.md and
    index.html, through parity.report's one writer. The first divergence is the first section. An
    interrupted run's report has no plots (drawing them takes seconds, matplotlib's import included)."""
    plan = result.plan
    options = "".join([f", gradient accumulation {plan.grad_accum}" if plan.grad_accum > 1 else "",
                       ", activation checkpointing" if plan.checkpoint else "",
                       f", data {plan.data}" if plan.data else ""])
    incomplete = f" (INCOMPLETE: interrupted by {result.interrupted})" if result.interrupted else ""
    title = (f"fp8-parity train: {result.runs['candidate']}, {plan.model} model, {plan.steps} steps on "
             f"{plan.device}{options}{incomplete}")
    if result.crash is not None or not len(result.frame):  # what ran before the crash, and the crash
        what = result.crash or f"interrupted by {result.interrupted} before the first step finished"
        crash = pd.DataFrame.from_records([dict(finding=what)])
        frame = result.frame if len(result.frame) else crash
        return write_report(frame, out_dir, title=title, verdict=result.verdict, plots=False,
                            tables=[("Crash" if result.crash else "Interrupted",
                                     "a run raised, died or ran out of time; training stopped at that step"
                                     if result.crash else "nothing finished", crash)])
    tables = [
        (f"First divergence from {result.runs['against']}", "the first (step, layer, GEMM) in execution order where "
         "the candidate's GEMM result differs bitwise; its operands are the case file for check and bisect",
         divergence_table(result)),
        ("Loss", f"mean over the last {loss_window(result)} steps; "
                 + (f"the floor is the source's entropy rate {result.source.entropy_rate:.4f} nats"
                    if result.source.entropy_rate is not None else "no floor: the data's entropy rate is unknown"),
         loss_table(result)),
        (f"Bitwise equality with {result.runs['against']}", "every layer's GEMM at every call", bitwise_table(result)),
        (f"Numerics of {result.runs['candidate']} per layer and GEMM", f"steps sampled every {plan.sample_every}; "
         "SQNR against a float64 GEMM on the same operands; a/b: the GEMM's two operands; underflow: non-zero "
         "values quantized to zero; saturated: values on the fp8 max", numerics_table(result)),
        ("Loss at the sampled steps", None, curve_table(result)),
        ("Time", f"on {plan.device}; a sampled step also computes the numerics; shares: training (forward, backward, "
                 "optimizer of the four runs, with the probes), bitwise comparisons, numerics", timing_table(result)),
    ]
    plots = {"loss.png": partial(plot_loss, result=result)}
    if result.interrupted is not None:  # a Ctrl-C wants its prompt back: the tables are written in a second
        plots = {}
    elif result.frame["sampled"].any():
        plots.update({"sqnr_heatmap.png": partial(plot_sqnr_heatmap, result=result),
                      "underflow_heatmap.png": partial(plot_underflow_heatmap, result=result)})
    return write_report(result.frame, out_dir, title=title, verdict=result.verdict, tables=tables, plots=False,
                        extra_plots=plots)
