"""Diagnosis along the data path: what each GEMM was handed, against what its recipe's oracle hands it.

For every FP8 GEMM of a recipe the exact oracle (parity.oracles) knows the operands the GEMM
must receive: the fp8 values of A and B and their inverse scales. A recorded _scaled_mm call
(parity.contract, with its tensors kept) is compared with that, stage by stage, per operand:

    fp8_dtype   the operand's fp8 format
    scale       the inverse scale of every element (tensor, row, tile or block scales alike)
    bytes       the fp8 values (logical values: a transposed copy is the same operand)
    fast_accum  the use_fast_accum flag (a CPU ignores it; the H100 does not)
    result      what the implementation does with the GEMM's result (rescaling, dtype, bias)

The first stage that differs names the operand and, through the hypothesis that reproduces
the recorded operand exactly, the bug class. Hypotheses are composed, not listed: every
operand of every GEMM is tried against the same space of mistakes (another fp8 format; amax
without abs, over another region or without its floor; a scale rounded, not inverted, not
rounded to a power of two or aimed at another max; a clamp at another bound; the operand
transposed, reshaped, read with the wrong strides or taken from the previous call), and every
result against rescaling, transposition, another rounding and the bias. An operand that
differs but matches none is reported as such, with the stages that agree.

Implementations whose GEMMs make no _scaled_mm call (their own kernels, fp8_impl's blockwise
on a CPU, a plain bf16 layer) are diagnosed by behaviour: the same hypotheses emulated end to
end and compared with the implementation's results; the nearest one names the bug when it
matches closely and clearly better than the correct emulation (ties go to the correct one).

Bug classes (the vocabulary of bisect): transpose, layout, scale, fp8_dtype, saturation,
accumulation, contract, stale_state, crash, and precision (a GEMM that runs in another precision
than its recipe says: no FP8 call where the recipe has one, or an FP8 one where it has none; or
an operand rounded to a lower precision before its fp8 cast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from parity import oracles
from parity.cases import Case
from parity.contract import ScaledMMCall
from parity.data import StepData
from parity.metrics import compare, sqnr_db
from parity.oracles import Quantized
from parity.mistakes import (NARROWER, Explanation, Hypothesis, OperandSources, ResultMistake,
                             high_precision_hypotheses, operand_hypotheses, quantize_mistaken, result_mistakes,
                             rounded_before_cast, scaled_over, strides_ignored)
from parity.recipes import BLOCK, FP8_DTYPES, GEMMS, Cast, Gemm, Recipe, Scaling
from parity.vocabulary import BugClass

MATCH_DB = 45.0  # a hypothesis "matches" results above this SQNR: quantization-level bugs sit near 25-30 dB
MARGIN_DB = 10.0  # ... and only when it is this much closer than the correct emulation (ties: the correct one)
# A result this close to the exact FP8 result (but beyond the accumulation bound), that no hypothesis
# reproduces, is read as an accumulation-level difference. Measured on Gaussian data (3 recipes x 3 seeds x
# 3 GEMMs): the operand mistakes of the hypothesis space leave 21-49 dB between the mistaken and the correct
# exact result (a median near 29 dB), except where a mistake does not change that data's numbers; a
# mistake outside the space that leaves more than 40 dB would be misread as accumulation.
ACCUMULATION_DB = 40.0


@dataclass(frozen=True)
class Finding:
    """One difference between what a GEMM got and what its recipe's oracle gives it."""

    step: int
    gemm: str  # output | grad_input | grad_weight
    operand: str  # input | weight | grad_output | result | call
    stage: str  # calls | fp8_dtype | scale | bytes | fast_accum | precision | result
    message: str
    category: str = ""  # the bug class this stage's explanation names ("" when unexplained)

    def __str__(self) -> str:
        return f"{self.gemm} GEMM (step {self.step}): {self.message}"


# ---- one operand of one recorded call ------------------------------------------------------------

def _expanded(scale: torch.Tensor, rows: int, inner: int) -> torch.Tensor:
    """Scales [rows / r, inner / i] repeated to one per element [rows, inner]."""
    return scale.repeat_interleave(rows // scale.shape[0], 0).repeat_interleave(inner // scale.shape[1], 1)


def _call_scales(kind: str, scale: torch.Tensor, role: str, rows: int, inner: int) -> torch.Tensor | None:
    """The inverse scale of each element of an operand laid out [rows, inner] (A, or B.T), from a
    recorded call's scale tensor of scaling `kind`; None when the layout is not understood."""
    s = scale.detach().to(torch.float64).cpu()
    try:
        if kind == "TensorWise" or s.numel() == 1:
            return s.reshape(1, 1).expand(rows, inner)
        if kind == "RowWise":  # A: [rows, 1]; B: [1, cols]
            return (s.reshape(rows, 1) if role == "a" else s.reshape(1, rows).t()).expand(rows, inner)
        blocks = -(-inner // BLOCK)
        if kind == "BlockWise1x128":  # A: [rows, K/128]; B: [cols, K/128] (cuBLASLt's layout)
            return _expanded(s[:, :blocks], rows, blocks * BLOCK)[:, :inner]
        if kind == "BlockWise128x128" and role == "b":  # [K/128 padded to 4, cols/128]
            return _expanded(s[:blocks].t(), -(-rows // BLOCK) * BLOCK, blocks * BLOCK)[:rows, :inner]
    except RuntimeError:  # a shape the kind does not allow: the contract rules report it
        return None
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, tuple, float, float]:
    differ = ~((got == want) | (got.isnan() & want.isnan()))
    count = int(differ.sum())
    if not count:
        return 0, (), 0.0, 0.0
    index = tuple(int(i) for i in differ.nonzero()[0])
    return count, index, float(got[index]), float(want[index])


def explain_operand(values: torch.Tensor, scales: torch.Tensor | None, cast: Cast, recipe: Recipe,
                    sources: OperandSources, gemm: str, role: str) -> tuple[str, str, str] | None:
    """(stage, category, message) for an operand a GEMM got (fp8 values and per-element inverse
    scales, laid out [rows, inner]) that is not the recipe's, or None when it is."""
    rows, inner = values.shape
    correct = quantize_mistaken(sources.view(gemm, role, "same"), cast, recipe)
    want_scales = _expanded(correct.inv_scale.cpu(), rows, inner)
    values_ok = _same(values, correct.values.cpu())
    scales_ok = scales is not None and _same(scales, want_scales)
    if values_ok and (scales_ok or scales is None):  # no scales to compare: the values decide
        return None
    values_only = None  # the first mistake whose fp8 values these are, with the recipe's scales handed over
    for hypothesis in operand_hypotheses(cast, recipe, rows, inner):
        if hypothesis.keeps_high_precision:  # these values are fp8
            continue
        q = sources.quantized(hypothesis, gemm, role, cast, recipe, (rows, inner))
        # the values came in the recipe's format (compare_call checks it first): a mistake that ends in
        # another format is not theirs, even where its values coincide with theirs
        if q is None or q.fp8_dtype != cast.dtype or not _same(values, q.values.cpu()):
            continue
        if scales is None or _same(scales, _expanded(q.inv_scale.cpu(), rows, inner)):
            stage = "scale" if hypothesis.category == "scale" or hypothesis.amax_source != "same" else "bytes"
            return stage, hypothesis.category, hypothesis.description
        values_only = values_only or hypothesis
    if scales is None:
        return "scale", "scale", "its scale tensor cannot be read as the recipe's scales (see the contract rules)"
    if scales_ok and values_only is not None:
        return "bytes", values_only.category, (f"its fp8 values are those of {values_only.description}, while the "
                                               f"GEMM is handed the recipe's scales")
    if not scales_ok:
        count, index, got, want = _first_difference(scales, want_scales)
        return "scale", "", (f"its inverse scale differs from the oracle's for {count} of {scales.numel()} elements "
                             f"(first at {list(index)}: {got:.6g}, oracle {want:.6g}, ratio "
                             f"{got / want if want else float('nan'):.6g}); no single mistake reproduces it")
    count, index, got, want = _first_difference(values, correct.values.cpu())
    return "bytes", "", (f"its scales are the recipe's but its fp8 values differ in {count} of {values.numel()} "
                         f"elements (first at {list(index)}: {got:g}, oracle {want:g}); no single mistake "
                         f"reproduces them")


def compare_call(call: ScaledMMCall, spec: Gemm, recipe: Recipe, sources: OperandSources) -> list[Finding]:
    """How a recorded call for the GEMM `spec` differs from the recipe's, stage by stage."""
    out: list[Finding] = []
    data = call.data
    if data is None:
        return out
    # torchao's form of an axis-scaled GEMM without fast accumulation: unit scales in the call,
    # the row and column scales multiplied into the result afterwards (checked by the results). Either
    # flag admits it: a GEMM that asks for no fast accumulation where the recipe wants it takes this
    # form too, and so does one the recipe runs in this form that asks for fast accumulation; each
    # then differs in that flag alone (which a CPU ignores: "only on the GPU")
    unit_scales = (data.scale_a.numel() == 1 and data.scale_b.numel() == 1
                   and float(data.scale_a.reshape(())) == 1.0 and float(data.scale_b.reshape(())) == 1.0)
    unit_form = (recipe.unit_scales_without_fast_accum and spec.kind == "RowWise" and unit_scales
                 and not (call.use_fast_accum and spec.fast_accum))
    operands_differ = scales_elsewhere = False
    b_as_rows = data.b.t() if data.b.dim() == 2 else data.b
    swapped = _computes_the_transpose(call, b_as_rows, spec, recipe, sources)
    for role, operand, tensor, cast in () if swapped else (("a", spec.operands[0], data.a, spec.a),
                                                           ("b", spec.operands[1], b_as_rows, spec.b)):
        side = "A" if role == "a" else "B"
        want_dtype = FP8_DTYPES[cast.fp8]
        if tensor.dtype != want_dtype:
            name = str(tensor.dtype).replace("torch.", "")
            category = "fp8_dtype" if tensor.dtype in FP8_DTYPES.values() else "precision"
            out.append(Finding(call.step, spec.name, operand, "fp8_dtype", f"{side} ({operand}) is {name}; the "
                               f"{recipe.name} recipe casts it to {cast.fp8}", category))
            continue
        want_shape = tuple(sources.view(spec.name, role, "same").shape)
        if tuple(tensor.shape) != want_shape:
            out.append(Finding(call.step, spec.name, operand, "bytes", f"{side} ({operand}) has shape "
                               f"{list(tensor.shape)} where the {recipe.name} oracle's operand is "
                               f"{list(want_shape)}", "transpose" if tensor.dim() == 2 else "crash"))
            continue
        rows, inner = tensor.shape
        kind = call.scaling[0 if role == "a" else 1] if call.scaling else "?"
        scales = None if unit_form else _call_scales(kind, data.scale_a if role == "a" else data.scale_b, role,
                                                     rows, inner)
        values = tensor.detach().to(torch.float64).cpu()
        found = explain_operand(values, scales, cast, recipe, sources, spec.name, role)
        if found is not None and unit_scales and not unit_form and \
                explain_operand(values, None, cast, recipe, sources, spec.name, role) is None:
            scales_elsewhere = True  # the recipe's bytes with unit scales: the scales live outside the call
            continue
        if found is not None:
            operands_differ = True
            stage, category, message = found
            out.append(Finding(call.step, spec.name, operand, stage, f"{side} ({operand}): {message}", category))
    if scales_elsewhere and not operands_differ:  # the bytes are the recipe's, the call's scales are ones
        out.append(Finding(call.step, spec.name, "result", "unit_scales",
                           "the call's scales are all ones while its fp8 operands are the recipe's: the scales are "
                           "applied to the result after the GEMM (a second rounding), or not at all"))
    if call.use_fast_accum != spec.fast_accum:
        out.append(Finding(call.step, spec.name, "result", "fast_accum",
                           f"use_fast_accum={call.use_fast_accum} where the {recipe.name} recipe says "
                           f"{spec.fast_accum}", "accumulation"))
    return out


def _computes_the_transpose(call: ScaledMMCall, b_as_rows: torch.Tensor, spec: Gemm, recipe: Recipe,
                            sources: OperandSources) -> bool:
    """Whether the call computes the GEMM's transpose, B^T A^T: its A holds exactly the oracle's B
    and its B the oracle's A (fp8 values and scales, each as the recipe casts it). That is a
    legitimate formulation, not an operand mistake; the result comes back transposed, and what
    the implementation makes of that is judged on the result (its strides: the contract)."""
    data = call.data
    for call_role, tensor, scale, oracle_role, cast in (("a", data.a, data.scale_a, "b", spec.b),
                                                        ("b", b_as_rows, data.scale_b, "a", spec.a)):
        want = sources.view(spec.name, oracle_role, "same")
        if tensor.dim() != 2 or tensor.dtype != FP8_DTYPES[cast.fp8] or want is None \
                or tuple(tensor.shape) != tuple(want.shape):
            return False
        rows, inner = tensor.shape
        kind = call.scaling[0 if call_role == "a" else 1] if call.scaling else "?"
        scales = _call_scales(kind, scale, call_role, rows, inner)
        correct = quantize_mistaken(want, cast, recipe)
        if correct is None or scales is None or not _same(tensor.detach().to(torch.float64).cpu(),
                                                          correct.values.cpu()) \
                or not _same(scales, _expanded(correct.inv_scale.cpu(), rows, inner)):
            return False
    return True


def assign_calls(calls: Sequence[ScaledMMCall], step: int, recipe: Recipe | None = None,
                 sources: OperandSources | None = None) -> dict[str, list[ScaledMMCall]]:
    """The calls of one step by GEMM. A call whose shapes fit two GEMMs (M, K, N not distinct) goes
    to the one whose oracle it matches best (fewest differing stages; with no recipe: the first
    without a call yet, in the order the backward runs them)."""
    by_gemm: dict[str, list[ScaledMMCall]] = {g: [] for g in GEMMS}
    for call in (c for c in calls if c.step == step):
        options = [g for g in call.gemm.split("|") if g in by_gemm]
        free = [g for g in options if not by_gemm[g]] or options
        if len(free) > 1 and recipe is not None and sources is not None:
            free = sorted(free, key=lambda g: 99 if recipe.gemm(g).high_precision else
                          len(compare_call(call, recipe.gemm(g), recipe, sources)))
        if free:
            by_gemm[free[0]].append(call)
    return by_gemm


def resolve_calls(calls: Sequence[ScaledMMCall], steps: Sequence[StepData], recipe: Recipe,
                  case: Case) -> list[ScaledMMCall]:
    """The calls, each naming the one GEMM assign_calls gives it (the recorder names every GEMM a call's
    shapes fit: two where M, K, N are not distinct)."""
    resolved = list(calls)
    for step_index, step in enumerate(steps):
        sources = OperandSources(step, steps[step_index - 1] if step_index else None, strides_ignored(step, case))
        for gemm_name, recorded in assign_calls(calls, step_index, recipe, sources).items():
            for call in recorded:
                index = next(i for i, c in enumerate(calls) if c is call)
                resolved[index] = replace(call, gemm=gemm_name)
    return resolved


def call_findings(calls: Sequence[ScaledMMCall], steps: Sequence[StepData], recipe: Recipe,
                  case: Case) -> list[Finding]:
    """Every difference between the recorded calls and the recipe's, for every step of the case.
    GEMMs without a recorded call are not compared here (see diagnose_behaviour)."""
    findings: list[Finding] = []
    for step_index, step in enumerate(steps):
        sources = OperandSources(step, steps[step_index - 1] if step_index else None, strides_ignored(step, case))
        for gemm_name, recorded in assign_calls(calls, step_index, recipe, sources).items():
            spec = recipe.gemm(gemm_name)
            if spec.high_precision and recorded:
                findings.append(Finding(step_index, gemm_name, "call", "precision",
                                        f"an FP8 _scaled_mm call runs a GEMM the {recipe.name} recipe computes in "
                                        f"high precision", "precision"))
            elif recorded:
                findings += compare_call(recorded[0], spec, recipe, sources)
    return findings


# ---- what the implementation did with a GEMM's result ---------------------------------------------

def gemm_inverse_scales(step: StepData, gemm: str, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The recipe's inverse scales of a GEMM's A, one per row [rows, 1], and of its B, one per
    column [1, cols] (float64); None where scales vary along the inner dim (block scales) or the
    GEMM has none (high precision)."""
    spec = recipe.gemm(gemm)
    if spec.high_precision:
        return None
    K, N = step.input.shape[-1], step.weight.shape[0]
    a_hp, b_hp = oracles.operand_views(step.input.reshape(-1, K), step.weight, step.grad_output.reshape(-1, N))[gemm]
    try:
        a, b = (oracles.quantize(hp, cast, **oracles.scale_rounding(recipe)) for hp, cast in ((a_hp, spec.a),
                                                                                               (b_hp, spec.b)))
    except RuntimeError:
        return None
    if a.inv_scale.shape[1] != 1 or b.inv_scale.shape[1] != 1:
        return None
    rows, cols = a_hp.shape[0], b_hp.shape[0]
    a_rows = a.inv_scale.cpu().repeat_interleave(a.tile[0], dim=0).expand(rows, 1)
    b_cols = b.inv_scale.cpu().repeat_interleave(b.tile[0], dim=0).expand(cols, 1).t()
    return a_rows, b_cols


def explain_result(got: torch.Tensor, exact: torch.Tensor, case: Case, tensor: str, recipe: Recipe, *,
                   bias: torch.Tensor | None = None, scales=None) -> Explanation | None:
    """The Explanation when `got` is the exact GEMM result `exact` (float64) transformed after the
    GEMM (rescaled, transposed, reshaped, rounded through another dtype, a bias twice or dropped: the
    result mistakes of parity.mistakes); None when no such transform reproduces it. With the GEMM's
    per-row and per-column inverse `scales` (gemm_inverse_scales), also a scale misapplied to the
    result, which blames the operand whose scale it is."""
    got64 = got.detach().to(torch.float64).cpu().reshape(-1, got.shape[-1])
    exact = exact.detach().to(torch.float64).cpu()
    b = None if bias is None else bias.detach().to(torch.float64).cpu()
    chain = oracles.rounding_chain(case, tensor, recipe)

    def rounded(value: torch.Tensor) -> torch.Tensor:
        for dtype in chain:
            value = value.to(dtype)
        return value.to(torch.float64)

    def reproduces(mistake: ResultMistake, value: torch.Tensor) -> bool:  # same NaN and Inf, the rest within MATCH_DB
        value = rounded(value)
        if mistake.bit_exact:
            return _same(value.reshape(got64.shape), got64)
        return value.shape == got64.shape and _closeness(got64, value) >= MATCH_DB
    for mistake in result_mistakes(got, exact, case, tensor, recipe, has_bias=b is not None, scales=scales):
        value = mistake.transform(exact, b)
        if value is not None and reproduces(mistake, value):
            return mistake.explanation
    if bool((~torch.isfinite(got64) & torch.isfinite(rounded(exact if b is None else exact + b))).any()):
        return Explanation(BugClass.SATURATION, "the result overflows its dtype where the exact result does not")
    return None


# ---- by behaviour: the same hypotheses, end to end ------------------------------------------------

@dataclass(frozen=True)
class Match:
    gemm: str
    operand: str  # input | weight | grad_output | result
    category: str
    description: str
    db: float  # closeness of the hypothesis to the implementation's result
    correct_db: float  # closeness of the correct emulation

    @property
    def is_mistake(self) -> bool:
        """A hypothesis that matches (>= MATCH_DB) and is clearly closer than the correct emulation (ties go
        to the correct one), not the accumulation-level reading of a result near the exact one."""
        return self.db >= MATCH_DB and self.db >= self.correct_db + MARGIN_DB and self.correct_db < math.inf


def _closeness(got: torch.Tensor, want: torch.Tensor) -> float:
    """SQNR of `got` against a hypothesis's `want`, where non-finite values must match exactly: a
    NaN or Inf that one has and the other has not rules the hypothesis out (-inf), and matching
    ones are left out of the SQNR (all of them matching: inf). An amax without its floor gives
    NaN on an all-zero tile; only a hypothesis that makes those NaN may explain it."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    got_bad, want_bad = ~got.isfinite(), ~want.isfinite()
    if not torch.equal(got_bad, want_bad) or not torch.equal(got[got_bad].nan_to_num(nan=0.0),
                                                             want[want_bad].nan_to_num(nan=0.0)):
        return -math.inf
    keep = ~got_bad
    return sqnr_db(got[keep], want[keep]) if bool(keep.any()) else math.inf


def diagnose_behaviour(got: dict[str, torch.Tensor], step_index: int, steps: Sequence[StepData], case: Case,
                       recipe: Recipe, gemms: Sequence[str], *, bias: torch.Tensor | None = None,
                       strided: StepData | None = None) -> list[Match]:
    """For each GEMM in `gemms` (its result in `got`), the hypothesis (one operand's mistake, or a
    transform of the result) whose end-to-end emulation is closest to the implementation, when it
    matches (>= MATCH_DB and >= MARGIN_DB closer than the correct emulation)."""
    step = steps[step_index]
    sources = OperandSources(step, steps[step_index - 1] if step_index else None, strided)
    out = []
    for gemm_name in gemms:
        spec = recipe.gemm(gemm_name)
        target = got[gemm_name]

        def closeness(value: torch.Tensor, target=target, gemm_name=gemm_name) -> float:
            value = value.cpu()
            if gemm_name == "output" and bias is not None:
                value = value + bias.to(torch.float64).cpu()
            want = oracles.rounded_like_result(value, case, gemm_name, recipe).reshape(target.shape)
            return _closeness(target.cpu(), want)
        a_hp, b_hp = sources.view(gemm_name, "a", "same"), sources.view(gemm_name, "b", "same")
        qa, qb = quantize_mistaken(a_hp, spec.a, recipe), quantize_mistaken(b_hp, spec.b, recipe)
        correct_value = oracles.gemm(qa, qb)
        correct_db = closeness(correct_value)
        scored: list[tuple[float, str, str, str]] = []

        def score_mistakes(role: str, operand: str, cast: Cast, hypotheses: Sequence[Hypothesis],
                           gemm_name=gemm_name, a_hp=a_hp, b_hp=b_hp, qa=qa, qb=qb, scored=scored, closeness=closeness):
            """Each mistake on one operand, the other as the recipe casts it: how near the result it comes."""
            shape = (a_hp if role == "a" else b_hp).shape
            for hypothesis in hypotheses:
                q = sources.quantized(hypothesis, gemm_name, role, cast, recipe, shape)
                if q is not None:
                    value = oracles.gemm(q, qb) if role == "a" else oracles.gemm(qa, q)
                    scored.append((closeness(value), operand, hypothesis.category, hypothesis.description))
        if spec.high_precision:  # an operand taken from an fp8 copy where the recipe keeps it in high precision
            for role, operand in (("a", spec.operands[0]), ("b", spec.operands[1])):
                for cast in {c for _, c in recipe.casts_of(operand) if c.fp8 is not None}:
                    hp = a_hp if role == "a" else b_hp
                    rows, inner = hp.shape
                    for tile in {cast.scaling.tile(rows, inner), (1, inner), (rows, 1), (rows, inner)}:
                        q = quantize_mistaken(hp, cast, recipe, scaled_over(tile))
                        if q is None:
                            continue
                        fp8_copy = Quantized(q.dequantized(), hp.new_ones((1, 1), dtype=torch.float64),
                                             (rows, inner), None)
                        value = oracles.gemm(fp8_copy, qb) if role == "a" else oracles.gemm(qa, fp8_copy)
                        scored.append((closeness(value), operand, "precision",
                                       f"{operand} taken from its {cast.fp8} copy where the recipe computes this "
                                       f"GEMM in high precision"))
            # its high-precision operands taken from elsewhere, or rounded to a narrower dtype first
            not_cast = Cast(Scaling.NONE, None)
            for role, operand in (("a", spec.operands[0]), ("b", spec.operands[1])):
                score_mistakes(role, operand, not_cast, high_precision_hypotheses())
            # the whole GEMM in a narrower dtype than the recipe's: both operands and the result rounded to it
            chain = ", ".join(str(d).replace("torch.", "") for d in oracles.rounding_chain(case, gemm_name, recipe))
            # (operands already in that dtype stay as they are: the result's rounding alone then tells)
            for name, dtype in NARROWER:
                narrow = [quantize_mistaken(hp, not_cast, recipe, rounded_before_cast(dtype)) for hp in (a_hp, b_hp)]
                value = oracles.gemm(narrow[0] or qa, narrow[1] or qb).to(dtype).to(torch.float64)
                scored.append((closeness(value), "result", "precision", f"computed in {name} (operands and "
                               f"result) where the recipe's result is rounded to {chain} only"))
            # computed in a wider precision than the recipe's: nearer the exact product than its roundings allow
            wider = _closeness(target.cpu(), correct_value.reshape(target.shape).to(target.dtype).cpu()) \
                if bias is None or gemm_name != "output" else -math.inf
            scored.append((wider, "result", "precision", f"computed in {str(target.dtype).replace('torch.', '')} "
                           f"without the recipe's rounding to {chain}"))
        else:
            for role, operand, cast in (("a", spec.operands[0], spec.a), ("b", spec.operands[1], spec.b)):
                score_mistakes(role, operand, cast, operand_hypotheses(cast, recipe, *(a_hp if role == "a"
                                                                                      else b_hp).shape))
            # one cast routine shared by both operands: the same mistake in both
            of_b = {h.description: h for h in operand_hypotheses(spec.b, recipe, *b_hp.shape)}
            for hypothesis in operand_hypotheses(spec.a, recipe, *a_hp.shape):
                twin = of_b.get(hypothesis.description)
                if twin is None or hypothesis.source != "same" or twin.source != "same" or hypothesis.transform is None:
                    continue
                both = (quantize_mistaken(a_hp, spec.a, recipe, hypothesis),
                        quantize_mistaken(b_hp, spec.b, recipe, twin))
                if None not in both:
                    scored.append((closeness(oracles.gemm(*both)), spec.operands[0], hypothesis.category,
                                   f"{hypothesis.description}, in both operands"))
        explained = explain_result(target, correct_value, case, gemm_name, recipe,
                                   bias=bias if gemm_name == "output" else None,
                                   scales=gemm_inverse_scales(steps[step_index], gemm_name, recipe))
        if explained is not None:
            scored.append((MATCH_DB, explained.operand, explained.category, explained.description))
        if not scored:
            continue
        db, operand, category, description = max(scored, key=lambda s: s[0])
        best = Match(gemm_name, operand, category, description, db, correct_db)
        if best.is_mistake:
            out.append(best)
        elif correct_db >= ACCUMULATION_DB:  # the operands must be right: only the sums differ
            out.append(Match(gemm_name, "result", "accumulation", f"the exact result summed or rounded less "
                             f"precisely ({correct_db:.1f} dB from it, where operand mistakes leave < "
                             f"{ACCUMULATION_DB:.0f} dB)", correct_db, correct_db))
    return out


def high_precision_closeness(got: dict[str, torch.Tensor], step: StepData, case: Case,
                             recipe: Recipe) -> tuple[float, float]:
    """(SQNR of the results against the exact high-precision product, against the recipe's exact
    FP8 emulation), worst over the GEMMs: an 'FP8' implementation nearer the first is not FP8."""
    exact = oracles.emulate_linear(step.input, step.weight, step.grad_output, recipe)
    K, N = step.input.shape[-1], step.weight.shape[0]
    x, w, go = (t.to(torch.float64) for t in (step.input.reshape(-1, K), step.weight, step.grad_output.reshape(-1, N)))
    plain = {"output": x @ w.t(), "grad_input": go @ w, "grad_weight": go.t() @ x}
    hp, fp8 = math.inf, math.inf
    for name, value in got.items():
        hp = min(hp, compare(value.double().cpu(), plain[name].reshape(value.shape))["sqnr_db"])
        fp8 = min(fp8, compare(value.double().cpu(), getattr(exact, name).reshape(value.shape))["sqnr_db"])
    return hp, fp8

