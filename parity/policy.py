"""Parity policies: when does a result row count as a violation, and why that threshold.

Every row carries its policy (parity.runner writes it, from default_policy or the user's
choice), and `evaluate` is the one function that judges rows: check, sweep, report, diff and
the property suite all call it, so no two commands can disagree about the same rows.

bitwise       Two implementations of the same recipe (parity.recipes) in eager mode must be
              bitwise equal in every tensor: both quantize identically and call the same GEMMs
              with the same flags. Measured: fp8_impl and torchao agree bitwise for tensorwise,
              rowwise and rowwise_with_gw_hp on CPU and on the H200. Any difference is a bug.
accumulation  Against the exact float64 emulation of its recipe, a correct implementation can
              differ only by accumulation and rounding; each element must lie within the
              rigorous bound of parity.oracles.accumulation_excess (Higham's gamma_k with fp32,
              or the tensor-core model on the GPU, plus the output roundings). The GEMM calls
              it records must also hand each GEMM the oracle's fp8 bytes and scales, bitwise
              (parity.diagnose): a violation "operand" names the GEMM, operand and stage.
sqnr          Against fp64 or bf16 nn.Linear: SQNR at least a floor per recipe, tensor and
              distribution. The floors come from the recipe's quantization-noise model
              (Recipe.expected_sqnr_db: e4m3 x e4m3 28.5 dB per GEMM; e4m3 x e5m2 24.6 dB;
              bf16 rounding alone 50.8 dB) minus 3 dB for the model (over 280 random cases from
              16x16 to 256x256 on CPU the lowest SQNR sat 1.8 dB below the median, normal data),
              minus four standard deviations of the SQNR estimate itself: a tensor whose energy
              sits in n_eff = (sum r^2)^2 / sum r^4 elements measures its noise power from
              ~n_eff squared errors, relative std sqrt(2 / n_eff) (an outlier channel leaves
              n_eff ~ N: on the H200 a 16x16 grad_weight with one outlier column measured
              21.5 dB, 3.1 dB under the model). Data that spreads over ~20 binades (`tiny`)
              loses its smallest values to fp8's subnormal range: its floor is 10 dB below the
              model (lowest measured: 6.2 below). All-zero data leaves only the bias's rounding
              to the output dtype: bf16's floor. (test_properties checks that zeros give exact
              zeros.) Not applicable: fp16 with `nearmax` data, whose products (448^2 each)
              exceed fp16's max of 65504, so whether an output overflows depends on
              quantization noise; the exact FP8 emulation (accumulation policy) judges those
              cases instead, and overflows exactly where a correct implementation does. Nor
              `tiny_amax` data (amax 1e-30): the scale's EPS floor of 1e-12 quantizes it to
              zeros by design; nor `outlier_row` data (one token 10^4 times larger): one scale
              per tensor crushes every other row into fp8's subnormals, which rowwise and
              blockwise scales avoid: a property of the recipe, measured in the sweep's tables
              (fp16 input, measured: output SQNR 15 dB tensorwise where the outlier row
              overflows fp16), not a bug. Bitwise and accumulation policies judge both.
paired        A candidate of another recipe against a reference (rowwise against tensorwise):
              both are measured against fp64 on the same inputs, and the candidate may be at
              most 3 dB worse. Measured worst paired gap, rowwise vs tensorwise output over 280
              cases: 2.8 dB (power-of-two scales waste up to one bit of range).
exact         Against hopper:<recipe>, the recipe's GEMMs as the H200 computes them (parity.hopper_oracle):
              on a GPU whose calibration table vouches for the call (parity.calibration), every
              element bit for bit (the model reproduced 720 of 728 calibrated H200 configurations
              exactly, and where it did not the table says so); elsewhere the row says why it is
              not judged here, and the accumulation policy against the float64 emulation judges it.
none          Measured, not judged: the fp64 rows a paired comparison reads.

Every policy also reports, for any candidate: a crash, a broken nn.Linear contract, a
_scaled_mm call that would fail on an H100, and NaN/Inf that the reference does not have.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable

import pandas as pd

from parity import cpu_gemm
from parity.findings import Finding
from parity.recipes import DEFAULT_RECIPE, RECIPES, Recipe, get_recipe
from parity.rows import Row, as_rows, row_key
from parity.vocabulary import Cause, Kind, Stage, Tensor

SQNR_MARGIN_DB = 3.0
TINY_MARGIN_DB = 10.0
PAIRED_MARGIN_DB = 3.0
ACCURACY_REFERENCE = "fp64"  # the reference every implementation's accuracy is measured against


class Policy(str, enum.Enum):
    BITWISE = "bitwise"
    ACCUMULATION = "accumulation"
    SQNR = "sqnr"
    PAIRED = "paired"
    EXACT = "exact"  # bit for bit against the Hopper model where calibrated
    NONE = "none"  # measured, not judged (the fp64 rows a paired comparison reads)


def default_policy(candidate, reference) -> Policy:
    """The policy a (candidate, reference) pair of parity.impls.Impl is judged by unless the user
    names one: read from their recipes, never from their names."""
    if reference.is_reference:  # a high-precision nn.Linear
        return Policy.SQNR
    if candidate.recipe is not reference.recipe:
        return Policy.PAIRED
    if reference.bit_model:
        return Policy.EXACT
    if reference.exact or candidate.exact:
        return Policy.ACCUMULATION
    return Policy.BITWISE


def sampling_margin_db(n_eff: float) -> float:
    """Four standard deviations of an SQNR measured on a tensor whose energy sits in `n_eff`
    elements: its noise power is a mean of about n_eff squared errors, relative std sqrt(2/n_eff)."""
    return 10 * math.log10(1 + 4 * math.sqrt(2 / max(n_eff, 1.0)))


def sqnr_floor(recipe: Recipe | str, tensor: str, dist: str, input_dtype: str = "bf16",
               n_eff: float = math.inf) -> float | None:
    """Lowest acceptable SQNR (dB) against fp64/bf16 for this recipe, tensor and distribution, on a
    tensor of `n_eff` effective elements; None where the sqnr policy does not apply (see the
    module docstring)."""
    recipe = get_recipe(recipe)
    if (dist == "nearmax" and input_dtype == "fp16") or dist in ("tiny_amax", "outlier_row"):
        return None
    sampling = sampling_margin_db(n_eff) if math.isfinite(n_eff) else 0.0
    if dist == "zeros":  # nothing to quantize; only the bias's rounding to the output dtype remains
        return RECIPES["bf16"].expected_sqnr_db(tensor) - SQNR_MARGIN_DB - sampling
    return recipe.expected_sqnr_db(tensor) - (TINY_MARGIN_DB if dist == "tiny" else SQNR_MARGIN_DB) - sampling


# The detail of an "operand" violation whose only difference is the fast-accumulation flag: a CPU's
# _scaled_mm ignores it, so there the numbers cannot show it (parity.bisect: "only on the GPU"), except
# under --cpu-gemm hopper, whose model of the H200 accumulates as the flag says
CPU_IGNORES = "only the use_fast_accum flag differs, which a CPU ignores (a GPU's numbers can show it)"


@dataclass(frozen=True, kw_only=True)
class Violation(Finding):
    """A row (or a pair of rows) that breaks its policy: `kind` is the metric judged (the JSON's
    `metric`), `value` and `allowed` what was measured and what the policy allows, `message` one
    sentence (what is wrong) and `detail` where (the worst element, its values and ULP distance).
    Decisions read the typed fields: `cause` (why, where the kind alone does not say), `error` (a
    crash's Raised or Died), `problems` (a contract or GPU-rule violation's problems, an operand
    violation's StageFindings)."""

    case_id: str
    impl: str
    reference: str
    value: object
    allowed: object
    message: str
    detail: str = ""
    cause: Cause | None = None
    error: object = None
    problems: tuple = ()

    @property
    def metric(self) -> Kind:
        return self.kind

    @property
    def full_message(self) -> str:
        return f"{self.message}; {self.detail}" if self.detail else self.message


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _of(row: Row, kind: Kind, value, allowed, message: str, **more) -> Violation:
    """A violation of `row` (its case, implementation, reference, tensor and step)."""
    return Violation(kind=kind, case_id=row.case_id, impl=row.impl, reference=row.reference, tensor=Tensor(row.tensor),
                     step=int(row.step), value=value, allowed=allowed, message=message, **more)


def _row_violations(row: Row, policy: Policy) -> list[Violation]:
    where = (f"greatest abs diff {_fmt(row.max_abs_err)} at index {row.max_abs_index} "
             f"(candidate {_fmt(row.worst_candidate)}, {row.reference} {_fmt(row.worst_reference)}, "
             f"{_fmt(row.ulp_max)} ulp)")

    def v(kind: Kind, value, allowed, message: str, cause: Cause | None = None) -> Violation:
        return _of(row, kind, value, allowed, f"{row.tensor} (step {row.step}): {message}", detail=where, cause=cause)
    out = []
    recipe = row.recipe or DEFAULT_RECIPE.name
    floor = sqnr_floor(recipe, row.tensor, row.dist, row.input_dtype, row.n_eff) if policy is Policy.SQNR else None
    if policy is Policy.SQNR and floor is None:
        return out
    if row.nan > row.ref_nan or row.unexpected_inf > 0:
        out.append(v(Kind.NONFINITE, f"{row.nan} NaN, {row.inf} Inf", f"{row.ref_nan} NaN, {row.ref_inf} Inf",
                     f"{row.nan} NaN and {row.inf} Inf where {row.reference} has {row.ref_nan} and {row.ref_inf} "
                     f"({row.unexpected_inf} Inf where the reference is far from overflowing)"))
    if policy is Policy.BITWISE and not row.bitwise:
        if math.isnan(row.max_abs_err) and row.dtype is None:  # the candidate gave None (parity.runner)
            out.append(v(Kind.BITWISE, "not comparable", "bitwise equal",
                         f"cannot be compared with {row.reference} (no tensor: see contract)", Cause.MISSING))
        elif math.isnan(row.max_abs_err):
            out.append(v(Kind.BITWISE, "not comparable", "bitwise equal",
                         f"cannot be compared with {row.reference} (shape differs: see contract)", Cause.SHAPE_DIFFERS))
        elif row.n_diff == 0:
            out.append(v(Kind.BITWISE, f"dtype {row.dtype}", "bitwise equal",
                         f"equal values but a different dtype ({row.dtype}) from {row.reference}", Cause.DTYPE_ONLY))
        else:
            out.append(v(Kind.BITWISE, f"{row.n_diff} of {row.numel} elements differ", "bitwise equal",
                         f"not bitwise equal to {row.reference}: {row.n_diff} of {row.numel} elements "
                         f"differ (allowed: none; same recipe in eager mode)", Cause.VALUES_DIFFER))
    elif policy is Policy.EXACT and row.exact is True and not row.bitwise:
        out.append(v(Kind.EXACT, f"{row.n_diff} of {row.numel} elements differ", "bitwise equal",
                     f"not bitwise equal to {row.reference}, the GPU's own bits: {row.n_diff} of {row.numel} "
                     f"elements differ (allowed: none; {row.exact_why})", Cause.VALUES_DIFFER))
    elif policy is Policy.ACCUMULATION and row.bound_ratio > 1:
        out.append(v(Kind.ACCUMULATION_BOUND, row.bound_ratio, 1.0,
                     f"{row.n_beyond_bound} of {row.numel} elements differ from the exact FP8 result by more "
                     f"than accumulation and rounding allow (worst: {_fmt(row.bound_ratio)}x the bound, at index "
                     f"{row.bound_index})"))
    elif policy is Policy.SQNR and not row.sqnr_db >= floor:
        out.append(v(Kind.SQNR_DB, row.sqnr_db, floor,
                     f"SQNR {_fmt(row.sqnr_db)} dB against {row.reference} is below the {recipe} floor "
                     f"{_fmt(floor)} dB for {row.dist} data"))
    return out


def _candidate_violations(row: Row) -> list[Violation]:
    """Findings about the candidate itself (not about one comparison)."""
    out = []
    if row.contract:
        contract = "; ".join(map(str, row.contract))
        out.append(_of(row, Kind.CONTRACT, contract, "", f"{row.tensor}: {contract}", problems=row.contract))
    if row.scaled_mm:
        text = "; ".join(map(str, row.scaled_mm))
        out.append(_of(row, Kind.SCALED_MM_CONTRACT, text, "", text, problems=row.scaled_mm))
    return out


def _operand_violation(row: Row) -> Violation:
    operands = "; ".join(map(str, row.operands))
    # the flag alone differs on a CPU whose kernel ignores it; under --cpu-gemm hopper the numbers show it
    flag_only = row.operand_stages == {Stage.FAST_ACCUM} and row.device == "cpu" and cpu_gemm.mode() != "hopper"
    return _of(row, Kind.OPERAND, operands, f"the {row.recipe} oracle's operands",
               f"{row.tensor} (step {row.step}): the GEMM was handed other operands than the recipe's: {operands}",
               detail=CPU_IGNORES if flag_only else "", cause=Cause.FLAG_IGNORED_ON_CPU if flag_only else None,
               problems=row.operands)


def _crash(row: Row) -> Violation:
    return Violation(kind=Kind.CRASH, case_id=row.case_id, impl=row.impl, reference=row.reference, tensor=Tensor.ALL,
                     step=int(row.step), value=row.error, allowed="", message=row.error.crash_message, error=row.error)


def row_policy(row: Row) -> Policy:
    """The policy a result row is judged by: its `policy` column (written by parity.runner)."""
    return Policy(row.policy or Policy.NONE.value)


def evaluate(rows: pd.DataFrame | Iterable[Row], *, impls: Iterable[str] | None = None) -> list[Violation]:
    """All violations in `rows` (of the implementations `impls`, default all), each row judged by
    the policy it carries. The one verdict path: check, sweep, report and the property suite call
    it. A crash is reported once per case; skipped rows (a case an implementation cannot take)
    are no violation. A table (DataFrame) is read as its rows (parity.rows.rows_from_frame)."""
    rows = as_rows(rows)
    wanted = None if impls is None else set(impls)
    violations, seen = [], set()
    for row in rows:
        if (wanted is not None and row.impl not in wanted) or row.skipped:
            continue
        if row.error is not None:
            if (row.case_id, row.impl) not in seen:
                seen.add((row.case_id, row.impl))
                violations.append(_crash(row))
            continue
        if row.reference_error is not None:
            continue  # not the candidate's fault: run_check reports it as an error verdict
        for violation in _candidate_violations(row):  # the same on every row of a key: kept once
            key = (row.case_id, row.impl, row.tensor, row.step, violation.kind, violation.problems)
            if key not in seen:
                seen.add(key)
                violations.append(violation)
        policy = row_policy(row)
        if row.operands and policy in (Policy.BITWISE, Policy.ACCUMULATION):
            violations.append(_operand_violation(row))
        if policy not in (Policy.PAIRED, Policy.NONE):
            violations.extend(_row_violations(row, policy))
    violations.extend(_paired_violations(rows, wanted))
    return violations


def _paired_violations(rows: list[Row], wanted: set | None) -> list[Violation]:
    paired = [r for r in rows if r.policy == Policy.PAIRED.value and not r.skipped
              and (wanted is None or r.impl in wanted)]
    if not paired:
        return []
    sqnr = {r.key: r.sqnr_db for r in rows if r.reference == ACCURACY_REFERENCE and r.error is None and not r.skipped}
    out = []
    for r in paired:
        if r.error is not None or r.reference_error is not None:
            continue
        mine = sqnr.get(row_key(r.case_id, r.impl, ACCURACY_REFERENCE, r.tensor, r.step))
        ref_sqnr = sqnr.get(row_key(r.case_id, r.reference, ACCURACY_REFERENCE, r.tensor, r.step))
        if mine is None or ref_sqnr is None or ref_sqnr == math.inf:
            continue
        if not mine >= ref_sqnr - PAIRED_MARGIN_DB:
            out.append(_of(r, Kind.PAIRED_SQNR_DB, mine, ref_sqnr - PAIRED_MARGIN_DB,
                           f"{r.tensor} (step {r.step}): SQNR against fp64 {_fmt(mine)} dB is more than "
                           f"{PAIRED_MARGIN_DB} dB below {r.reference}'s {_fmt(ref_sqnr)} dB on the same inputs"))
    return out
