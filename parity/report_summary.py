"""The first screen of a report: what a reader needs in thirty seconds, before any table.

    the verdict          Verdict.short: PASS or FAIL and what was judged, without the examples
    a figure             one panel per implementation (parity.report_plots.summary_plot): per tensor,
                         the median SQNR against fp64 of the judged rows beside its expected value
                         and floor, and the share bitwise equal to its recipe's reference
    the worst judged     for the candidate, one line per policy: the judged value nearest its limit
    values               (or furthest beyond it) with its case and rerun command, then the first of
                         every other kind of finding (a crash, an operand, NaN/Inf, ...); findings
                         first
    what to run next     after a FAIL, the verdict's bisect command; after a PASS, the search that
                         goes further than this run did (the H200's own bits on a CPU, where this
                         run did not compare them; else a longer hypothesis search)

Every value is read from the results table: the same rows, floors and policies as the verdict
(parity.report_worst.with_floors and bound_rows judge as parity.policy does).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import pandas as pd

from parity.impls import recipe_flag
from parity.policy import Policy, evaluate
from parity.recipes import GRAD_BIAS_SQNR_DB, get_recipe
from parity.report_rows import judged_accuracy, plural, ran, rerun
from parity.report_verdict import METRIC_PHRASES, Verdict
from parity.report_worst import bound_rows, with_floors
from parity.rows import rows_from_frame
from parity.vocabulary import Kind

MESSAGE_CHARS = 140  # a finding's message in one summary line
EXTREMES_SHOWN = 6  # summary lines at most: with the verdict and the figure, what fits a first screen
NUMERIC_KINDS = {Kind.SQNR_DB, Kind.ACCUMULATION_BOUND, Kind.BITWISE, Kind.EXACT}  # said by a value line
HOPPER_WHY = ("checks new cases with every FP8 GEMM computed as an H200 computes it, bit for bit: fast-accumulation "
              "and accumulation-order bugs show in the numbers")
SEARCH_WHY = ("a longer hypothesis search of the case space than check's default, shrinking any failure to a "
              "minimal case")


@dataclass(frozen=True)
class Extreme:
    """One line of the summary: what judged a value (`judged`), the value beside its limit in words,
    the case, the command that reruns it, and whether it is within its limit."""

    judged: str
    value: str
    case_id: str
    rerun: str
    ok: bool


@dataclass(frozen=True)
class Summary:
    """The report's first screen (see the module docstring); `figure` is the file name of the
    per-implementation figure, None where none was drawn, and `caption` what its marks mean."""

    verdict: Verdict
    candidate: str
    extremes: list[Extreme]
    next_command: str | None
    next_why: str
    figure: str | None = None
    caption: str = ""


def summarize(frame: pd.DataFrame, judged: Verdict, candidate: str, *, parity: bool,
              figure: str | None = None) -> Summary:
    """The summary of a report: of a parity table (`parity`) with the candidate's worst judged values
    and a next step after a pass too; of another kind of table (a benchmark's) its verdict alone."""
    if not parity:
        return Summary(judged, candidate, [], judged.next_step, Verdict.NEXT_STEP_WHY)
    command, why = next_step(frame, judged, candidate)
    return Summary(judged, candidate, candidate_extremes(frame, candidate), command, why, figure,
                   figure_caption(frame) if figure else "")


def figure_caption(frame: pd.DataFrame) -> str:
    """The figure's caption: what it draws, and why grad_bias's expected SQNR is a fixed value where
    the figure has grad_bias."""
    caption = ("One panel per implementation, over the rows the verdict judges (the expected outliers are in their "
               "own section); at the right, the share of comparisons bitwise equal to its recipe's reference (-: "
               "not compared).")
    if (judged_accuracy(frame)["tensor"].astype(str) == "grad_bias").any():
        caption += (f" grad_bias's expected {GRAD_BIAS_SQNR_DB:.1f} dB is a fixed value, not the noise model's: "
                    f"grad_bias is a high-precision sum in every recipe (parity.recipes.GRAD_BIAS_SQNR_DB).")
    return caption


def _one_row(row: pd.Series):
    return rows_from_frame([row.to_dict()])[0]


def _extreme(judged: str, value: str, row: pd.Series, ok: bool) -> Extreme:
    return Extreme(judged, value, row["case_id"], rerun(_one_row(row)), ok)


def candidate_extremes(frame: pd.DataFrame, candidate: str) -> list[Extreme]:
    """The candidate's worst judged value under each policy, then the first finding of every kind
    no value line says; findings first."""
    mine = frame[frame["impl"] == candidate]
    measured = ran(mine)
    found = []
    sqnr = with_floors(measured)
    if len(sqnr):
        row = sqnr.loc[sqnr["margin"].idxmin()]
        side = "above" if row["margin"] >= 0 else "below"
        found.append(_extreme(f"SQNR against {row['reference']}", f"{row['tensor']} {row['sqnr_db']:.1f} dB, "
                              f"{abs(row['sqnr_db'] - row['floor']):.1f} dB {side} its floor of {row['floor']:.1f} dB "
                              f"({row['dist']} data)", row, row["margin"] >= 0))
    bound = bound_rows(measured)
    if len(bound):
        row = bound.loc[bound["bound_ratio"].idxmax()]
        ok = row["bound_ratio"] <= 1
        value = (f"{row['tensor']} at {row['bound_ratio']:.2g} of the bound ({row['ulp_max']:.0f} ULP)" if ok else
                 f"{row['tensor']} {row['bound_ratio']:.3g}x the bound: {row['n_beyond_bound']:.0f} of "
                 f"{row['numel']:.0f} elements beyond it")
        found.append(_extreme(f"accumulation bound against {row['reference']}", value, row, ok))
    found += _differing(measured)
    found += _other_findings(mine)
    found = sorted(found, key=lambda extreme: extreme.ok)  # stable: findings first, each in the order above
    if len(found) > EXTREMES_SHOWN:  # the first screen has room for so many; the evidence lists every finding
        more = len(found) - EXTREMES_SHOWN + 1
        found = found[:EXTREMES_SHOWN - 1] + [Extreme(f"and {plural(more, 'more kind')} of finding", "in the "
                                                      "evidence below", "", "", False)]
    return found


def _differing(measured: pd.DataFrame) -> list[Extreme]:
    """The row with the largest share of differing elements where bitwise equality is required (the
    bitwise policy, and the exact policy where the calibration vouches for the call); none when every
    such row is bitwise equal (the headline says so)."""
    calibrated = measured["exact"] == True if "exact" in measured else False  # noqa: E712 - True/False/NaN
    exact = (measured["policy"] == Policy.EXACT.value) & calibrated  # a results table has `exact` with hopper rows
    rows = measured[((measured["policy"] == Policy.BITWISE.value) | exact) & ~measured["bitwise"].astype(bool)]
    if rows.empty:
        return []
    row = rows.loc[(rows["n_diff"] / rows["numel"].clip(lower=1)).idxmax()]
    return [_extreme(f"bitwise against {row['reference']}", f"{row['tensor']}: {row['n_diff']:.0f} of "
                     f"{row['numel']:.0f} elements differ (none may)", row, False)]


def _clipped(text: str) -> str:
    """`text` cut at a word to MESSAGE_CHARS: the line names the kind, the rerun shows the rest."""
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS].rsplit(" ", 1)[0] + " ..."


def _other_findings(mine: pd.DataFrame) -> list[Extreme]:
    """The first violation of each kind no value line says (a crash, an operand, NaN/Inf, a contract,
    a paired gap), and the first comparison the reference could not make."""
    found, seen = [], set()
    for violation in evaluate(mine):
        if violation.kind in NUMERIC_KINDS or violation.kind in seen:
            continue
        seen.add(violation.kind)
        row = mine[(mine["case_id"] == violation.case_id) & (mine["reference"] == violation.reference)].iloc[0]
        message = _clipped(violation.message)
        found.append(_extreme(f"{violation.kind.value}: {METRIC_PHRASES.get(violation.kind, violation.kind)}",
                              message, row, False))
    failed = mine[mine["error"].isna() & mine["reference_error"].notna() & (mine["skipped"].fillna("") == "")]
    if len(failed):
        row = failed.iloc[0]
        first = _clipped(str(row["reference_error"]).strip().splitlines()[0])
        found.append(_extreme(f"not compared: {row['reference']} raised in {plural(len(failed), 'comparison')}",
                              first, row, False))
    return found


def next_step(frame: pd.DataFrame, judged: Verdict, candidate: str) -> tuple[str | None, str]:
    """(command, why) to run next: a FAIL's bisect; after a PASS, what this run did not cover; none
    after NO VERDICT (the headline says what is missing)."""
    if judged.next_step:
        return judged.next_step, Verdict.NEXT_STEP_WHY
    mine = frame[frame["impl"] == candidate]
    if not judged.ok or mine.empty:
        return None, ""
    recipe_name = mine["recipe"].iloc[0]
    recipe = get_recipe(recipe_name)
    device = str(mine["device"].iloc[0]).split(":")[0]
    command = ["fp8-parity", "check", "--impl", candidate, *recipe_flag(candidate, recipe_name), "--device", device]
    compared_hopper = (mine["policy"] == Policy.EXACT.value).any()
    block_scaled = any(gemm.kind == "BlockWise" for gemm in recipe.gemms)  # no Hopper model of them on a CPU
    if device == "cpu" and recipe.is_fp8 and not compared_hopper and not block_scaled:
        return shlex.join([*command, "--cpu-gemm", "hopper"]), HOPPER_WHY
    return shlex.join([*command, "--max-examples", "1000"]), SEARCH_WHY
