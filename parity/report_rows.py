"""Which rows of a results table each part of a report reads: the one place the report decides what
counts as a judged result, an expected outlier, a crash or a skip.

A report must never show a number its verdict did not judge as if it were a result. The verdict
(parity.policy.evaluate) judges a row against fp64 by the sqnr policy only where
parity.policy.sqnr_floor gives its data a floor; on the rest (tiny_amax data, an outlier row, fp16
with nearmax data) the SQNR is measured but not judged, and those rows are expected outliers: the
report shows them in their own section with the reason, and its accuracy tables, plots and summary
read the judged rows alone (`judged_accuracy`). The bitwise, accumulation and exact policies judge
every kind of data, so their rows are never outliers.

    ran(rows)               rows with metrics: neither side raised, the case was not skipped
    accuracy_rows(frame)    rows against fp64, `tensor` ordered as the layer computes them
    sqnr_unjudged(rows)     True where the sqnr policy gives the row's data no floor
    judged_accuracy(frame)  rows against fp64 that ran on data the sqnr policy judges
    rerun(row)              the `fp8-parity check` command that reruns one row
"""

from __future__ import annotations

import pandas as pd

from parity.cases import TENSORS, CaseError, parse_case_id
from parity.check import rerun_command
from parity.impls import recipe_flag
from parity.policy import ACCURACY_REFERENCE, Policy, sqnr_floor
from parity.recipes import DEFAULT_RECIPE
from parity.rows import Row


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def skipped_mask(rows: pd.DataFrame) -> pd.Series:
    return rows["skipped"].fillna("").astype(str) != ""


def ran(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows where neither the implementation nor the reference raised, nor was the case
    skipped: those with metrics."""
    return rows[rows["error"].isna() & rows["reference_error"].isna() & ~skipped_mask(rows)]


def parity_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows judged bitwise: each implementation against another of its own recipe."""
    return frame[frame["policy"] == Policy.BITWISE.value]


def accuracy_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows against fp64, with `tensor` ordered as the layer computes them."""
    rows = frame[frame["reference"] == ACCURACY_REFERENCE]
    return rows.assign(tensor=pd.Categorical(rows["tensor"], categories=TENSORS))


def sqnr_unjudged(rows: pd.DataFrame) -> pd.Series:
    """True where parity.policy.sqnr_floor gives the row's data no floor: the sqnr policy measures
    its SQNR and does not judge it. Asked of sqnr_floor itself (once per kind of row), so the report
    and the verdict can never disagree about which data is exempt."""
    kinds = pd.DataFrame({"recipe": rows["recipe"].where(rows["recipe"].map(lambda r: isinstance(r, str)),
                                                         DEFAULT_RECIPE.name),
                          "tensor": rows["tensor"].astype(str).where(rows["tensor"].astype(str).isin(TENSORS),
                                                                     "output"),  # a crash's "all"
                          "dist": rows["dist"].astype(str), "input_dtype": rows["input_dtype"].astype(str)},
                         index=rows.index)
    floors = {kind: sqnr_floor(*kind) is None for kind in set(kinds.itertuples(index=False, name=None))}
    return pd.Series([floors[kind] for kind in kinds.itertuples(index=False, name=None)], index=rows.index,
                     dtype=bool)


def judged_accuracy(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows against fp64 whose SQNR the sqnr policy judges: the accuracy tables' rows."""
    rows = ran(accuracy_rows(frame))
    return rows[~sqnr_unjudged(rows)]


def rerun(row: Row) -> str:
    """The `fp8-parity check` command that runs exactly this row's case, implementation and
    reference (parity.check.rerun_command); "" for a case id that parity.cases cannot rebuild."""
    try:
        case = parse_case_id(row.case_id)
    except CaseError:
        return ""
    device = row.device.split(":")[0] if isinstance(row.device, str) else "auto"  # cuda:1 of a sharded sweep: cuda
    recipe = row.recipe or DEFAULT_RECIPE.name
    return rerun_command(row.impl, row.reference, device, recipe_flag(row.impl, recipe))(case)
