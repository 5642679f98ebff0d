"""What each recorded _scaled_mm call was handed, against what its recipe's oracle hands the same GEMM.

For every FP8 GEMM of a recipe the exact oracle (parity.oracles) knows the operands the GEMM
must receive: the fp8 values of A and B and their inverse scales. A recorded _scaled_mm call
(parity.contract, with its tensors kept) is compared with that, stage by stage, per operand:

    fp8_dtype   the operand's fp8 format
    scale       the inverse scale of every element (tensor, row, tile or block scales alike)
    bytes       the fp8 values (logical values: a transposed copy is the same operand)
    fast_accum  the use_fast_accum flag (a CPU ignores it; the H100 does not)

The first stage that differs names the operand and, through the hypothesis of parity.mistakes that
reproduces the recorded operand exactly, the bug class; each difference is a StageFinding. What the
implementation does with a GEMM's result, and GEMMs without a call, are parity.diagnose's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence

import torch

from parity.cases import Case
from parity.contract import ScaledMMCall
from parity.data import StepData
from parity.exact_reproduction import BitMatch
from parity.findings import Finding
from parity.mistakes import Hypothesis, operand_hypotheses, quantize_mistaken
from parity.operand_sources import OperandSources, strides_ignored
from parity import mx
from parity.recipes import BLOCK, FP8_DTYPES, FP8_FORMATS, GEMMS, MX_BLOCK, NVFP4_BLOCK, Cast, Gemm, Recipe, Scaling
from parity.vocabulary import BugClass, Kind, Operand, Stage, Tensor


@dataclass(frozen=True, kw_only=True)
class StageFinding(Finding):
    """One difference between what a GEMM got and what its recipe's oracle gives it, at one stage
    (`category`: the bug class the stage's explanation names; None when unexplained)."""

    kind: Kind = Kind.STAGE
    message: str
    hypothesis: Hypothesis | None = None  # the mistake that explains it, when one of the space does
    problems: tuple = ()  # the contract problems it is (parity.contract.ContractProblem), at the contract stage
    # at the result stage, where the GEMM's bits were computed again: how many its mistake reproduced
    reproduced: BitMatch | None = None

    def __str__(self) -> str:
        return f"{self.gemm} GEMM (step {self.step}): {self.message}"

    @property
    def sentence(self) -> str:
        return self.message


def stage_finding(step: int, gemm: str, operand: str, stage: str, message: str, category: str | None = None,
                  **more) -> StageFinding:
    """A StageFinding from the names the diagnosis works with (category "" or None: unexplained)."""
    return StageFinding(step=step, tensor=Tensor(gemm), operand=Operand(operand), stage=Stage(stage),
                        category=BugClass(category) if category else None, message=message, **more)


class OperandExplanation(NamedTuple):
    """What explain_operand says of an operand: the first stage that differs, the bug class of the
    mistake that explains it ("" when none does), the sentence, and that mistake."""

    stage: str
    category: str
    message: str
    hypothesis: Hypothesis | None = None


# ---- one operand of one recorded call ------------------------------------------------------------

def _expanded(scale: torch.Tensor, rows: int, inner: int) -> torch.Tensor:
    """Scales [rows / r, inner / i] repeated to one per element [rows, inner]."""
    return scale.repeat_interleave(rows // scale.shape[0], 0).repeat_interleave(inner // scale.shape[1], 1)


def _mx_call_scales(kind: str, scale: torch.Tensor, rows: int, inner: int, swizzled: bool,
                    global_: torch.Tensor | None) -> torch.Tensor:
    """The decode scale of each element from a microscaled call's block scales (read swizzled or as the
    [rows, inner / block] grid, as the call declares them) and, for NVFP4, its per-tensor scale."""
    block = MX_BLOCK if kind == "BlockWise1x32" else NVFP4_BLOCK
    blocks = -(-inner // block)
    raw = scale.detach().cpu()
    grid = mx.unswizzled(raw, rows, blocks) if swizzled else raw.reshape(rows, blocks)
    per_block = mx.e8m0_values(grid) if grid.dtype == torch.float8_e8m0fnu else grid.to(torch.float64)
    if global_ is not None:
        per_block = per_block * global_.detach().cpu().to(torch.float64).reshape(())
    return _expanded(per_block, rows, blocks * block)[:, :inner]


def _call_scales(kind: str, scale: torch.Tensor, role: str, rows: int, inner: int, *, swizzled: bool = False,
                 global_: torch.Tensor | None = None) -> torch.Tensor | None:
    """The inverse scale of each element of an operand laid out [rows, inner] (A, or B.T), from a
    recorded call's scale tensor of scaling `kind`; None when the layout is not understood."""
    if kind in ("BlockWise1x32", "BlockWise1x16"):
        try:
            return _mx_call_scales(kind, scale, rows, inner, swizzled, global_)
        except (RuntimeError, ValueError):  # a size the layout does not allow: the contract rules report it
            return None
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


def _same_values(got: torch.Tensor, want: torch.Tensor, want_scales: torch.Tensor) -> bool:
    """The fp8 values equal wherever they mean anything: an element under a NaN scale decodes to NaN whatever
    its byte (OCP MX: a block whose scale is NaN is NaN), so those bytes are not compared."""
    return _same(torch.where(want_scales.isnan(), want, got), want)


def decoded_operand(tensor: torch.Tensor) -> torch.Tensor:
    """A recorded operand's values (float64, on the CPU): fp8 converted, packed fp4 unpacked along its last
    dim (call it on A, or on B.T: the contraction dim last)."""
    if tensor.dtype == torch.float4_e2m1fn_x2:
        return mx.unpack_e2m1(tensor.detach().cpu())
    return tensor.detach().to(torch.float64).cpu()


# Scales that agree to this relative difference are the same scales computed in another order: a scale
# handed as 1 / (its inverse) instead of itself, say, is two float32 roundings (each at most 2^-24 relative)
# from the scale a mistake's emulation computes, and is that mistake. Two float32 ulps (2^-22).
SCALE_ROUNDING = 2.0 ** -22


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Scales equal up to SCALE_ROUNDING (the same NaN and infinities)."""
    if a.shape != b.shape or not torch.equal(a.isfinite(), b.isfinite()):
        return False
    finite = a.isfinite()
    return _same(a[~finite], b[~finite]) and bool(((a[finite] - b[finite]).abs() <= SCALE_ROUNDING *
                                                    b[finite].abs()).all())


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, tuple, float, float]:
    differ = ~((got == want) | (got.isnan() & want.isnan()))
    count = int(differ.sum())
    if not count:
        return 0, (), 0.0, 0.0
    index = tuple(int(i) for i in differ.nonzero()[0])
    return count, index, float(got[index]), float(want[index])


def explain_operand(values: torch.Tensor, scales: torch.Tensor | None, cast: Cast, recipe: Recipe,
                    sources: OperandSources, gemm: str, role: str,
                    partner: Cast | None = None) -> OperandExplanation | None:
    """(stage, category, message, hypothesis) for an operand a GEMM got (fp8 values and per-element inverse
    scales, laid out [rows, inner]) that is not the recipe's, or None when it is. `partner`: the cast of the
    GEMM's other operand (its scales handed over for these are a finding of their own)."""
    rows, inner = values.shape
    correct = quantize_mistaken(sources.view(gemm, role, "same"), cast, recipe)
    want_scales = _expanded(correct.inv_scale.cpu(), rows, inner)
    values_ok = _same_values(values, correct.values.cpu(), want_scales)
    scales_ok = scales is not None and _same(scales, want_scales)
    if values_ok and (scales_ok or scales is None):  # no scales to compare: the values decide
        return None
    values_only = None  # the first mistake whose fp8 values these are, with the recipe's scales handed over
    # the first whose values these are and whose scales these are up to their rounding (SCALE_ROUNDING), where
    # the recipe's scales are not
    rounded_alike = None
    scales_far = scales is not None and not _near(scales, want_scales)
    for hypothesis in operand_hypotheses(cast, recipe, rows, inner):
        if hypothesis.keeps_high_precision:  # these values are fp8
            continue
        q = sources.quantized(hypothesis, gemm, role, cast, recipe, (rows, inner))
        # the values came in the recipe's format (compare_call checks it first): a mistake that ends in
        # another format is not theirs, even where its values coincide with theirs
        if q is None or q.fp8_dtype != cast.dtype:
            continue
        its_scales = _expanded(q.inv_scale.cpu(), rows, inner)
        if not _same_values(values, q.values.cpu(), its_scales):
            continue
        if scales is None or _same(scales, its_scales):
            return _explained_by(hypothesis)
        values_only = values_only or hypothesis
        if rounded_alike is None and scales_far and _near(scales, its_scales):
            rounded_alike = hypothesis
    if rounded_alike is not None:
        return _explained_by(rounded_alike)
    if scales is None:
        return OperandExplanation("scale", "scale", "its scale tensor cannot be read as the recipe's scales (see the "
                                           "contract rules)")
    if scales_ok and values_only is not None:
        return OperandExplanation("bytes", values_only.category, f"its fp8 values are those of "
                                  f"{values_only.description}, while the GEMM is handed the recipe's scales",
                                  values_only)
    microscaled = cast.scaling in (Scaling.MX_1X32, Scaling.NV_1X16)
    if not scales_ok and values_ok and microscaled:  # the right elements: so the cast's scales were right too
        if partner is not None and _partners_scales(scales, tuple(correct.inv_scale.shape), sources, gemm, role,
                                                    partner, recipe):
            other = "B" if role == "a" else "A"
            return OperandExplanation("scale", BugClass.SCALE.value, f"its elements are the oracle's and its scales "
                                      f"are the oracle's scales of the GEMM's other operand ({other}): the scales of "
                                      f"A and B handed over swapped")
        misplaced = _misplaced_scales(scales, correct.inv_scale.cpu())
        if misplaced:
            return OperandExplanation("scale", BugClass.LAYOUT.value, misplaced)
    if scales_ok and microscaled:
        saturated = _differs_where_saturated(values, correct.values.cpu(), want_scales, FP8_FORMATS[cast.fp8])
        if saturated:
            return OperandExplanation("bytes", BugClass.SATURATION.value, saturated)
    if not scales_ok:
        count, index, got, want = _first_difference(scales, want_scales)
        return OperandExplanation("scale", "", f"its inverse scale differs from the oracle's for {count} of "
                                  f"{scales.numel()} elements (first at {list(index)}: {got:.6g}, oracle {want:.6g}, "
                                  f"ratio {got / want if want else float('nan'):.6g}); no single mistake reproduces it")
    count, index, got, want = _first_difference(torch.where(want_scales.isnan(), correct.values.cpu(), values),
                                                correct.values.cpu())
    said = (f"its scales are the recipe's but its fp8 values differ in {count} of {values.numel()} elements (first "
            f"at {list(index)}: {got:g}, oracle {want:g})")
    if microscaled and scales is not None:  # the MX sets' convention: what of a block's bytes is wrong names it
        if _same(*(torch.sort(torch.nan_to_num(t, nan=math.inf).reshape(-1)).values
                   for t in (values, correct.values.cpu()))):
            return OperandExplanation("bytes", BugClass.LAYOUT.value, f"{said}: the oracle's elements, every one, "
                                      f"at other places (no single mistake reproduces the order)")
        return OperandExplanation("bytes", BugClass.SCALE.value, f"{said}: its elements are encoded otherwise than "
                                  f"the contract's rounding of the values by their right scales (no single mistake "
                                  f"reproduces them)")
    return OperandExplanation("bytes", "", f"{said}; no single mistake reproduces them")


def _partners_scales(scales: torch.Tensor, grid_shape: tuple[int, int], sources: OperandSources, gemm: str,
                     role: str, partner: Cast, recipe: Recipe) -> bool:
    """Whether the block scales an operand's GEMM reads (its grid `grid_shape`, read from a swizzled buffer) are
    the oracle's scales of the GEMM's other operand, swizzled as that operand's and read as this one's: the two
    scale tensors handed over swapped (possible where their padded sizes agree)."""
    other = quantize_mistaken(sources.view(gemm, "b" if role == "a" else "a", "same"), partner, recipe)
    if other is None or other.inv_scale.dim() != 2:
        return False
    other_grid = other.inv_scale.cpu().to(torch.float64)
    if math.prod(mx.padded_scale_shape(*other_grid.shape)) != math.prod(mx.padded_scale_shape(*grid_shape)):
        return False
    read_as_own = mx.unswizzled(mx.swizzled(other_grid, mx.PADDING_DECODED.get(partner.dtype, 0.0)), *grid_shape)
    rows, inner = scales.shape
    return _same(scales, _expanded(read_as_own, rows, grid_shape[1] * (inner // grid_shape[1]))[:, :inner])


def _misplaced_scales(scales: torch.Tensor, want_grid: torch.Tensor) -> str:
    """Where an operand's elements are the oracle's (so its cast computed the right block scales) but the
    scales its GEMM reads are not: if every scale read is one of the oracle's for this operand or a padding
    byte's value, the right scales were stored at the wrong places (a swizzle, a padding offset, a store
    never made): a layout mistake of the scale tensor. The sentence that says so, or "" where some scale read
    is none of those, or is read more often than the oracle has it."""
    rows, blocks = want_grid.shape
    block = scales.shape[1] // blocks
    got_grid = scales[:, ::block][:, :blocks].to(torch.float64)
    want = want_grid.to(torch.float64)
    padding_values = torch.tensor(list(mx.PADDING_DECODED.values()), dtype=torch.float64)
    read = got_grid.reshape(-1)
    if bool(read.isnan().any()):
        return ""
    # each scale value read at most as often as the oracle has it (a padding byte's value any number of times):
    # moved scales, not scales by another rule that happen to equal other blocks' (powers of two repeat)
    values, counts = torch.unique(read[~torch.isin(read, padding_values)], return_counts=True)
    want_values, want_counts = torch.unique(want.reshape(-1), return_counts=True)
    available = dict(zip(want_values.tolist(), want_counts.tolist()))
    if any(count > available.get(value, 0) for value, count in zip(values.tolist(), counts.tolist())):
        return ""
    wrong = got_grid != want
    count = int(wrong.sum())
    padding = int((wrong & torch.isin(got_grid, padding_values)).sum())
    r, b = (int(i) for i in wrong.nonzero()[0])
    return (f"its elements are the oracle's, yet {count} of {rows * blocks} block scales the GEMM reads are at "
            f"the wrong place (first block [{r}, {b}]: {float(got_grid[r, b]):.6g}, oracle {float(want[r, b]):.6g}); "
            f"every scale read is one of the oracle's for this operand, no more often than the oracle has it, or a "
            f"padding byte ({padding} are): the right scales stored at the wrong places of the scale tensor")


def _differs_where_saturated(values: torch.Tensor, want: torch.Tensor, want_scales: torch.Tensor, fmt) -> str:
    """Where an operand's scales are the oracle's and its elements differ only at elements the oracle's cast
    saturates to +-max: the sentence that says so (a saturation mistake), else ""."""
    meaningful = ~want_scales.isnan()
    differ = meaningful & ~((values == want) | (values.isnan() & want.isnan()))
    count = int(differ.sum())
    if not count or not bool((want[differ].abs() == fmt.max).all()):
        return ""
    index = tuple(int(i) for i in differ.nonzero()[0])
    saturated = int((meaningful & (want.abs() == fmt.max)).sum())
    return (f"its elements differ from the oracle's in {count} of {values.numel()} places, each one the oracle's "
            f"cast saturates to +-{fmt.max:g} ({saturated} elements are at +-{fmt.max:g}; first at {list(index)}: "
            f"{float(values[index]):g}, oracle {float(want[index]):g}): saturation skipped or done another way")


def _explained_by(hypothesis: Hypothesis) -> OperandExplanation:
    stage = "scale" if hypothesis.category == "scale" or hypothesis.amax_source != "same" else "bytes"
    return OperandExplanation(stage, hypothesis.category, hypothesis.description, hypothesis)


def compare_call(call: ScaledMMCall, spec: Gemm, recipe: Recipe, sources: OperandSources) -> list[StageFinding]:
    """How a recorded call for the GEMM `spec` differs from the recipe's, stage by stage."""
    out: list[StageFinding] = []
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
            out.append(stage_finding(call.step, spec.name, operand, "fp8_dtype", f"{side} ({operand}) is {name}; "
                                     f"the {recipe.name} recipe casts it to {cast.fp8}", category))
            continue
        want_shape = tuple(sources.view(spec.name, role, "same").shape)
        values = decoded_operand(tensor)
        if tuple(values.shape) != want_shape:
            out.append(stage_finding(call.step, spec.name, operand, "bytes", f"{side} ({operand}) has shape "
                                     f"{list(values.shape)} where the {recipe.name} oracle's operand is "
                                     f"{list(want_shape)}", "transpose" if tensor.dim() == 2 else "crash"))
            continue
        rows, inner = values.shape
        scales = None if unit_form else _recorded_scales(call, role, rows, inner)
        found = explain_operand(values, scales, cast, recipe, sources, spec.name, role,
                                partner=spec.b if role == "a" else spec.a)
        if found is not None and unit_scales and not unit_form and \
                explain_operand(values, None, cast, recipe, sources, spec.name, role) is None:
            scales_elsewhere = True  # the recipe's bytes with unit scales: the scales live outside the call
            continue
        if found is not None:
            operands_differ = True
            out.append(stage_finding(call.step, spec.name, operand, found.stage, f"{side} ({operand}): {found.message}",
                                     found.category, hypothesis=found.hypothesis))
    if scales_elsewhere and not operands_differ:  # the bytes are the recipe's, the call's scales are ones
        out.append(stage_finding(call.step, spec.name, "result", "unit_scales",
                                 "the call's scales are all ones while its fp8 operands are the recipe's: the scales "
                                 "are applied to the result after the GEMM (a second rounding), or not at all"))
    if call.use_fast_accum != spec.fast_accum:
        out.append(stage_finding(call.step, spec.name, "result", "fast_accum",
                                 f"use_fast_accum={call.use_fast_accum} where the {recipe.name} recipe says "
                                 f"{spec.fast_accum}", "accumulation"))
    return out


def _recorded_scales(call: ScaledMMCall, role: str, rows: int, inner: int) -> torch.Tensor | None:
    """The per-element inverse scales of the call's operand `role` (a, or b as B.T [rows, inner])."""
    data = call.data
    kind = call.scaling[0 if role == "a" else 1] if call.scaling else "?"
    swizzle = call.swizzle[0 if role == "a" else 1] if call.swizzle else "NO_SWIZZLE"
    return _call_scales(kind, data.scale_a if role == "a" else data.scale_b, role, rows, inner,
                        swizzled=swizzle == "SWIZZLE_32_4_4", global_=data.global_a if role == "a" else data.global_b)


def _computes_the_transpose(call: ScaledMMCall, b_as_rows: torch.Tensor, spec: Gemm, recipe: Recipe,
                            sources: OperandSources) -> bool:
    """Whether the call computes the GEMM's transpose, B^T A^T: its A holds exactly the oracle's B
    and its B the oracle's A (fp8 values and scales, each as the recipe casts it). That is a
    legitimate formulation, not an operand mistake; the result comes back transposed, and what
    the implementation makes of that is judged on the result (its strides: the contract)."""
    data = call.data
    for call_role, tensor, oracle_role, cast in (("a", data.a, "b", spec.b), ("b", b_as_rows, "a", spec.a)):
        want = sources.view(spec.name, oracle_role, "same")
        if tensor.dim() != 2 or tensor.dtype != FP8_DTYPES[cast.fp8] or want is None:
            return False
        values = decoded_operand(tensor)
        if tuple(values.shape) != tuple(want.shape):
            return False
        rows, inner = values.shape
        scales = _recorded_scales(call, call_role, rows, inner)
        correct = quantize_mistaken(want, cast, recipe)
        if correct is None or scales is None:
            return False
        want_scales = _expanded(correct.inv_scale.cpu(), rows, inner)
        if not _same_values(values, correct.values.cpu(), want_scales) or not _same(scales, want_scales):
            return False
    return True


def assign_calls(calls: Sequence[ScaledMMCall], step: int, recipe: Recipe | None = None,
                 sources: OperandSources | None = None) -> dict[str, list[ScaledMMCall]]:
    """The calls of one step by GEMM. A call whose shapes fit two GEMMs (M, K, N not distinct) goes
    to the one whose oracle it matches best (fewest differing stages; with no recipe: the first
    without a call yet, in the order the backward runs them)."""
    by_gemm: dict[str, list[ScaledMMCall]] = {g: [] for g in GEMMS}
    for call in (c for c in calls if c.step == step):
        options = [g for g in call.gemms if g in by_gemm]
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
                resolved[index] = replace(call, gemms=(gemm_name,))
    return resolved


def call_findings(calls: Sequence[ScaledMMCall], steps: Sequence[StepData], recipe: Recipe,
                  case: Case) -> list[StageFinding]:
    """Every difference between the recorded calls and the recipe's, for every step of the case; first,
    where the calls are exactly another recipe's (recipe_finding). GEMMs without a recorded call are not
    compared here (see diagnose_behaviour)."""
    findings = _findings_of(calls, steps, recipe, case)
    implemented = recipe_finding(findings, calls, steps, recipe, case)
    return findings if implemented is None else [implemented, *findings]


# What a recipe's GEMM differs in from another's, in the order a reader looks: the class it names
_SPEC_DIFFERENCES = ((lambda g: g.high_precision, BugClass.PRECISION), (lambda g: g.kind, BugClass.SCALE),
                     (lambda g: (g.a.fp8, g.b.fp8), BugClass.FP8_DTYPE),
                     (lambda g: g.fast_accum, BugClass.ACCUMULATION))


def recipe_finding(findings: Sequence[StageFinding], calls: Sequence[ScaledMMCall], steps: Sequence[StepData],
                   recipe: Recipe, case: Case) -> StageFinding | None:
    """Where the calls differ from `recipe`'s in a way no single mistake explains, and every one of them
    is exactly another FP8 recipe's (fp8 formats, scales, values, flags): that recipe is the one the
    layer implements, said first (a tensorwise layer checked with --recipe rowwise differs in every
    scale, and no mistake of the rowwise cast reproduces tensorwise scales). Its class is what the two
    recipes first differ in (a GEMM in high precision, the scaling, the formats, fast accumulation)."""
    if not calls or not any(f.category is None for f in findings):
        return None
    from parity.recipes import RECIPES  # noqa: PLC0415 - the table of every recipe, read here only
    for other in RECIPES.values():
        if other is recipe or not other.is_fp8 or other.unsupported(case.M, case.K, case.N):
            continue
        try:
            if _findings_of(calls, steps, other, case):
                continue
        except (RuntimeError, ValueError, AttributeError):  # a call this recipe's oracle cannot take
            continue
        # recipes whose GEMMs are alike differ in how a scale is rounded (mxfp8 and mxfp8_floor): a scale
        category = next((cls for read, cls in _SPEC_DIFFERENCES for g in GEMMS
                         if read(recipe.gemm(g)) != read(other.gemm(g))), BugClass.SCALE)
        first = min(findings, key=lambda f: (f.step, GEMMS.index(f.gemm) if f.gemm in GEMMS else 9))
        return stage_finding(first.step, first.gemm, "call", "recipe",
                             f"every recorded call is exactly the {other.name} recipe's (fp8 formats, scales, values "
                             f"and flags), not the {recipe.name} recipe's: the layer implements {other.name}; check it "
                             f"with --recipe {other.name}", category)
    return None


def _findings_of(calls: Sequence[ScaledMMCall], steps: Sequence[StepData], recipe: Recipe,
                 case: Case) -> list[StageFinding]:
    """How the recorded calls differ from `recipe`'s oracle, GEMM by GEMM and step by step."""
    findings: list[StageFinding] = []
    for step_index, step in enumerate(steps):
        sources = OperandSources(step, steps[step_index - 1] if step_index else None, strides_ignored(step, case))
        for gemm_name, recorded in assign_calls(calls, step_index, recipe, sources).items():
            spec = recipe.gemm(gemm_name)
            if spec.high_precision and recorded:
                findings.append(stage_finding(step_index, gemm_name, "call", "precision",
                                              f"an FP8 _scaled_mm call runs a GEMM the {recipe.name} recipe computes "
                                              f"in high precision", "precision"))
            elif recorded:
                findings += compare_call(recorded[0], spec, recipe, sources)
    return findings


