"""The worst judged values of a results table: per implementation and tensor, the row nearest its
limit under each policy that judged it (the report's `worst` table), and why that value is expected
or which finding it is.

Judged is the word that matters. A policy compares one quantity with one limit, and the report
shows that quantity, not another that merely looks alarming:

    sqnr          the row's SQNR against the floor of its own data and size
                  (parity.policy.sqnr_floor with its n_eff): the worst is the smallest margin, so
                  a 16x16 tensor 2 dB above its low floor ranks before a large one 4 dB above a
                  higher floor
    accumulation  the row's share of the accumulation bound (bound_ratio, parity.oracles: 1 is the
                  bound): 256 ULPs of float32 at 0.014 of the bound is a tight result, and the
                  ULPs are said in the why

Data the sqnr policy exempts (tiny_amax, an outlier row, fp16 with nearmax data) has no floor: its
rows are the expected outliers (parity.report_tables' `outliers`), and UNJUDGED_DATA says why.
"""

from __future__ import annotations

import math

import pandas as pd

from parity.cases import TENSORS, Dist
from parity.policy import Policy, evaluate, row_policy, sqnr_floor
from parity.recipes import DEFAULT_RECIPE
from parity.report_rows import plural, ran, rerun
from parity.rows import Row, rows_from_frame

UNJUDGED_DATA = {  # dist -> why parity.policy.sqnr_floor gives it no floor (its docstring holds the measurements)
    Dist.TINY_AMAX.value: "amax 1e-30 is below the scale's EPS floor of 1e-12: quantized to zeros by design",
    Dist.OUTLIER_ROW.value: "one token 10^4x larger, which pushes the other rows of a per-tensor scale into "
                            "fp8's subnormals (a property of such recipes)",
    Dist.NEAR_MAX.value: "fp16 output of nearmax data: products of 448^2 overflow fp16's 65504",
}
EXPLAINED_DATA = {  # dist -> why its values are extreme where the policy holds
    Dist.ZEROS.value: "all-zero data: only the bias's rounding is left",
    Dist.TINY.value: "tiny data over ~20 binades: its smallest values fall into fp8's subnormals (floor 10 dB lower)",
}
SQNR_WORST, BOUND_WORST = "SQNR (dB)", "share of the accumulation bound"


def with_floors(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` judged by the sqnr policy on data it gives a floor, with columns `floor` (that row's
    floor: its recipe, tensor, data, input dtype and n_eff, as parity.policy judges it) and
    `margin` (SQNR - floor; a NaN SQNR, which the policy fails, is -inf)."""
    rows = rows[rows["policy"] == Policy.SQNR.value]
    floors = [sqnr_floor(recipe if isinstance(recipe, str) else DEFAULT_RECIPE.name, str(tensor), dist, dtype, n_eff)
              for recipe, tensor, dist, dtype, n_eff in zip(rows["recipe"], rows["tensor"], rows["dist"],
                                                            rows["input_dtype"], rows["n_eff"].fillna(math.inf))]
    rows = rows.assign(floor=[math.nan if f is None else f for f in floors])
    rows = rows[rows["floor"].notna()]
    return rows.assign(margin=(rows["sqnr_db"] - rows["floor"]).fillna(-math.inf))


def bound_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` judged by the accumulation bound, with their share of it."""
    return rows[(rows["policy"] == Policy.ACCUMULATION.value) & rows["bound_ratio"].notna()]


def worst_values(frame: pd.DataFrame) -> pd.DataFrame:
    """Per implementation x tensor x judged quantity (SQNR against its floor, share of the
    accumulation bound): the row nearest its limit (the first, on a tie), its limit, why and rerun."""
    measured = ran(frame).assign(tensor=lambda r: pd.Categorical(r["tensor"], categories=TENSORS))
    sources = [(SQNR_WORST, with_floors(measured), "margin", False, "floor"),
               (BOUND_WORST, bound_rows(measured).assign(limit=1.0), "bound_ratio", True, "limit")]
    picked = []
    for order, (label, rows, column, largest, limit) in enumerate(sources):
        if rows.empty:
            continue
        by = rows.groupby(["impl", "tensor"], observed=True)[column]
        attained = rows.loc[by.idxmax() if largest else by.idxmin()]
        value = attained["sqnr_db"] if label == SQNR_WORST else attained["bound_ratio"]
        picked.append(attained.assign(worst=label, order=order, value=value, limit=attained[limit]))
    if not picked:
        return pd.DataFrame()
    rows = pd.concat(picked).sort_values(["impl", "tensor", "order"], kind="stable")
    records = rows_from_frame(rows.drop(columns=["worst", "order", "value", "limit", "floor", "margin"],
                                        errors="ignore"))
    return pd.DataFrame({"impl": rows["impl"], "tensor": rows["tensor"].astype(str), "worst": rows["worst"],
                         "value": rows["value"].astype(float), "limit": rows["limit"].astype(float),
                         "against": rows["reference"], "case": rows["case_id"], "dist": rows["dist"],
                         "why": [why(r) for r in records], "rerun": [rerun(r) for r in records]}).reset_index(drop=True)


def why(row: Row) -> str:
    """Why a judged row's value is expected: what explains it (the data, an overflow of the output
    dtype, elements whose reference is 0) and how its policy judged it; or the finding it is."""
    found = evaluate([row])
    if found:
        return f"a finding: {found[0].message}"
    policy = row_policy(row)
    reasons = [EXPLAINED_DATA[row.dist]] if row.dist in EXPLAINED_DATA else []
    if row.inf > row.unexpected_inf:
        reasons.append("Inf where the output dtype overflows")
    at_zero = row.n_diff_where_reference_zero
    if at_zero > 0:
        reasons.append(f"{plural(int(at_zero), 'element')} differ where the reference is 0 (not in ULPs)")
    if policy is Policy.SQNR:
        floor = sqnr_floor(row.recipe or DEFAULT_RECIPE.name, row.tensor, row.dist, row.input_dtype, row.n_eff)
        reasons.append(f"SQNR {row.sqnr_db:.1f} dB, above its floor of {floor:.1f} dB" if floor is not None else
                       "not judged by SQNR: " + UNJUDGED_DATA.get(row.dist, "the sqnr policy exempts this data"))
    elif policy is Policy.ACCUMULATION:
        reasons.append(f"at {row.bound_ratio:.2g} of the accumulation bound ({row.ulp_max:.0f} ULP)"
                       if row.bound_ratio > 0 else "equal to its exact emulation")
    elif policy is Policy.BITWISE:
        reasons.append("bitwise equal to its recipe's reference")
    else:
        reasons.append("measured, not judged")
    return "; ".join(reasons)
