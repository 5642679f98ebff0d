"""`fp8-parity diff`: the rows whose metrics moved between two runs, and those only in one."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from parity.report_tables import displayed, plural
from parity.results_file import KEY, validated

# `diff`: the moved rows printed, largest first (every row is in --csv). 40 rows fill a screen; a
# regression that moves more shows its pattern in the first 40.
DIFF_ROWS_SHOWN = 40
# `diff`: below this share of the smaller run's rows with a counterpart in the other, the two runs
# are mostly different cases (another preset, seed or sample size) and their moves say little.
DIFF_MIN_MATCHED_SHARE = 0.5


# `diff`: the metrics two rows must share, bit for bit, to be "identical". Against an exact reference (fp64,
# emulated:<recipe>) these are the candidate's own numbers (where its error is largest, how large, how many
# elements differ): equal on two machines, the two computed the same result; rows of a bitwise-equal pair
# say only that both pairs were equal.
IDENTICAL_METRICS = ("bitwise", "n_diff", "sqnr_db", "max_abs_err", "max_abs_index", "nan", "inf")

CHANGES = ["lost bitwise parity", "started raising", "NaN/Inf count changed", "SQNR fell", "SQNR rose",
           "gained bitwise parity", "stopped raising", "only in A", "only in B"]


def _changes(rows: pd.DataFrame, change, a_value, b_value, delta=math.nan) -> pd.DataFrame:
    return rows[KEY].assign(change=change, a_value=a_value, b_value=b_value, delta=delta)


def diff_results(a: pd.DataFrame, b: pd.DataFrame, *, sqnr_tolerance_db: float = 0.1) -> pd.DataFrame:
    """The rows of two result sets (two torch versions, two commits) whose metrics moved beyond
    noise, one row per change, keyed by (case_id, impl, reference, tensor, step):

    lost/gained bitwise parity; started/stopped raising (the implementation, or the reference:
    "reference: ..."); NaN/Inf count changed (the candidate's non-finite elements); SQNR
    fell/rose by more than `sqnr_tolerance_db`; only in A / only in B (a row of one run without a
    counterpart in the other: not a move; render_diff counts them apart). Metrics are compared
    where neither side raised. A key that repeats within a set (a case run twice) is one
    measurement, since a case id fixes its data: its first row stands for it.

    Why 0.1 dB: a case id fixes its data, so the same software gives identical metrics on a
    rerun: any move is a change of the software, not sampling noise. 0.1 dB is ~2.3% in noise
    power: far below the spread between recipes (several dB) yet above the rounding of a CSV
    written with a few significant digits, so only real changes show.
    """
    columns = list(dict.fromkeys([*KEY, "raised", *IDENTICAL_METRICS]))
    a_cases, b_cases = (frame.attrs.get("env", {}).get("cases") for frame in (a, b))  # the sweep's case set, in words
    a, b = (frame.assign(raised=frame["error"].fillna("reference: " + frame["reference_error"]))[columns]
            .drop_duplicates(KEY) for frame in (validated(a), validated(b)))
    merged = a.merge(b, on=KEY, how="outer", suffixes=("_a", "_b"), indicator=True)
    both = merged[merged["_merge"] == "both"]
    raised_a, raised_b = both["raised_a"].notna(), both["raised_b"].notna()
    raising = both[raised_a != raised_b]
    ran = both[~raised_a & ~raised_b].assign(nonfinite_a=lambda r: (r["nan_a"] + r["inf_a"]).astype("Int64"),
                                              nonfinite_b=lambda r: (r["nan_b"] + r["inf_b"]).astype("Int64"))
    flipped = ran[ran["bitwise_a"].astype(bool) != ran["bitwise_b"].astype(bool)]
    recounted = ran[ran["nonfinite_a"].ne(ran["nonfinite_b"]).fillna(True)  # missing on both sides: no metrics
                    & (ran["nonfinite_a"].notna() | ran["nonfinite_b"].notna())]
    moved = ran[(ran["sqnr_db_b"] - ran["sqnr_db_a"]).abs() > sqnr_tolerance_db]  # inf - inf is NaN: not moved
    found = [
        _changes(merged[merged["_merge"] == "left_only"], "only in A", None, None),
        _changes(merged[merged["_merge"] == "right_only"], "only in B", None, None),
        _changes(raising, np.where(raising["raised_b"].notna(), "started raising", "stopped raising"),
                 raising["raised_a"], raising["raised_b"]),
        _changes(flipped, np.where(flipped["bitwise_a"].astype(bool), "lost bitwise parity", "gained bitwise parity"),
                 flipped["bitwise_a"], flipped["bitwise_b"]),
        _changes(recounted, "NaN/Inf count changed", recounted["nonfinite_a"], recounted["nonfinite_b"],
                 (recounted["nonfinite_b"] - recounted["nonfinite_a"]).astype("float64")),
        _changes(moved, np.where(moved["sqnr_db_b"] < moved["sqnr_db_a"], "SQNR fell", "SQNR rose"),
                 moved["sqnr_db_a"], moved["sqnr_db_b"], moved["sqnr_db_b"] - moved["sqnr_db_a"]),
    ]
    diff = pd.concat([f.astype({"a_value": object, "b_value": object}) for f in found], ignore_index=True)
    diff = (diff.assign(change=pd.Categorical(diff["change"], categories=CHANGES))
            .sort_values(["change", *KEY], ignore_index=True))
    diff.attrs.update(rows_compared=len(both), rows_identical=_identical(both), sqnr_tolerance_db=sqnr_tolerance_db,
                      rows_a=len(a), rows_b=len(b),
                      cases_a=a_cases, cases_b=b_cases)
    return diff


def _identical(both: pd.DataFrame) -> int:
    """How many rows of both runs have the same metrics to the last bit (IDENTICAL_METRICS, and the same
    error or none): two runs that computed the same numbers, not merely numbers that moved within noise."""
    same = pd.Series(True, index=both.index)
    for column in IDENTICAL_METRICS:
        a, b = both[f"{column}_a"], both[f"{column}_b"]
        same &= (a == b) | (a.isna() & b.isna())
    return int((same & (both["raised_a"].fillna("") == both["raised_b"].fillna(""))).sum())


ONE_SIDED = ["only in A", "only in B"]


def render_diff(diff: pd.DataFrame) -> str:
    """What `fp8-parity diff` prints: first, in one line, when the two runs hold mostly different
    cases (other presets, or under DIFF_MIN_MATCHED_SHARE of the rows matched); the rows matched,
    only in A and only in B; the moves by kind; then the DIFF_ROWS_SHOWN largest moves (worst kind
    first, then the largest |delta|) and how many more there are."""
    compared, tolerance = diff.attrs.get("rows_compared", "?"), diff.attrs.get("sqnr_tolerance_db", "?")
    counts = diff["change"].value_counts(sort=False) if len(diff) else pd.Series(0, index=CHANGES)
    only_a, only_b = (int(counts.get(side, 0)) for side in ONE_SIDED)
    lines = []
    cases_a, cases_b = diff.attrs.get("cases_a"), diff.attrs.get("cases_b")
    smaller = min(diff.attrs.get("rows_a", 0), diff.attrs.get("rows_b", 0))
    if cases_a and cases_b and cases_a != cases_b:
        lines.append(f"A and B ran different cases (A: {cases_a}; B: {cases_b}): only the rows of both are compared.")
    elif isinstance(compared, int) and compared < DIFF_MIN_MATCHED_SHARE * smaller:
        lines.append(f"A and B share only {compared} of the smaller run's {smaller} rows: they ran mostly different "
                     f"cases (another preset, seed or --samples); compare runs of the same sweep.")
    lines.append(f"{compared} rows in both, {only_a} only in A, {only_b} only in B; SQNR tolerance {tolerance} dB")
    identical = diff.attrs.get("rows_identical")
    if isinstance(compared, int) and compared and identical is not None:
        lines.append(f"{identical} of the {compared} rows in both ({identical / compared:.1%}) have identical metrics "
                     f"(bitwise, elements differing, SQNR, worst error and its index, NaN/Inf)")
    moves = diff[~diff["change"].isin(ONE_SIDED)] if len(diff) else diff
    if moves.empty:
        lines.append("No row moved beyond noise.")
        return "\n".join(lines) + "\n"
    moved = moves[KEY].drop_duplicates().shape[0]
    lines.append(f"{plural(moved, 'row')} moved beyond noise: "
                 + ", ".join(f"{n} {change}" for change, n in counts.items() if n and change not in ONE_SIDED))
    largest = (moves.assign(size=moves["delta"].abs().fillna(math.inf))
               .sort_values(["change", "size"], ascending=[True, False], kind="stable").drop(columns="size"))
    shown = largest.head(DIFF_ROWS_SHOWN)
    shown = shown.assign(**{c: shown[c].map(lambda v: str(v)[:60] if isinstance(v, str) else v)
                            for c in ("a_value", "b_value")})
    text, align = displayed(shown)
    lines += ["", text.to_markdown(index=False, tablefmt="simple", disable_numparse=True, colalign=align)]
    if len(moves) > DIFF_ROWS_SHOWN:
        lines.append(f"... and {len(moves) - DIFF_ROWS_SHOWN} more moves (--csv FILE writes every one)")
    return "\n".join(lines) + "\n"

