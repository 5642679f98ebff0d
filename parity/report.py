"""Reports of a results table: summary tables, a verdict, files for people, and diffs.

The one writer of every report format. It reads the tidy table of parity.runner.run_cases
(one row per case x implementation `impl` x `reference` x tensor x step) and gives:

    summary_tables(frame)    SQNR against fp64 (beside the recipe's expected SQNR and the policy's
                             floor) and bitwise parity against the parity reference, per
                             implementation x tensor; the crashes; where the worst values are (case,
                             data, why, rerun command); then by K, distribution, layout, dtype
    verdict(frame)           PASS/FAIL of one candidate in one sentence, with the evidence
    write_report(frame, d)   results.csv.gz, summary.md, index.html, env.json and PNG plots in d
    read_results(path)       a results file or report directory -> the same table, or a
                             ResultsError that says what the file is instead
    diff_results(a, b)       the rows whose metrics moved between two runs, and those only in one
                             (render_diff prints counts, then the largest moves, bounded)

SQNR statistics are order statistics (pandas' interpolation="lower"): every number shown was
measured on some case, and SQNR = inf (the candidate equals the fp64 result bitwise, as on
all-zero data) is a legitimate value that sorts last, never a NaN from interpolating inf - inf.
A row whose implementation raised has no metrics: it counts as a crash, not in the accuracy.
"""

from __future__ import annotations

import gzip
import html
import io
import json
import math
import zlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from parity.cases import TENSORS, CaseError, Dist, parse_case_id
from parity.outputs import atomic_write_bytes, atomic_write_text
from parity.policy import Policy, Violation, evaluate, row_policy, sqnr_floor
from parity.recipes import DEFAULT_RECIPE, get_recipe

ACCURACY_REFERENCE = "fp64"
RESULTS_FILE, ENV_FILE = "results.csv.gz", "env.json"
KEY = ["case_id", "impl", "reference", "tensor", "step"]
REQUIRED_COLUMNS = [*KEY, "K", "dist", "input_dtype", "weight_dtype", "input_layout", "weight_layout",
                    "grad_output_layout", "bitwise", "n_diff", "numel", "sqnr_db", "max_rel_err", "max_abs_err",
                    "max_abs_index", "nan", "inf", "error", "reference_error", "contract", "scaled_mm", "recipe",
                    "policy", "skipped", "operands"]
# Columns added after the first tables were written (recipes as data). Not upgraded with
# defaults: recipe and policy decide how every row is judged, and an empty `operands` would claim
# an operand check that never ran; such a table is refused with "re-run the sweep".
ADDED_LATER = ["recipe", "policy", "skipped", "operands"]
BENCH_COLUMNS = ["median_ms", "gpu_ms", "tflops"]  # parity.bench's timings: a benchmark's table, not a sweep's
LAYOUT_COLUMNS = {"input_layout": "in", "weight_layout": "w", "grad_output_layout": "go"}
OPERAND_LAYOUTS = [f"{operand}:{letter}" for operand in LAYOUT_COLUMNS.values() for letter in "CTSP"]
K_BINS, K_LABELS = [0, 64, 256, 1024, 4096, math.inf], ["16-64", "65-256", "257-1024", "1025-4096", ">4096"]
TEXT_COLUMNS = ["case_id", "lead", "error", "reference_error", "contract", "scaled_mm", "dtype", "max_abs_index",
                "bound_index", "recipe", "reference_recipe", "policy", "skipped", "operands"]
DETAILS_PER_FINDING = 20
EXAMPLES_IN_HEADLINE = 3
# `diff`: the moved rows printed, largest first (every row is in --csv). 40 rows fill a screen; a
# regression that moves more shows its pattern in the first 40.
DIFF_ROWS_SHOWN = 40
# `diff`: below this share of the smaller run's rows with a counterpart in the other, the two runs
# are mostly different cases (another preset, seed or sample size) and their moves say little.
DIFF_MIN_MATCHED_SHARE = 0.5
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
CSS = """body{font-family:system-ui,sans-serif;max-width:80rem;margin:2rem auto;padding:0 1rem;color:#222}
.headline{font-size:1.15rem;font-weight:600;padding:.6rem .8rem;border-radius:4px}
.pass{background:#e6f4ea;border-left:6px solid #1e8e3e}.fail{background:#fce8e6;border-left:6px solid #d93025}
.env{color:#555;font-family:monospace}table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0 1.5rem}
th,td{border:1px solid #ccc;padding:.2rem .5rem;text-align:right}th{background:#f1f3f4}
td:first-child,td:nth-child(2){text-align:left}img{max-width:100%;border:1px solid #eee}.note{color:#555}"""


@dataclass(frozen=True)
class Verdict:
    """Whether a candidate keeps parity: `headline` is the one sentence a reader sees first,
    `details` one line per finding (the evidence, or the context of a pass)."""

    ok: bool
    headline: str
    details: list[str] = field(default_factory=list)
    next_step: str | None = None  # a failing verdict: the command that localizes the smallest failing case
    NEXT_STEP_WHY = "names the GEMM, operand, bug class and trigger of the smallest failing case"


class ResultsError(ValueError):
    """A results file that cannot be read as a parity sweep's table: the message names the file,
    what it is instead (truncated, empty, another table, a benchmark's, an older schema) and the fix."""


def _missing(columns) -> list[str]:
    return [column for column in REQUIRED_COLUMNS if column not in set(columns)]


def _validated(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame itself, or a ValueError that says what is wrong with it."""
    if frame.empty:
        raise ValueError("the results table is empty: there is nothing to report (did the run select no cases?)")
    missing = _missing(frame.columns)
    if missing:
        hint = (" (a table written before recipes were data: rerun the sweep that made it)"
                if set(missing) <= set(ADDED_LATER) else ": is it a table of parity.runner.run_cases?")
        raise ValueError(f"the results table lacks the columns {missing}{hint}")
    return frame


def _not_a_sweep(columns) -> str | None:
    """What a table with these columns is, when it is not a parity sweep's results table."""
    missing = _missing(columns)
    if not missing:
        return None
    if "sqnr_db" in missing and any(column in set(columns) for column in BENCH_COLUMNS):
        timings = ", ".join(column for column in BENCH_COLUMNS if column in set(columns))
        return (f"is a benchmark report, not a parity sweep: it has timings ({timings}) and no sqnr_db "
                f"(give the results of `fp8-parity sweep`)")
    if set(missing) <= set(ADDED_LATER):
        return f"was written by an older fp8-parity (missing columns {', '.join(missing)}): re-run the sweep"
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (f"is not an fp8-parity results table: it lacks columns {shown} "
            f"(give the results.csv.gz of `fp8-parity sweep` or its directory)")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _order_statistic(grouped, q: float) -> pd.Series:
    return grouped.quantile(q, interpolation="lower")


def _layout_label(rows: pd.DataFrame) -> pd.Series:
    return ("in:" + rows["input_layout"].astype(str) + " w:" + rows["weight_layout"].astype(str)
            + " go:" + rows["grad_output_layout"].astype(str))


def _dtype_label(rows: pd.DataFrame) -> pd.Series:
    return "in:" + rows["input_dtype"].astype(str) + " w:" + rows["weight_dtype"].astype(str)


def _ran(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows where neither the implementation nor the reference raised, nor was the case
    skipped: those with metrics."""
    return rows[rows["error"].isna() & rows["reference_error"].isna() & ~_skipped(rows)]


def _skipped(rows: pd.DataFrame) -> pd.Series:
    return rows["skipped"].fillna("").astype(str) != ""


def _parity_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows judged bitwise: each implementation against another of its own recipe."""
    return frame[frame["policy"] == Policy.BITWISE.value]


def _accuracy_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows against fp64, with `tensor` ordered as the layer computes them."""
    rows = frame[frame["reference"] == ACCURACY_REFERENCE]
    return rows.assign(tensor=pd.Categorical(rows["tensor"], categories=TENSORS))


def _overall(frame: pd.DataFrame) -> pd.DataFrame:
    """Per implementation x tensor: the columns of the `overall` table (see summary_tables)."""
    keys = ["impl", "tensor"]
    frame = frame.assign(tensor=pd.Categorical(frame["tensor"], categories=TENSORS))
    accuracy = _ran(frame[frame["reference"] == ACCURACY_REFERENCE]).groupby(keys, observed=True)
    sqnr = accuracy["sqnr_db"]
    parity = _ran(_parity_rows(frame))
    once = frame.drop_duplicates(["case_id", "impl", "tensor", "step"])  # an impl's own facts repeat per reference
    crashed = once[once["error"].notna()]
    table = pd.concat({
        "recipe": frame.groupby(keys, observed=True)["recipe"].first(),
        "cases": _ran(frame).groupby(keys, observed=True)["case_id"].nunique(),
        "SQNR median (dB)": _order_statistic(sqnr, 0.5),
        "SQNR p05 (dB)": _order_statistic(sqnr, 0.05),
        "SQNR min (dB)": sqnr.min(),
        "max rel err": accuracy["max_rel_err"].max(),
        "bitwise vs its recipe's reference (%)": 100 * parity.groupby(keys, observed=True)["bitwise"].mean(),
        **_nonfinite_counts(frame, once),
        "crashed cases": crashed.groupby(keys, observed=True)["case_id"].nunique(),
        "skipped cases": frame[_skipped(frame)].groupby(keys, observed=True)["case_id"].nunique(),
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
    frame = _validated(frame)
    accuracy = _ran(_accuracy_rows(frame))
    layouts = accuracy.melt(id_vars=["impl", "tensor", "sqnr_db"], value_vars=list(LAYOUT_COLUMNS),
                            var_name="operand", value_name="letter")
    layouts = layouts.assign(layout=pd.Categorical(layouts["operand"].map(LAYOUT_COLUMNS) + ":" + layouts["letter"],
                                                   categories=OPERAND_LAYOUTS))
    optional = {"crashes": _crashes(frame), "worst": _worst_values(frame)}  # shown where they have rows
    return {
        "overall": _overall(frame),
        **{name: table for name, table in optional.items() if len(table)},
        "by_k": _median_sqnr_by(accuracy.assign(K=pd.cut(accuracy["K"], K_BINS, labels=K_LABELS)), "K"),
        "by_dist": _median_sqnr_by(accuracy, "dist"),
        "by_layout": _median_sqnr_by(layouts, "layout"),
        "by_dtype": _median_sqnr_by(accuracy.assign(dtypes=_dtype_label(accuracy)), "dtypes"),
    }


def _recipe_flag(impl: str, recipe: str) -> list[str]:
    """`--recipe RECIPE` for the user's code of a recipe other than the default (a built-in knows its own)."""
    from parity.impls import BUILTINS
    return [] if impl in BUILTINS or recipe == DEFAULT_RECIPE.name else ["--recipe", recipe]


def _rerun(row: Mapping) -> str:
    """The `fp8-parity check` command that runs exactly this row's case, implementation and
    reference (parity.check.rerun_command); "" for a case id that parity.cases cannot rebuild."""
    from parity.check import rerun_command
    try:
        case = parse_case_id(row["case_id"])
    except CaseError:
        return ""
    device = row.get("device")
    device = device.split(":")[0] if isinstance(device, str) else "auto"  # cuda:1 of a sharded sweep: cuda
    recipe = row["recipe"] if isinstance(row.get("recipe"), str) else DEFAULT_RECIPE.name
    return rerun_command(row["impl"], row["reference"], device, _recipe_flag(row["impl"], recipe))(case)


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
    of_reference = frame[frame["error"].isna() & frame["reference_error"].notna() & ~_skipped(frame)]
    raised = pd.concat([own.assign(**dict(zip(keys, [own["impl"], "implementation", own["error"].map(_first_line)]))),
                        of_reference.assign(**dict(zip(keys, [of_reference["reference"], "reference",
                                                              of_reference["reference_error"].map(_first_line)])))])
    if raised.empty:
        return pd.DataFrame()
    groups = raised.groupby(keys)
    first = groups.head(1).set_index(keys)  # the first row of each group, in the table's order
    table = groups["case_id"].nunique().rename("cases").to_frame().join(first["case_id"].rename("example case"))
    return table.assign(rerun=[_rerun(row) for row in first.loc[table.index].reset_index().to_dict("records")])


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


def _why(row: Mapping) -> str:
    """Why a row's value is expected: what explains it (the policy does not judge that data, the
    data, an overflow of the output dtype, elements whose reference is 0) and how its policy
    judged it; or the finding it is."""
    found = evaluate([row])
    if found:
        return f"a finding: {found[0].message}"
    policy = row_policy(row)
    floor = (sqnr_floor(row["recipe"], row["tensor"], row["dist"], row["input_dtype"], row.get("n_eff", math.inf))
             if policy is Policy.SQNR else None)
    unjudged = policy is Policy.SQNR and floor is None
    reasons = (["not judged by SQNR: " + UNJUDGED_DATA.get(row["dist"], "the sqnr policy exempts this data")]
               if unjudged else [EXPLAINED_DATA[row["dist"]]] if row["dist"] in EXPLAINED_DATA else [])
    if row["inf"] > row.get("unexpected_inf", 0):
        reasons.append("Inf where the output dtype overflows")
    at_zero = row.get("n_diff_where_reference_zero", 0)
    if at_zero > 0:
        reasons.append(f"{_plural(int(at_zero), 'element')} differ where the reference is 0 (not in ULPs)")
    if policy is Policy.SQNR and not unjudged:
        reasons.append(f"SQNR {row['sqnr_db']:.1f} dB, above its floor of {floor:.1f} dB")
    elif policy is Policy.ACCUMULATION:
        reasons.append(f"at {row['bound_ratio']:.2g} of the accumulation bound" if row["bound_ratio"] > 0 else
                       "equal to its exact emulation")
    elif policy is Policy.BITWISE:
        reasons.append("bitwise equal to its recipe's reference")
    elif not unjudged:
        reasons.append("measured, not judged")
    return "; ".join(reasons)


def _worst_values(frame: pd.DataFrame) -> pd.DataFrame:
    """Per implementation x tensor x WORST_VALUES: the row that attains it (the first, on a tie)."""
    ran = _ran(frame).assign(tensor=lambda r: pd.Categorical(r["tensor"], categories=TENSORS))
    sources = {"against fp64": ran[ran["reference"] == ACCURACY_REFERENCE],
               "against its recipe's exact emulation": ran[ran["policy"] == Policy.ACCUMULATION.value]}
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
    records = rows.to_dict("records")
    return pd.DataFrame({"impl": rows["impl"], "tensor": rows["tensor"].astype(str), "worst": rows["worst"],
                         "value": rows["value"].astype(float), "against": rows["reference"], "case": rows["case_id"],
                         "dist": rows["dist"], "why": [_why(r) for r in records],
                         "rerun": [_rerun(r) for r in records]}).reset_index(drop=True)


METRIC_PHRASES = {  # violation metric -> what the implementation did
    "crash": "crashed", "bitwise": "differs from an implementation of its recipe",
    "accumulation_bound": "differs from its recipe's exact FP8 result beyond accumulation and rounding",
    "operand": "hands its GEMMs other fp8 operands or scales than its recipe's",
    "sqnr_db": "falls below the SQNR floor against fp64",
    "paired_sqnr_db": "is less accurate than its paired reference",
    "nonfinite": "gives NaN/Inf the reference does not", "contract": "breaks nn.Linear's contract",
    "scaled_mm_contract": "makes _scaled_mm calls that would fail on an H100",
}


def _where(violation: Violation) -> str:
    return f"{violation.case_id} {violation.tensor} step {violation.step} vs {violation.reference}"


def verdict(frame: pd.DataFrame, *, candidate: str = "fp8_impl") -> Verdict:
    """PASS when every row of `candidate` meets the policy it carries (parity.policy.evaluate,
    the same function `check` judges with): bitwise where compared with another implementation
    of its recipe, within the accumulation bound (and with the oracle's operands) against its
    recipe's exact emulation, above the SQNR floor against fp64, never raised, kept
    nn.Linear's contract and made no _scaled_mm call that would fail on an H100; FAIL otherwise,
    naming the first failing cases. A comparison that could not be made because the reference
    raised also fails: parity was not shown there. NO VERDICT (ok=False) when the frame holds no
    judged comparison of the candidate (none, or every case skipped)."""
    frame = _validated(frame)
    mine = frame[frame["impl"] == candidate]
    judged = _ran(mine[mine["policy"] != Policy.NONE.value])
    if judged.empty:
        skipped = mine[_skipped(mine)]
        why = (f"every case was skipped ({skipped['skipped'].iloc[0]})" if len(skipped) else
               f"the results hold no judged {candidate} rows (implementations: "
               f"{', '.join(sorted(frame['impl'].unique()))})")
        if not len(mine[mine["error"].notna()]):
            return Verdict(False, f"NO VERDICT: {why}")
    recipe = mine["recipe"].iloc[0]
    sqnr = _overall(mine).loc[candidate].dropna(subset=["SQNR median (dB)"]) if len(_ran(mine)) else pd.DataFrame()
    accuracy = ("SQNR vs fp64, median (p05): " + ", ".join(
        f"{tensor} {row['SQNR median (dB)']:.1f} ({row['SQNR p05 (dB)']:.1f}) dB, expected "
        f"{row['expected SQNR (dB)']:.1f} (floor {row['SQNR floor (dB)']:.1f})" for tensor, row in sqnr.iterrows())
                if len(sqnr) else "no rows against fp64: accuracy not measured")
    skipped = mine[_skipped(mine)].drop_duplicates("case_id")
    skip_line = ([f"{_plural(len(skipped), 'case')} skipped, not judged: {skipped['skipped'].iloc[0]}"]
                 if len(skipped) else [])
    violations = evaluate(mine)
    reference_failed = mine[mine["error"].isna() & mine["reference_error"].notna() & ~_skipped(mine)]
    if not violations and reference_failed.empty:
        by_policy = judged.groupby(["policy", "reference"])["case_id"].agg(["size", "nunique"])
        said = {"bitwise": "bitwise equal to {ref}", "accumulation": "within the accumulation bound of {ref}",
                "sqnr": "above the SQNR floor against {ref}", "paired": "within 3 dB of {ref}'s accuracy"}
        parts = [said[p].format(ref=ref) + f" in {n}/{n} comparisons ({_plural(cases, 'case')})"
                 for (p, ref), (n, cases) in by_policy.iterrows()]
        return Verdict(True, f"PASS: {candidate} ({recipe}) is " + "; ".join(parts),
                       [accuracy, *skip_line, "no crash, no contract problem, no _scaled_mm call that would fail on "
                                              "an H100, no operand that differs from its recipe's"])
    phrases, details = [], []
    by_metric: dict[str, list[Violation]] = {}
    for violation in violations:
        by_metric.setdefault(violation.metric, []).append(violation)
    for metric, found in by_metric.items():
        examples = ", ".join(v.case_id if metric == "crash" else _where(v) for v in found[:EXAMPLES_IN_HEADLINE])
        more = ", ..." if len(found) > EXAMPLES_IN_HEADLINE else ""
        noun = "case" if metric == "crash" else "comparison"
        phrases.append(f"{METRIC_PHRASES.get(metric, metric)} in {_plural(len(found), noun)} (first: {examples}{more})")
        details += [f"{metric}: {v.case_id}: {v.full_message}" for v in found[:DETAILS_PER_FINDING]]
        if len(found) > DETAILS_PER_FINDING:
            details.append(f"... and {len(found) - DETAILS_PER_FINDING} more")
    if len(reference_failed):
        first = reference_failed.iloc[0]
        phrases.append(f"could not be compared in {_plural(len(reference_failed), 'comparison')} because the "
                       f"reference raised (first: {first['case_id']} vs {first['reference']})")
        details += [f"reference raised: {row.case_id} {row.tensor} step {row.step} vs {row.reference}: "
                    f"{row.reference_error}" for row in reference_failed.head(DETAILS_PER_FINDING).itertuples()]
    return Verdict(False, f"FAIL: {candidate} ({recipe}) " + "; ".join(phrases), [*details, accuracy, *skip_line],
                   _next_step(mine, violations, reference_failed, candidate, recipe))


def _next_step(rows: pd.DataFrame, violations: Sequence[Violation], reference_failed: pd.DataFrame,
               candidate: str, recipe: str) -> str | None:
    """`fp8-parity bisect` on the smallest failing case (fewest multiply-adds, then fewest steps)."""
    failing = {v.case_id for v in violations} | set(reference_failed["case_id"])
    cases = rows[rows["case_id"].isin(failing)].drop_duplicates("case_id")
    if cases.empty:
        return None
    smallest = cases.assign(work=cases["M"] * cases["K"] * cases["N"]).sort_values(["work", "steps"]).iloc[0]
    return " ".join(["fp8-parity bisect", "--impl", candidate, *_recipe_flag(candidate, recipe),
                     f"--case '{smallest['case_id']}'"])


_judge = verdict  # write_report's parameter `verdict` shadows the function


def _env_line(env: Mapping) -> str:
    return " · ".join(f"{key} {value}" for key, value in env.items() if value not in (None, ""))


def _percent(value: float, decimals: int) -> str:
    """A rate in % as text that never rounds a single difference up to 100."""
    return "100" if value == 100 else f"{min(value, 100 - 10 ** -decimals):.{decimals}f}"


def _cell(value, *, percent: bool) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    if not isinstance(value, float):
        return str(value)
    if percent:
        return _percent(value, 2)
    return f"{value:.2f}" if value == 0 or 0.1 <= abs(value) < 1e6 else f"{value:.3g}"  # inf stays "inf"


def _displayed(table: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The table as text (2 decimals or 3 significant digits, inf kept, missing blank) and the
    alignment of its columns."""
    table = table.reset_index() if any(name is not None for name in table.index.names) else table
    align = ["right" if pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype) else "left"
             for dtype in table.dtypes]
    text = pd.DataFrame({str(name): [_cell(v, percent=str(name).endswith("(%)")) for v in column]
                         for name, column in table.items()})
    return text, align


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
    accuracy = _accuracy_rows(frame)
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
    fig.suptitle(f"SQNR against fp64 by K: median per K (line), each case (dots); {_plural(infinite, 'row')} "
                 f"with infinite SQNR (inf: bitwise equal to fp64) not drawn", fontsize=10)


def _plot_parity_heatmap(fig: Figure, frame: pd.DataFrame, candidate: str) -> None:
    rows = _ran(_parity_rows(frame[frame["impl"] == candidate]))
    labelled = rows.assign(layout=_layout_label(rows), dtypes=_dtype_label(rows), bitwise=rows["bitwise"].astype(float))
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
            ax.text(j, i, f"{_percent(value, 1)}% n={int(cases.iat[i, j])}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="bitwise equal (%)")
    references = ", ".join(sorted(rows["reference"].unique()))
    ax.set_title(f"{candidate} bitwise equal to {references}\n(layout: in/w/go; n: cases; blank: not run)",
                 fontsize=9)


def _standard_plots(frame: pd.DataFrame, candidate: str) -> dict[str, Callable]:
    """The built-in plots whose data the frame holds."""
    plots = {}
    if np.isfinite(_ran(_accuracy_rows(frame))["sqnr_db"]).any():
        plots["sqnr_vs_k.png"] = partial(_plot_sqnr_vs_k, frame=frame)
    if len(_ran(_parity_rows(frame[frame["impl"] == candidate]))):
        plots["parity_heatmap.png"] = partial(_plot_parity_heatmap, frame=frame, candidate=candidate)
    return plots


def _drawn(name: str, draw: Callable[[Figure], None]) -> bytes:
    """The image file `name` (its suffix gives the format) that `draw` makes."""
    fig = Figure(layout="constrained")
    FigureCanvasAgg(fig)
    draw(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(name).suffix.lstrip(".") or "png", dpi=110)
    return buffer.getvalue()


def _markdown(title: str, judged: Verdict, env: Mapping, sections: list, images: list[Path]) -> str:
    lines = [f"# {title}", "", f"**{judged.headline}**", "", _env_line(env), "", *(f"- {d}" for d in judged.details)]
    for heading, note, table in sections:
        lines += ["", f"## {heading}", ""] + ([note, ""] if note else [])
        text, align = _displayed(table)
        lines.append(text.to_markdown(index=False, disable_numparse=True, colalign=align) if len(text) else "(no rows)")
    lines += ["", "## Plots", ""] + [f"![{image.stem}]({image.name})" for image in images]
    if judged.next_step:
        lines += ["", "## What to run next", "", f"`{judged.next_step}`: {Verdict.NEXT_STEP_WHY}"]
    return "\n".join(lines) + "\n"


def _html(title: str, judged: Verdict, env: Mapping, sections: list, images: list[Path]) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>", f'<p class="headline {"pass" if judged.ok else "fail"}">{e(judged.headline)}</p>',
            f'<p class="env">{e(_env_line(env))}</p>', "<ul>", *(f"<li>{e(d)}</li>" for d in judged.details), "</ul>"]
    for heading, note, table in sections:
        body += [f"<h2>{e(heading)}</h2>"] + ([f'<p class="note">{e(note)}</p>'] if note else [])
        text, _ = _displayed(table)
        body.append(text.to_html(index=False, border=0) if len(text) else "<p>(no rows)</p>")
    body += ["<h2>Plots</h2>", *(f'<p><img src="{e(i.name)}" alt="{e(i.stem)}" /></p>' for i in images)]
    if judged.next_step:
        body += ["<h2>What to run next</h2>", f"<p><code>{e(judged.next_step)}</code>: {e(Verdict.NEXT_STEP_WHY)}</p>"]
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8" />\n<title>{e(title)}</title>\n'
            f"<style>\n{CSS}\n</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")


def write_report(frame: pd.DataFrame, out_dir: str | Path, *, title: str = "fp8-parity report",
                 candidate: str = "fp8_impl", verdict: Verdict | None = None,
                 extra_tables: Mapping[str, pd.DataFrame] | None = None,
                 plots: bool = True, extra_plots: Mapping[str, Callable[[Figure], None]] | None = None,
                 tables: Sequence[tuple[str, str | None, pd.DataFrame]] | None = None,
                 write_table: bool = True) -> list[Path]:
    """Write the report of `frame` into `out_dir` (created) and return the paths written.

    results.csv.gz  the full tidy table (tuples as text; read it back with read_results)
    env.json        frame.attrs["env"]: versions, device, git commit
    summary.md      title, the verdict's headline, the environment in one line, the evidence,
                    then the tables (GitHub Markdown)
    index.html      the same as a standalone page (inline CSS, no scripts, no external files)
    *.png           with plots=True: sqnr_vs_k.png and parity_heatmap.png (where the frame
                    has their data), then `extra_plots` (file name -> draw(fig)) in any case

    `verdict` defaults to verdict(frame, candidate=...); pass your own to
    headline another kind of report. `extra_tables` (heading -> table) follow the summary.
    `tables` ((heading, note, table) sections) replaces the parity summary: then `frame` may be
    any tidy table (a benchmark's), `verdict` is required and plots=False skips the parity plots.
    write_table=False leaves results.csv.gz and env.json as they are (`report DIR` re-renders
    from them and must never rewrite its own input); they are then not in the list returned.

    Nothing lost, nothing half-written: every file is rendered in memory first (an error in a
    table or a plot touches no file), then each is written atomically (parity.outputs): the
    table and env.json first, summary.md and index.html last, and a summary of the table being
    replaced is removed before it, so a run cut short never leaves a summary beside a table it
    does not describe (`fp8-parity report DIR` renders it again).
    """
    if tables is None:
        frame = _validated(frame)
    elif verdict is None:
        raise ValueError("write_report(tables=...) needs a verdict: the default one judges parity rows")
    out = Path(out_dir)
    judged = verdict if verdict is not None else _judge(frame, candidate=candidate)
    env = frame.attrs.get("env", {})
    drawings = {**(_standard_plots(frame, candidate) if plots else {}), **(extra_plots or {})}
    images = {out / name: _drawn(name, draw) for name, draw in drawings.items()}
    if tables is None:
        tables = [(*TABLE_HEADINGS[name], table)
                  for name, table in summary_tables(frame).items()]
    sections = [*tables, *((name, None, table) for name, table in (extra_tables or {}).items())]
    pages = {out / "summary.md": _markdown(title, judged, env, sections, list(images)),
             out / "index.html": _html(title, judged, env, sections, list(images))}
    written = []
    if write_table:
        data = {out / RESULTS_FILE: gzip.compress(frame.to_csv(index=False).encode(), mtime=0),
                out / ENV_FILE: (json.dumps(env, indent=2, default=str) + "\n").encode()}
        for page in pages:
            page.unlink(missing_ok=True)  # it describes the table about to be replaced
        written += [atomic_write_bytes(path, content) for path, content in data.items()]
    written += [atomic_write_bytes(path, content) for path, content in images.items()]
    return written + [atomic_write_text(path, text) for path, text in pages.items()]


def read_results(path: str | Path) -> pd.DataFrame:
    """The results table from a report directory, or a .csv / .csv.gz / .parquet file (parquet
    needs pyarrow), with attrs["env"] from the env.json beside it. Text stays text (case ids,
    leading dims like "16"), empty contract/scaled_mm cells are "", index tuples stay strings.

    FileNotFoundError when there is no such file; ResultsError (a ValueError) when it is
    truncated or corrupt, holds no rows, is another table, a benchmark's, or lacks the columns
    added since it was written."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}: give a report directory or a .csv/.csv.gz/.parquet file")
    try:
        if path.suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:  # round_trip parsing reads back exactly the floats that to_csv wrote
            frame = pd.read_csv(path, dtype={c: "str" for c in TEXT_COLUMNS}, float_precision="round_trip")
    except pd.errors.EmptyDataError:
        raise ResultsError(f"{path} holds no results (the file is empty): re-run the sweep") from None
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError, pd.errors.ParserError) as err:
        raise ResultsError(f"{path} is truncated or corrupt ({err}): re-run the sweep") from None
    problem = _not_a_sweep(frame.columns)
    if problem:
        raise ResultsError(f"{path} {problem}")
    if frame.empty:
        raise ResultsError(f"{path} holds no results (a header without rows): re-run the sweep")
    text = {c: frame[c].fillna("") for c in ("contract", "scaled_mm") if c in frame}
    flags = {c: frame[c].astype(bool) for c in ("bitwise", "bias") if c in frame}
    frame = frame.assign(**text, **flags)
    env_file = path.parent / ENV_FILE
    if env_file.is_file():
        frame.attrs["env"] = json.loads(env_file.read_text())
    return frame


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
    columns = [*KEY, "bitwise", "sqnr_db", "nan", "inf", "raised"]
    a_cases, b_cases = (frame.attrs.get("env", {}).get("cases") for frame in (a, b))  # the sweep's case set, in words
    a, b = (frame.assign(raised=frame["error"].fillna("reference: " + frame["reference_error"]))[columns]
            .drop_duplicates(KEY) for frame in (_validated(a), _validated(b)))
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
    diff.attrs.update(rows_compared=len(both), sqnr_tolerance_db=sqnr_tolerance_db, rows_a=len(a), rows_b=len(b),
                      cases_a=a_cases, cases_b=b_cases)
    return diff


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
    moves = diff[~diff["change"].isin(ONE_SIDED)] if len(diff) else diff
    if moves.empty:
        lines.append("No row moved beyond noise.")
        return "\n".join(lines) + "\n"
    moved = moves[KEY].drop_duplicates().shape[0]
    lines.append(f"{_plural(moved, 'row')} moved beyond noise: "
                 + ", ".join(f"{n} {change}" for change, n in counts.items() if n and change not in ONE_SIDED))
    largest = (moves.assign(size=moves["delta"].abs().fillna(math.inf))
               .sort_values(["change", "size"], ascending=[True, False], kind="stable").drop(columns="size"))
    shown = largest.head(DIFF_ROWS_SHOWN)
    shown = shown.assign(**{c: shown[c].map(lambda v: str(v)[:60] if isinstance(v, str) else v)
                            for c in ("a_value", "b_value")})
    text, align = _displayed(shown)
    lines += ["", text.to_markdown(index=False, tablefmt="simple", disable_numparse=True, colalign=align)]
    if len(moves) > DIFF_ROWS_SHOWN:
        lines.append(f"... and {len(moves) - DIFF_ROWS_SHOWN} more moves (--csv FILE writes every one)")
    return "\n".join(lines) + "\n"
