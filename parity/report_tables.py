"""The report's tables of a results table: accuracy against fp64 and bitwise parity, crashes, the
worst judged values, the expected outliers, and median SQNR by K, distribution, layout and dtype;
and the text form every report prints them in.

Every table but `outliers` reads the rows the verdict judges (parity.report_rows): on data the
sqnr policy exempts (tiny_amax, an outlier row, fp16 with nearmax data) an SQNR of 0 dB is the
expected result, not a finding, and a table that mixed it in would show a PASS with "SQNR min
0.00". Those rows, and NaN/Inf from an overflow of the data, are in `outliers`, with the reason.

SQNR statistics are order statistics (pandas' interpolation="lower"): every number shown was
measured on some case, and SQNR = inf (the candidate equals the fp64 result bitwise, as on
all-zero data) is a legitimate value that sorts last, never a NaN from interpolating inf - inf.
A row whose implementation raised has no metrics: it counts as a crash, not in the accuracy.
"""

from __future__ import annotations

import math

import pandas as pd

from parity.cases import TENSORS, Dist
from parity.policy import sqnr_floor
from parity.recipes import GRAD_BIAS_SQNR_DB, GRAD_BIAS_WHY, get_recipe
from parity.report_rows import (accuracy_rows, judged_accuracy, parity_rows, plural, ran, rerun, skipped_mask,
                                sqnr_unjudged)
from parity.report_worst import UNJUDGED_DATA, worst_values
from parity.results_file import validated
from parity.rows import rows_from_frame

__all__ = ["TABLE_HEADINGS", "accuracy_rows", "displayed", "dtype_label", "layout_label", "overall", "parity_rows",
           "percent", "plural", "ran", "section_note", "skipped_mask", "summary_tables"]

LAYOUT_COLUMNS = {"input_layout": "in", "weight_layout": "w", "grad_output_layout": "go"}
OPERAND_LAYOUTS = [f"{operand}:{letter}" for operand in LAYOUT_COLUMNS.values() for letter in "CTSP"]
K_BINS, K_LABELS = [0, 64, 256, 1024, 4096, math.inf], ["16-64", "65-256", "257-1024", "1025-4096", ">4096"]
MESSAGE_CHARS = 160  # an exception's first line in the crash table: enough for type, message and place
OVERFLOW_WHY = "NaN/Inf where the output dtype itself overflows (fp16's 65504): the data's, not the code's"
TABLE_HEADINGS = {  # table name -> (heading, note); section_note adds what depends on the table
    "overall": ("Accuracy against fp64 and bitwise parity, per implementation and tensor",
                "Over the rows the verdict judges: the expected outliers are in their own section. SQNR columns "
                "are order statistics over the rows against fp64; inf means bitwise equal to fp64 (all-zero "
                "data). Expected SQNR: the recipe's quantization-noise model (Recipe.expected_sqnr_db); SQNR "
                "floor: the sqnr policy's floor on normal data of many elements (parity.policy.sqnr_floor: "
                "expected - 3 dB; lower for small tensors and tiny data). max rel err: the greatest |candidate - "
                "fp64| relative to the tensor's largest |fp64| (normwise, so a reference of 0 gives no inf; "
                "measured, not judged). NaN/Inf where fp64 is finite: the candidate's non-finite elements that "
                "the data does not explain (a finding); crashed cases: cases where the implementation raised; "
                "skipped cases: cases the implementation or its reference cannot take (its recipe's alignment, a "
                "CUDA-only kernel, a known limitation), listed in the verdict; outlier cases: cases in the "
                "expected outliers."),
    "crashes": ("Crashes, per implementation and exception",
                "Every implementation that raised (or a reference, when it raised alone), with the first line of "
                "the exception, the cases that raised it, the first of them, and the command that reruns it."),
    "worst": ("Where the worst judged values are",
              "Per implementation and tensor, the row nearest its limit under each policy that judged it: the "
              "lowest SQNR above its floor against fp64 (the floor of that row's data and size), and the largest "
              "share of the accumulation bound against the recipe's exact emulation (1 is the bound; ULPs in the "
              "why); its data, why the value is expected (or the finding it is), and the command that reruns it."),
    "outliers": ("Expected outliers: measured, not judged by SQNR",
                 "Rows against fp64 whose data the sqnr policy exempts, and NaN/Inf from an overflow of the data: "
                 "their SQNR and relative error are what that data gives a correct implementation, so they stay "
                 "out of the tables above (the bitwise and accumulation policies still judge these cases). Per "
                 "data and implementation: the cases, the tensors, the lowest SQNR and the command that reruns "
                 "its row."),
    "by_k": ("Median SQNR against fp64 (dB) by K", None),
    "by_dist": ("Median SQNR against fp64 (dB) by data distribution", None),
    "by_layout": ("Median SQNR against fp64 (dB) by operand layout",
                  "in: input, w: weight, go: grad_output; C contiguous, T transposed, S sliced, P padded rows."),
    "by_dtype": ("Median SQNR against fp64 (dB) by input and weight dtype", None),
}


def section_note(name: str, table: pd.DataFrame) -> str | None:
    """The note under table `name`'s heading: TABLE_HEADINGS' note, and what only the table knows:
    why grad_bias's expected SQNR is a fixed value (when the table has grad_bias), and the reason of
    each kind of outlier data it holds."""
    note = TABLE_HEADINGS[name][1]
    if name == "overall" and "grad_bias" in set(table.index.get_level_values("tensor").astype(str)):
        note += f" grad_bias's expected {GRAD_BIAS_SQNR_DB:.1f} dB: {GRAD_BIAS_WHY}."
    if name == "outliers":
        note += " " + " ".join(f"{data}: {_outlier_why(data)}." for data in dict.fromkeys(table["data"]))
    return note


def _order_statistic(grouped, q: float) -> pd.Series:
    return grouped.quantile(q, interpolation="lower")


def layout_label(rows: pd.DataFrame) -> pd.Series:
    return ("in:" + rows["input_layout"].astype(str) + " w:" + rows["weight_layout"].astype(str)
            + " go:" + rows["grad_output_layout"].astype(str))


def dtype_label(rows: pd.DataFrame) -> pd.Series:
    return "in:" + rows["input_dtype"].astype(str) + " w:" + rows["weight_dtype"].astype(str)


def overall(frame: pd.DataFrame) -> pd.DataFrame:
    """Per implementation x tensor: the columns of the `overall` table (see summary_tables)."""
    keys = ["impl", "tensor"]
    frame = frame.assign(tensor=pd.Categorical(frame["tensor"], categories=TENSORS))
    judged = judged_accuracy(frame)
    accuracy = judged.groupby(keys, observed=True)
    sqnr = accuracy["sqnr_db"]
    parity = ran(parity_rows(frame))
    once = frame.drop_duplicates(["case_id", "impl", "tensor", "step"])  # an impl's own facts repeat per reference
    crashed = once[once["error"].notna()]
    outliers = _outlier_rows(frame)
    counted = judged if len(judged) else once  # no rows against fp64: the implementation's own counts
    findings, _ = _nonfinite(counted)
    table = pd.concat({
        "recipe": frame.groupby(keys, observed=True)["recipe"].first(),
        "cases": ran(frame).groupby(keys, observed=True)["case_id"].nunique(),
        "SQNR median (dB)": _order_statistic(sqnr, 0.5),
        "SQNR p05 (dB)": _order_statistic(sqnr, 0.05),
        "SQNR min (dB)": sqnr.min(),
        "max rel err": accuracy["max_rel_err"].max(),
        "bitwise vs its recipe's reference (%)": 100 * parity.groupby(keys, observed=True)["bitwise"].mean(),
        "NaN/Inf where fp64 is finite": findings.groupby([counted["impl"], counted["tensor"]], observed=True).sum(),
        "crashed cases": crashed.groupby(keys, observed=True)["case_id"].nunique(),
        "skipped cases": frame[skipped_mask(frame)].groupby(keys, observed=True)["case_id"].nunique(),
        "outlier cases": outliers.groupby(keys, observed=True)["case_id"].nunique(),
    }, axis=1)
    counts = ["cases", "NaN/Inf where fp64 is finite", "crashed cases", "skipped cases", "outlier cases"]
    table = table.assign(**{c: table[c].fillna(0).astype(int) for c in counts})
    expected = pd.DataFrame([_expected_sqnr(recipe, tensor) for (_, tensor), recipe in table["recipe"].items()],
                            index=table.index, columns=["expected SQNR (dB)", "SQNR floor (dB)"])
    at = table.columns.get_loc("SQNR median (dB)") + 1
    return pd.concat([table.iloc[:, :at], expected, table.iloc[:, at:]], axis=1)


def _expected_sqnr(recipe, tensor: str) -> tuple[float, float]:
    """The recipe's expected SQNR of `tensor` and the sqnr policy's floor on normal data of many
    elements (NaN for a row without a recipe)."""
    if not isinstance(recipe, str):
        return math.nan, math.nan
    return get_recipe(recipe).expected_sqnr_db(tensor), sqnr_floor(recipe, tensor, Dist.NORMAL.value)


def _nonfinite(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Each row's non-finite elements of the candidate in two kinds: where fp64 is finite and far
    from the output dtype's overflow (a finding: NaN, or Inf the data does not explain), and
    NaN/Inf from an overflow of a narrow dtype (fp16's 65504: the data's, not the code's)."""
    nan, inf = rows["nan"].fillna(0), rows["inf"].fillna(0)
    unexpected_inf = rows["unexpected_inf"].fillna(0) if "unexpected_inf" in rows else inf
    finding = (nan - rows["ref_nan"].fillna(0)).clip(lower=0) + unexpected_inf
    return finding, (nan + inf - finding).clip(lower=0)


def _outlier_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows against fp64 that the outliers table holds: data the sqnr policy exempts, and rows
    with NaN/Inf from an overflow of the data; column `data` says which (the distribution, or
    "overflow")."""
    rows = ran(accuracy_rows(frame))
    unjudged = sqnr_unjudged(rows)
    _, overflow = _nonfinite(rows)
    rows = rows.assign(overflow=overflow, data=rows["dist"].astype(str).where(unjudged, "overflow"))
    return rows[unjudged | (overflow > 0)]


def _outlier_why(data: str) -> str:
    return OVERFLOW_WHY if data == "overflow" else UNJUDGED_DATA.get(data, "the sqnr policy exempts this data")


def _outliers(frame: pd.DataFrame) -> pd.DataFrame:
    """Per kind of outlier data x implementation: cases, tensors, the lowest SQNR, the largest
    relative error, NaN/Inf from overflow, and the command that reruns the lowest SQNR's row."""
    rows = _outlier_rows(frame)
    if rows.empty:
        return pd.DataFrame()
    groups = rows.groupby(["data", "impl"], sort=False)
    lowest = rows.loc[rows["sqnr_db"].fillna(-math.inf).groupby([rows["data"], rows["impl"]], sort=False).idxmin()]
    table = pd.DataFrame({
        "cases": groups["case_id"].nunique(),
        "tensors": groups["tensor"].agg(lambda t: ", ".join(x for x in TENSORS if x in set(t.astype(str)))),
        "SQNR min (dB)": groups["sqnr_db"].min(),
        "max rel err": groups["max_rel_err"].max(),
        "NaN/Inf from overflow": groups["overflow"].sum().astype(int),
    })
    return table.assign(rerun=[rerun(row) for row in rows_from_frame(lowest)]).reset_index()


def _median_sqnr_by(rows: pd.DataFrame, column: str) -> pd.DataFrame:
    """Median SQNR per implementation x tensor (rows) and value of `column` (columns)."""
    return _order_statistic(rows.groupby(["impl", "tensor", column], observed=True)["sqnr_db"], 0.5).unstack(column)


def summary_tables(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The report's tables, indexed by implementation x tensor, values numeric (inf kept).

    overall    recipe; cases run; over the judged rows: median SQNR against fp64 beside the
               recipe's expected SQNR and the policy's floor, p05 and min SQNR and max relative
               error against fp64; the rate (%) of rows bitwise equal to the implementation of
               the same recipe it was compared with; the implementation's NaN/Inf elements that
               the data does not explain; cases that crashed; cases skipped (the implementation
               or its reference cannot take them); cases in the expected outliers.
    crashes    (only when something raised) per implementation and exception: its first line,
               the cases, one example and its rerun command.
    worst      (parity.report_worst.worst_values) per implementation x tensor x policy: the judged
               row nearest its limit, its data, why it is expected (or the finding) and its rerun
               command.
    outliers   (only when there are some) per kind of exempt data (or "overflow") x
               implementation: cases, tensors, the lowest SQNR, the largest relative error,
               NaN/Inf from overflow, and a rerun command.
    by_k, by_dist, by_layout, by_dtype
               median SQNR against fp64 over the judged rows, one column per K bucket,
               distribution, operand layout (marginal: in:T holds every case with a transposed
               input) or dtype pair. An empty cell: no case of that group ran.
    """
    frame = validated(frame)
    accuracy = judged_accuracy(frame)
    layouts = accuracy.melt(id_vars=["impl", "tensor", "sqnr_db"], value_vars=list(LAYOUT_COLUMNS),
                            var_name="operand", value_name="letter")
    layouts = layouts.assign(layout=pd.Categorical(layouts["operand"].map(LAYOUT_COLUMNS) + ":" + layouts["letter"],
                                                   categories=OPERAND_LAYOUTS))
    optional = {"crashes": _crashes(frame), "worst": worst_values(frame),
                "outliers": _outliers(frame)}  # shown where they have rows
    return {
        "overall": overall(frame),
        **{name: table for name, table in optional.items() if len(table)},
        "by_k": _median_sqnr_by(accuracy.assign(K=pd.cut(accuracy["K"], K_BINS, labels=K_LABELS)), "K"),
        "by_dist": _median_sqnr_by(accuracy, "dist"),
        "by_layout": _median_sqnr_by(layouts, "layout"),
        "by_dtype": _median_sqnr_by(accuracy.assign(dtypes=dtype_label(accuracy)), "dtypes"),
    }


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS - 3] + "..."


def _crashes(frame: pd.DataFrame) -> pd.DataFrame:
    """Per implementation that raised and the first line of its exception: the cases, the first of
    them and its rerun command. A reference that raised while the implementation ran counts as
    the reference's crash."""
    keys = ["implementation", "raised as", "exception"]
    own = frame[frame["error"].notna()]
    of_reference = frame[frame["error"].isna() & frame["reference_error"].notna() & ~skipped_mask(frame)]
    raised = pd.concat([own.assign(**dict(zip(keys, [own["impl"], "implementation", own["error"].map(_first_line)]))),
                        of_reference.assign(**dict(zip(keys, [of_reference["reference"], "reference",
                                                              of_reference["reference_error"].map(_first_line)])))])
    if raised.empty:
        return pd.DataFrame()
    groups = raised.groupby(keys)
    first = groups.head(1).set_index(keys)  # the first row of each group, in the table's order
    table = groups["case_id"].nunique().rename("cases").to_frame().join(first["case_id"].rename("example case"))
    return table.assign(rerun=[rerun(row) for row in rows_from_frame(first.loc[table.index].reset_index())])



def percent(value: float, decimals: int) -> str:
    """A rate in % as text that never rounds a single difference up to 100."""
    return "100" if value == 100 else f"{min(value, 100 - 10 ** -decimals):.{decimals}f}"


def _cell(value, *, as_percent: bool) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    if not isinstance(value, float):
        return str(value)
    if as_percent:
        return percent(value, 2)
    return f"{value:.2f}" if value == 0 or 0.1 <= abs(value) < 1e6 else f"{value:.3g}"  # inf stays "inf"


def displayed(table: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The table as text (2 decimals or 3 significant digits, inf kept, missing blank) and the
    alignment of its columns."""
    table = table.reset_index() if any(name is not None for name in table.index.names) else table
    align = ["right" if pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype) else "left"
             for dtype in table.dtypes]
    text = pd.DataFrame({str(name): [_cell(v, as_percent=str(name).endswith("(%)")) for v in column]
                         for name, column in table.items()})
    return text, align

