"""The report's tables of a results table: accuracy against fp64, bitwise parity, crashes, where the
worst values are (and why they are expected), and median SQNR by K, distribution, layout and dtype;
and the text form every report prints them in.

SQNR statistics are order statistics (pandas' interpolation="lower"): every number shown was
measured on some case, and SQNR = inf (the candidate equals the fp64 result bitwise, as on
all-zero data) is a legitimate value that sorts last, never a NaN from interpolating inf - inf.
A row whose implementation raised has no metrics: it counts as a crash, not in the accuracy.
"""

from __future__ import annotations

import math

import pandas as pd

from parity.cases import TENSORS, CaseError, Dist, parse_case_id
from parity.check import rerun_command
from parity.impls import recipe_flag
from parity.policy import ACCURACY_REFERENCE, Policy, evaluate, row_policy, sqnr_floor
from parity.recipes import DEFAULT_RECIPE, get_recipe
from parity.results_file import validated
from parity.rows import Row, rows_from_frame

LAYOUT_COLUMNS = {"input_layout": "in", "weight_layout": "w", "grad_output_layout": "go"}
OPERAND_LAYOUTS = [f"{operand}:{letter}" for operand in LAYOUT_COLUMNS.values() for letter in "CTSP"]
K_BINS, K_LABELS = [0, 64, 256, 1024, 4096, math.inf], ["16-64", "65-256", "257-1024", "1025-4096", ">4096"]
MESSAGE_CHARS = 160  # an exception's first line in the crash table: enough for type, message and place
TABLE_HEADINGS = {  # table name -> (heading, note)
    "overall": ("Accuracy against fp64 and bitwise parity, per implementation and tensor",
                "SQNR columns are order statistics over the rows against fp64; inf means bitwise equal to fp64 "
                "(all-zero data). Expected SQNR: the recipe's quantization-noise model (Recipe.expected_sqnr_db); "
                "SQNR floor: the sqnr policy's floor on normal data of many elements (parity.policy.sqnr_floor: "
                "expected - 3 dB; lower for small tensors and tiny data; some data is not judged: see where the "
                "worst values are). max rel err: the greatest |candidate - fp64| relative to the tensor's largest "
                "|fp64| (normwise, so a reference of 0 gives no inf). NaN/Inf where fp64 is finite: the "
                "candidate's non-finite elements that the data does not explain (a finding); NaN/Inf from "
                "overflow: Inf where the output dtype itself overflows (fp16's 65504), and NaN where fp64 has it "
                "too; crashed cases: cases where the implementation raised; skipped cases: cases the "
                "implementation or its reference cannot take (its recipe's alignment, a CUDA-only kernel, a known "
                "limitation), listed in the verdict."),
    "crashes": ("Crashes, per implementation and exception",
                "Every implementation that raised (or a reference, when it raised alone), with the first line of "
                "the exception, the cases that raised it, the first of them, and the command that reruns it."),
    "worst": ("Where the worst values are",
              "The row behind each minimum SQNR and maximum relative error against fp64 and maximum ULP distance "
              "against the recipe's exact emulation (ULPs where the reference is not 0; differing elements where "
              "it is 0 are counted apart), its data, why the value is expected (or the finding it is), and the "
              "command that reruns it."),
    "by_k": ("Median SQNR against fp64 (dB) by K", None),
    "by_dist": ("Median SQNR against fp64 (dB) by data distribution", None),
    "by_layout": ("Median SQNR against fp64 (dB) by operand layout",
                  "in: input, w: weight, go: grad_output; C contiguous, T transposed, S sliced, P padded rows."),
    "by_dtype": ("Median SQNR against fp64 (dB) by input and weight dtype", None),
}


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _order_statistic(grouped, q: float) -> pd.Series:
    return grouped.quantile(q, interpolation="lower")


def layout_label(rows: pd.DataFrame) -> pd.Series:
    return ("in:" + rows["input_layout"].astype(str) + " w:" + rows["weight_layout"].astype(str)
            + " go:" + rows["grad_output_layout"].astype(str))


def dtype_label(rows: pd.DataFrame) -> pd.Series:
    return "in:" + rows["input_dtype"].astype(str) + " w:" + rows["weight_dtype"].astype(str)


def ran(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows where neither the implementation nor the reference raised, nor was the case
    skipped: those with metrics."""
    return rows[rows["error"].isna() & rows["reference_error"].isna() & ~skipped_mask(rows)]


def skipped_mask(rows: pd.DataFrame) -> pd.Series:
    return rows["skipped"].fillna("").astype(str) != ""


def parity_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows judged bitwise: each implementation against another of its own recipe."""
    return frame[frame["policy"] == Policy.BITWISE.value]


def accuracy_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows against fp64, with `tensor` ordered as the layer computes them."""
    rows = frame[frame["reference"] == ACCURACY_REFERENCE]
    return rows.assign(tensor=pd.Categorical(rows["tensor"], categories=TENSORS))


def overall(frame: pd.DataFrame) -> pd.DataFrame:
    """Per implementation x tensor: the columns of the `overall` table (see summary_tables)."""
    keys = ["impl", "tensor"]
    frame = frame.assign(tensor=pd.Categorical(frame["tensor"], categories=TENSORS))
    accuracy = ran(frame[frame["reference"] == ACCURACY_REFERENCE]).groupby(keys, observed=True)
    sqnr = accuracy["sqnr_db"]
    parity = ran(parity_rows(frame))
    once = frame.drop_duplicates(["case_id", "impl", "tensor", "step"])  # an impl's own facts repeat per reference
    crashed = once[once["error"].notna()]
    table = pd.concat({
        "recipe": frame.groupby(keys, observed=True)["recipe"].first(),
        "cases": ran(frame).groupby(keys, observed=True)["case_id"].nunique(),
        "SQNR median (dB)": _order_statistic(sqnr, 0.5),
        "SQNR p05 (dB)": _order_statistic(sqnr, 0.05),
        "SQNR min (dB)": sqnr.min(),
        "max rel err": accuracy["max_rel_err"].max(),
        "bitwise vs its recipe's reference (%)": 100 * parity.groupby(keys, observed=True)["bitwise"].mean(),
        **_nonfinite_counts(frame, once),
        "crashed cases": crashed.groupby(keys, observed=True)["case_id"].nunique(),
        "skipped cases": frame[skipped_mask(frame)].groupby(keys, observed=True)["case_id"].nunique(),
    }, axis=1)
    counts = ["cases", "NaN/Inf where fp64 is finite", "NaN/Inf from overflow", "crashed cases", "skipped cases"]
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


def _nonfinite_counts(frame: pd.DataFrame, once: pd.DataFrame) -> dict[str, pd.Series]:
    """The candidate's non-finite elements in two kinds, from its rows against fp64: where fp64 is
    finite and far from the output dtype's overflow (a finding: NaN, or Inf the data does not
    explain), and Inf from overflow of a narrow dtype (fp16's 65504: the data's, not the code's)."""
    vs64 = frame[frame["reference"] == "fp64"].drop_duplicates(["case_id", "impl", "tensor", "step"])
    if vs64.empty:  # no fp64 rows: the counts alone
        vs64 = once
    nan, inf = vs64["nan"].fillna(0), vs64["inf"].fillna(0)
    unexpected_inf = vs64["unexpected_inf"].fillna(0) if "unexpected_inf" in vs64 else inf
    finding = (nan - vs64["ref_nan"].fillna(0)).clip(lower=0) + unexpected_inf
    keys = [vs64["impl"], vs64["tensor"]]
    return {"NaN/Inf where fp64 is finite": finding.groupby(keys, observed=True).sum(),
            "NaN/Inf from overflow": (nan + inf - finding).clip(lower=0).groupby(keys, observed=True).sum()}


def _median_sqnr_by(rows: pd.DataFrame, column: str) -> pd.DataFrame:
    """Median SQNR per implementation x tensor (rows) and value of `column` (columns)."""
    return _order_statistic(rows.groupby(["impl", "tensor", column], observed=True)["sqnr_db"], 0.5).unstack(column)


def summary_tables(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The report's tables, indexed by implementation x tensor, values numeric (inf kept).

    overall    recipe; cases run; median SQNR against fp64 beside the recipe's expected SQNR and
               the policy's floor, p05 and min SQNR and max relative error against fp64; the
               rate (%) of rows bitwise equal to the implementation of the same recipe it was
               compared with; the implementation's NaN/Inf elements; cases that crashed; cases
               skipped (the implementation or its reference cannot take them).
    crashes    (only when something raised) per implementation and exception: its first line,
               the cases, one example and its rerun command.
    worst      per implementation x tensor x worst value (SQNR min, max rel err, max ULP): the
               row that attains it, its data, why it is expected (or the finding) and its
               rerun command.
    by_k, by_dist, by_layout, by_dtype
               median SQNR against fp64, one column per K bucket, distribution, operand layout
               (marginal: in:T holds every case with a transposed input) or dtype pair. An
               empty cell: no case of that group ran.
    """
    frame = validated(frame)
    accuracy = ran(accuracy_rows(frame))
    layouts = accuracy.melt(id_vars=["impl", "tensor", "sqnr_db"], value_vars=list(LAYOUT_COLUMNS),
                            var_name="operand", value_name="letter")
    layouts = layouts.assign(layout=pd.Categorical(layouts["operand"].map(LAYOUT_COLUMNS) + ":" + layouts["letter"],
                                                   categories=OPERAND_LAYOUTS))
    optional = {"crashes": _crashes(frame), "worst": _worst_values(frame)}  # shown where they have rows
    return {
        "overall": overall(frame),
        **{name: table for name, table in optional.items() if len(table)},
        "by_k": _median_sqnr_by(accuracy.assign(K=pd.cut(accuracy["K"], K_BINS, labels=K_LABELS)), "K"),
        "by_dist": _median_sqnr_by(accuracy, "dist"),
        "by_layout": _median_sqnr_by(layouts, "layout"),
        "by_dtype": _median_sqnr_by(accuracy.assign(dtypes=dtype_label(accuracy)), "dtypes"),
    }


def _rerun(row: Row) -> str:
    """The `fp8-parity check` command that runs exactly this row's case, implementation and
    reference (parity.check.rerun_command); "" for a case id that parity.cases cannot rebuild."""
    try:
        case = parse_case_id(row.case_id)
    except CaseError:
        return ""
    device = row.device.split(":")[0] if isinstance(row.device, str) else "auto"  # cuda:1 of a sharded sweep: cuda
    recipe = row.recipe or DEFAULT_RECIPE.name
    return rerun_command(row.impl, row.reference, device, recipe_flag(row.impl, recipe))(case)


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
    return table.assign(rerun=[_rerun(row) for row in rows_from_frame(first.loc[table.index].reset_index())])


WORST_VALUES = [  # (label, rows it is taken from, column, the largest is the worst)
    ("SQNR min (dB)", "against fp64", "sqnr_db", False),
    ("max rel err", "against fp64", "max_rel_err", True),
    ("max ULP", "against its recipe's exact emulation", "ulp_max", True),
]
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


def _why(row: Row) -> str:
    """Why a row's value is expected: what explains it (the policy does not judge that data, the
    data, an overflow of the output dtype, elements whose reference is 0) and how its policy
    judged it; or the finding it is."""
    found = evaluate([row])
    if found:
        return f"a finding: {found[0].message}"
    policy = row_policy(row)
    floor = (sqnr_floor(row.recipe, row.tensor, row.dist, row.input_dtype, row.n_eff)
             if policy is Policy.SQNR else None)
    unjudged = policy is Policy.SQNR and floor is None
    reasons = (["not judged by SQNR: " + UNJUDGED_DATA.get(row.dist, "the sqnr policy exempts this data")]
               if unjudged else [EXPLAINED_DATA[row.dist]] if row.dist in EXPLAINED_DATA else [])
    if row.inf > row.unexpected_inf:
        reasons.append("Inf where the output dtype overflows")
    at_zero = row.n_diff_where_reference_zero
    if at_zero > 0:
        reasons.append(f"{plural(int(at_zero), 'element')} differ where the reference is 0 (not in ULPs)")
    if policy is Policy.SQNR and not unjudged:
        reasons.append(f"SQNR {row.sqnr_db:.1f} dB, above its floor of {floor:.1f} dB")
    elif policy is Policy.ACCUMULATION:
        reasons.append(f"at {row.bound_ratio:.2g} of the accumulation bound" if row.bound_ratio > 0 else
                       "equal to its exact emulation")
    elif policy is Policy.BITWISE:
        reasons.append("bitwise equal to its recipe's reference")
    elif not unjudged:
        reasons.append("measured, not judged")
    return "; ".join(reasons)


def _worst_values(frame: pd.DataFrame) -> pd.DataFrame:
    """Per implementation x tensor x WORST_VALUES: the row that attains it (the first, on a tie)."""
    measured = ran(frame).assign(tensor=lambda r: pd.Categorical(r["tensor"], categories=TENSORS))
    sources = {"against fp64": measured[measured["reference"] == ACCURACY_REFERENCE],
               "against its recipe's exact emulation": measured[measured["policy"] == Policy.ACCUMULATION.value]}
    picked = []
    for order, (label, source, column, largest) in enumerate(WORST_VALUES):
        rows = sources[source].dropna(subset=[column])
        if rows.empty:
            continue
        by = rows.groupby(["impl", "tensor"], observed=True)[column]
        attained = rows.loc[by.idxmax() if largest else by.idxmin()]
        picked.append(attained.assign(worst=label, order=order, value=attained[column]))
    if not picked:
        return pd.DataFrame()
    rows = pd.concat(picked).sort_values(["impl", "tensor", "order"], kind="stable")
    records = rows_from_frame(rows)
    return pd.DataFrame({"impl": rows["impl"], "tensor": rows["tensor"].astype(str), "worst": rows["worst"],
                         "value": rows["value"].astype(float), "against": rows["reference"], "case": rows["case_id"],
                         "dist": rows["dist"], "why": [_why(r) for r in records],
                         "rerun": [_rerun(r) for r in records]}).reset_index(drop=True)



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

