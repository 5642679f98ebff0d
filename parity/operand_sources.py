"""Where an operand's values can come from, for the hypotheses of parity.mistakes: the step's tensors,
the previous call's (a stale cache), the case's memory read as if contiguous (strides ignored), the
operand transposed or reshaped where a transpose belongs, its tokens flattened in the wrong order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity import oracles
from parity.cases import Case, Layout
from parity.data import StepData, materialize
from parity.mistakes import Hypothesis, Source, quantize_mistaken, with_amax_of
from parity.oracles import Quantized
from parity.recipes import Cast, Recipe


@dataclass
class OperandSources:
    """Where an operand's values can come from: the step's tensors and the alternatives the
    hypotheses need (the previous call's, the case's memory read with contiguous strides)."""

    step: StepData
    previous: StepData | None = None
    strided: StepData | None = None  # each non-contiguous operand read as if contiguous (None: all are)

    def quantized(self, hypothesis: Hypothesis, gemm: str, role: str, cast: Cast, recipe: Recipe,
                  shape: tuple[int, ...]) -> Quantized | None:
        """The operand `hypothesis` says the GEMM got, or None where the hypothesis cannot apply (no
        previous call, another shape, a tile that does not divide it)."""
        source = self.view(gemm, role, hypothesis.source)
        if source is None or tuple(source.shape) != tuple(shape):
            return None
        if hypothesis.amax_source != Source.SAME:
            amax_of = self.view(gemm, role, hypothesis.amax_source)
            if amax_of is None or tuple(amax_of.shape) != tuple(shape):
                return None
            hypothesis = with_amax_of(hypothesis, amax_of)
        return quantize_mistaken(source, cast, recipe, hypothesis)

    def view(self, gemm: str, role: str, source: str) -> torch.Tensor | None:
        base = {Source.SAME: self.step, Source.PREVIOUS: self.previous, Source.STRIDES_IGNORED: self.strided,
                Source.TRANSPOSED: self.step, Source.RESHAPED: self.step, Source.RESHAPED_FROM_TRANSPOSE: self.step,
                Source.LEADING_SWAPPED: self.step}[source]
        if base is None:
            return None
        if source == Source.LEADING_SWAPPED:  # N-D input and grad_output flattened with their first two dims swapped
            if base.input.dim() < 3:
                return None
            base = StepData(base.input.transpose(0, 1), base.weight, base.grad_output.transpose(0, 1))
        K, N = base.input.shape[-1], base.weight.shape[0]
        views = oracles.operand_views(base.input.reshape(-1, K), base.weight, base.grad_output.reshape(-1, N))
        operand = views[gemm][0 if role == "a" else 1]
        rows, inner = operand.shape
        if source == Source.TRANSPOSED:
            return operand.t() if rows == inner else None
        if source == Source.RESHAPED:  # the code holds the operand [rows, inner] and reshapes it where .t() belongs
            return operand.reshape(inner, rows).t() if rows != inner else None
        if source == Source.RESHAPED_FROM_TRANSPOSE:  # the code holds its transpose [inner, rows] and does the same
            return operand.t().reshape(rows, inner) if rows != inner else None
        return operand


def _read_contiguous(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`values` stored in `layout` and read back with contiguous strides over the same storage."""
    stored = materialize(values, layout)
    strides = [1] * stored.dim()
    for i in range(stored.dim() - 2, -1, -1):
        strides[i] = strides[i + 1] * stored.shape[i + 1]
    return torch.as_strided(stored, stored.shape, strides).clone()


def strides_ignored(step: StepData, case: Case) -> StepData | None:
    """The step's tensors as an implementation that ignores strides reads them from the case's
    memory layouts (as_strided with contiguous strides over the same storage); None when every
    operand is contiguous."""
    layouts = (case.input_layout, case.weight_layout, case.grad_output_layout)
    if all(layout is Layout.CONTIGUOUS for layout in layouts):
        return None
    return StepData(*(_read_contiguous(values, layout)
                      for values, layout in zip((step.input, step.weight, step.grad_output), layouts)))
