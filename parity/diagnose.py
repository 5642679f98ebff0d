"""The candidate's recorded GEMM calls against the calls its recipe's oracle expects, stage by stage.

For every FP8 GEMM of a recipe the exact oracle (parity.oracles) knows which operands the GEMM
must be handed: the fp8 bytes of A and B and their inverse scales. A recorded _scaled_mm call
(parity.contract, with its tensors kept) is compared with that, bitwise and per operand:

    fp8_dtype   the operand's fp8 format
    bytes       the fp8 values (logical values: a transposed copy is the same operand)
    scale       the inverse scale of every element (tensor, row, tile or block scales alike)
    fast_accum  the use_fast_accum flag (a CPU ignores it; the H100 does not)

and a GEMM the recipe runs in high precision must not be an FP8 call. A difference names the
GEMM, the operand and the stage; agreement everywhere means any remaining difference in the
results lies in accumulation or in what happens to the result after the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from parity.contract import ScaledMMCall
from parity.oracles import EmulatedStep, Quantized
from parity.recipes import GEMMS, Gemm, Recipe

BLOCK = 128


@dataclass(frozen=True)
class Finding:
    """One difference between a recorded call and the oracle's (or a missing / extra call)."""

    step: int
    gemm: str  # output | grad_input | grad_weight
    operand: str  # input | weight | grad_output | call
    stage: str  # fp8_dtype | bytes | scale | fast_accum | precision
    message: str

    def __str__(self) -> str:
        return f"{self.gemm} GEMM (step {self.step}): {self.message}"


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


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, tuple, float, float]:
    differ = ~((got == want) | (got.isnan() & want.isnan()))
    count = int(differ.sum())
    if not count:
        return 0, (), 0.0, 0.0
    index = tuple(int(i) for i in differ.nonzero()[0])
    return count, index, float(got[index]), float(want[index])


def compare_call(call: ScaledMMCall, spec: Gemm, qa: Quantized, qb: Quantized, recipe: Recipe) -> list[Finding]:
    """How a recorded call for the GEMM `spec` differs from the oracle's operands (qa = A, qb = B.T)."""
    out: list[Finding] = []
    data = call.data
    if data is None:
        return out
    # torchao's form of an axis-scaled GEMM without fast accumulation: unit scales in the call,
    # the row and column scales multiplied into the result afterwards (checked by the results)
    unit_form = (recipe.unit_scales_without_fast_accum and spec.kind == "RowWise" and not spec.fast_accum
                 and data.scale_a.numel() == 1 and data.scale_b.numel() == 1
                 and float(data.scale_a.reshape(())) == 1.0 and float(data.scale_b.reshape(())) == 1.0)
    for role, operand, q, tensor, cast in (("a", spec.operands[0], qa, data.a, spec.a),
                                           ("b", spec.operands[1], qb, data.b.t(), spec.b)):
        def found(stage: str, message: str, operand=operand, side="A" if role == "a" else "B") -> None:
            out.append(Finding(call.step, spec.name, operand, stage, f"{side} ({operand}) {message}"))
        if tuple(tensor.shape) != tuple(q.values.shape):
            found("bytes", f"has shape {list(tensor.shape)} where the oracle's is {list(q.values.shape)}")
            continue
        if tensor.dtype != q.fp8_dtype:
            found("fp8_dtype", f"is {str(tensor.dtype).replace('torch.', '')}; the {recipe.name} recipe casts it "
                               f"to {str(q.fp8_dtype).replace('torch.', '')}")
            continue
        count, index, got, want = _first_difference(tensor.detach().to(torch.float64).cpu(), q.values.cpu())
        if count:
            found("bytes", f"fp8 values differ from the {recipe.name} oracle's in {count} of {tensor.numel()} "
                           f"elements (first at {list(index)}: {got:g}, oracle {want:g})")
        kind = call.scaling[0 if role == "a" else 1] if call.scaling else "?"
        scales = _call_scales(kind, data.scale_a if role == "a" else data.scale_b, role, *q.values.shape)
        expected = _expanded(q.inv_scale.cpu(), *q.values.shape)
        if scales is None:
            shape = list(call.scale_a[0] if role == "a" else call.scale_b[0])
            found("scale", f"scale {shape} ({kind}) cannot be read as {cast.scaling.value} scales of a "
                           f"[{q.values.shape[0]}, {q.values.shape[1]}] operand")
        elif not unit_form:
            count, index, got, want = _first_difference(scales, expected)
            if count:
                ratio = got / want if want else float("nan")
                found("scale", f"inverse scale differs from the {recipe.name} oracle's for {count} of "
                               f"{scales.numel()} elements (first at {list(index)}: {got:.6g}, oracle {want:.6g}, "
                               f"ratio {ratio:.6g})")
    if call.use_fast_accum != spec.fast_accum:
        out.append(Finding(call.step, spec.name, "call", "fast_accum",
                           f"use_fast_accum={call.use_fast_accum} where the {recipe.name} recipe says "
                           f"{spec.fast_accum}"))
    return out


def assign_calls(calls: Sequence[ScaledMMCall], step: int) -> dict[str, list[ScaledMMCall]]:
    """The calls of one step by GEMM; a call whose shapes fit two GEMMs (M, K, N not distinct)
    goes to the first of them that has no call yet, in the order the backward runs them."""
    by_gemm: dict[str, list[ScaledMMCall]] = {g: [] for g in GEMMS}
    for call in (c for c in calls if c.step == step):
        options = [g for g in call.gemm.split("|") if g in by_gemm]
        target = next((g for g in options if not by_gemm[g]), options[0] if options else None)
        if target is not None:
            by_gemm[target].append(call)
    return by_gemm


def call_findings(calls: Sequence[ScaledMMCall], emulated: Sequence[EmulatedStep], recipe: Recipe) -> list[Finding]:
    """Every difference between the recorded calls and the oracle's, for each step the oracle
    emulated (its steps must have kept their operands). GEMMs without a recorded call are not
    compared (an emulated or custom kernel makes none)."""
    findings: list[Finding] = []
    for step, exact in enumerate(emulated):
        for gemm_name, recorded in assign_calls(calls, step).items():
            spec = recipe.gemm(gemm_name)
            if spec.high_precision and recorded:
                findings.append(Finding(step, gemm_name, "call", "precision",
                                        f"an FP8 _scaled_mm call runs a GEMM the {recipe.name} recipe computes in "
                                        f"high precision"))
            elif recorded and gemm_name in exact.operands:
                findings += compare_call(recorded[0], spec, *exact.operands[gemm_name], recipe)
    return findings
