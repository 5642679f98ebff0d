"""A results table's verdict: PASS/FAIL of one candidate in one sentence, with the evidence and the
command to run next.

The headline names the first failing comparisons of each kind, for a terminal and a log; `brief`
is the same sentence without them, for the first screen of a report, whose summary names the
worst judged case of each policy with its rerun command instead (parity.report_summary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd

from parity.policy import Policy, Violation, evaluate
from parity.recipes import GEMMS, GRAD_BIAS_SQNR_DB, get_recipe
from parity.vocabulary import Kind
from parity.coverage import covered
from parity.impls import recipe_flag
from parity.report_rows import plural, ran, skipped_mask
from parity.report_tables import overall
from parity.results_file import validated

DETAILS_PER_FINDING = 20
EXAMPLES_IN_HEADLINE = 3


@dataclass(frozen=True)
class Verdict:
    """Whether a candidate keeps parity: `headline` is the one sentence a reader sees first,
    `details` one line per finding (the evidence, or the context of a pass), `brief` the headline
    without its examples ("": the headline is brief already; `short` reads either)."""

    ok: bool
    headline: str
    details: list[str] = field(default_factory=list)
    next_step: str | None = None  # a failing verdict: the command that localizes the smallest failing case
    brief: str = ""
    NEXT_STEP_WHY = "names the GEMM, operand, bug class and trigger of the smallest failing case"

    @property
    def short(self) -> str:
        """The headline as a report's first screen shows it: without the examples of each finding."""
        return self.brief or self.headline



METRIC_PHRASES = {  # violation kind -> what the implementation did
    Kind.CRASH: "crashed", Kind.BITWISE: "differs from an implementation of its recipe",
    Kind.ACCUMULATION_BOUND: "differs from its recipe's exact FP8 result beyond accumulation and rounding",
    Kind.EXACT: "differs from the H200's own bits (its recipe's Hopper model) where they are calibrated",
    Kind.OPERAND: "hands its GEMMs other fp8 operands or scales than its recipe's",
    Kind.SQNR_DB: "falls below the SQNR floor against fp64",
    Kind.PAIRED_SQNR_DB: "is less accurate than its paired reference",
    Kind.NONFINITE: "gives NaN/Inf the reference does not", Kind.CONTRACT: "breaks nn.Linear's contract",
    Kind.SCALED_MM_CONTRACT: "makes _scaled_mm calls that would fail on an H100",
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
    frame = validated(frame)
    mine = frame[frame["impl"] == candidate]
    judged = ran(mine[mine["policy"] != Policy.NONE.value])
    if judged.empty:
        skipped = mine[skipped_mask(mine)]
        why = (f"every case was skipped ({skipped['skipped'].iloc[0]})" if len(skipped) else
               f"the results hold no judged {candidate} rows (implementations: "
               f"{', '.join(sorted(frame['impl'].unique()))})")
        if not len(mine[mine["error"].notna()]):
            return Verdict(False, f"NO VERDICT: {why}")
    recipe = mine["recipe"].iloc[0]
    sqnr = overall(mine).loc[candidate].dropna(subset=["SQNR median (dB)"]) if len(ran(mine)) else pd.DataFrame()
    accuracy = ("SQNR vs fp64, median (p05): " + ", ".join(
        f"{tensor} {row['SQNR median (dB)']:.1f} ({row['SQNR p05 (dB)']:.1f}) dB, expected "
        f"{row['expected SQNR (dB)']:.1f}{_fixed(tensor, row['expected SQNR (dB)'])} "
        f"(floor {row['SQNR floor (dB)']:.1f})" for tensor, row in sqnr.iterrows())
                if len(sqnr) else "no rows against fp64: accuracy not measured")
    skipped = mine[skipped_mask(mine)].drop_duplicates("case_id")
    skip_line = ([f"{plural(len(skipped), 'case')} skipped, not judged: {skipped['skipped'].iloc[0]}"]
                 if len(skipped) else [])
    violations = evaluate(mine)
    reference_failed = mine[mine["error"].isna() & mine["reference_error"].notna() & ~skipped_mask(mine)]
    if not violations and reference_failed.empty:
        exact = judged[judged["policy"] == Policy.EXACT.value]
        by_policy = judged[judged["policy"] != Policy.EXACT.value].groupby(["policy", "reference"])["case_id"].agg(
            ["size", "nunique"])
        said = {"bitwise": "bitwise equal to {ref}", "accumulation": "within the accumulation bound of {ref}",
                "sqnr": "above the SQNR floor against {ref}", "paired": "within 3 dB of {ref}'s accuracy"}
        parts = [said[p].format(ref=ref) + f" in {n}/{n} comparisons ({plural(cases, 'case')})"
                 for (p, ref), (n, cases) in by_policy.iterrows()] + _exact_parts(exact)
        return Verdict(True, f"PASS: {candidate} ({recipe}) is " + "; ".join(parts) + covered(judged, candidate),
                       [accuracy, *skip_line, "no crash, no contract problem, no _scaled_mm call that would fail on "
                                              "an H100, no operand that differs from its recipe's"])
    phrases, examples, details = [], [], []
    by_kind: dict[Kind, list[Violation]] = {}
    for violation in violations:
        by_kind.setdefault(violation.kind, []).append(violation)
    for metric, found in by_kind.items():
        listed = ", ".join(v.case_id if metric is Kind.CRASH else _where(v) for v in found[:EXAMPLES_IN_HEADLINE])
        more = ", ..." if len(found) > EXAMPLES_IN_HEADLINE else ""
        noun = "case" if metric is Kind.CRASH else "comparison"
        phrases.append(f"{METRIC_PHRASES.get(metric, metric)} in {plural(len(found), noun)}")
        examples.append(f" (first: {listed}{more})")
        details += [f"{metric}: {v.case_id}: {v.full_message}" for v in found[:DETAILS_PER_FINDING]]
        if len(found) > DETAILS_PER_FINDING:
            details.append(f"... and {len(found) - DETAILS_PER_FINDING} more")
    if len(reference_failed):
        first = reference_failed.iloc[0]
        phrases.append(f"could not be compared in {plural(len(reference_failed), 'comparison')} because the "
                       f"reference raised")
        examples.append(f" (first: {first['case_id']} vs {first['reference']})")
        details += [f"reference raised: {row.case_id} {row.tensor} step {row.step} vs {row.reference}: "
                    f"{row.reference_error}" for row in reference_failed.head(DETAILS_PER_FINDING).itertuples()]
    head = f"FAIL: {candidate} ({recipe}) "
    return Verdict(False, head + "; ".join(p + e for p, e in zip(phrases, examples)), [*details, accuracy, *skip_line],
                   _next_step(mine, violations, reference_failed, candidate, recipe), brief=head + "; ".join(phrases))


def _fixed(tensor: str, expected: float) -> str:
    """What the accuracy line says of an expected SQNR that is no model's prediction: grad_bias's."""
    return " (fixed: a high-precision sum)" if tensor == "grad_bias" and expected == GRAD_BIAS_SQNR_DB else ""


def _exact_parts(exact: pd.DataFrame) -> list[str]:
    """The exact policy's part of a PASS headline: bit for bit against the Hopper model in how many FP8-GEMM
    comparisons, and why the rest were left to the accumulation bound."""
    parts = []
    for reference, rows in exact.groupby("reference", sort=False):
        fp8 = rows[[tensor in GEMMS and not get_recipe(recipe).gemm(tensor).high_precision  # no grad_bias, no hp GEMM
                    for tensor, recipe in zip(rows["tensor"], rows["recipe"])]]
        bitwise = fp8[fp8["exact"] == True]  # noqa: E712 - a column of True, False and NaN
        part = f"bitwise equal to {reference}, the GPU's own bits, in {len(bitwise)}/{len(fp8)} FP8-GEMM comparisons"
        rest = fp8[fp8["exact"] != True]["exact_why"].value_counts()  # noqa: E712
        if len(rest):
            part += " (judged by the accumulation bound in the rest: " + "; ".join(
                f"{why}: {count}" for why, count in rest.head(2).items()) + (", ..." if len(rest) > 2 else "") + ")"
        parts.append(part)
    return parts


def _next_step(rows: pd.DataFrame, violations: Sequence[Violation], reference_failed: pd.DataFrame,
               candidate: str, recipe: str) -> str | None:
    """`fp8-parity bisect` on the smallest failing case (fewest multiply-adds, then fewest steps)."""
    failing = {v.case_id for v in violations} | set(reference_failed["case_id"])
    cases = rows[rows["case_id"].isin(failing)].drop_duplicates("case_id")
    if cases.empty:
        return None
    smallest = cases.assign(work=cases["M"] * cases["K"] * cases["N"]).sort_values(["work", "steps"]).iloc[0]
    return " ".join(["fp8-parity bisect", "--impl", candidate, *recipe_flag(candidate, recipe),
                     f"--case '{smallest['case_id']}'"])

