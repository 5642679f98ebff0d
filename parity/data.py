"""Turning a case into tensors: distributions (the values) and layouts (the strides).

Values are drawn on the CPU from a generator seeded by the case, so a case id gives the
same numbers on every machine and device (a GPU failure reproduces on a laptop). Each
implementation then gets its own fresh copies in the case's memory layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from parity.cases import Case, Dist, Layout

NEAR_MAX = 448.0  # e4m3fn max: "near max" data sits at the top of the fp8 range
LAYOUT_PAD = 16  # padded rows: row stride = row length + 16 elements


@dataclass
class StepData:
    """The logical (contiguous) tensors of one call."""

    input: torch.Tensor  # [*lead, K], input dtype
    weight: torch.Tensor  # [N, K], weight dtype: the weight's value during this call
    grad_output: torch.Tensor  # [*lead, N], output dtype (= input dtype)


@dataclass
class CaseData:
    case: Case
    steps: list[StepData]
    bias: torch.Tensor | None  # [N], weight dtype
    host: "CaseData | None" = None  # the same tensors on the CPU (None when these are the CPU's)
    # The exact emulation of every step per recipe name (parity.runner.emulated_steps_of), computed
    # once per case and place however many implementations are compared against it.
    emulated: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.steps[0].input.device

    def on_host(self) -> "CaseData":
        return self if self.host is None else self.host


def sample(dist: Dist, shape: tuple[int, ...], generator: torch.Generator, *, outlier_ratio: int = 100) -> torch.Tensor:
    """float32 values of `dist`, on the CPU."""
    g = generator
    if dist is Dist.NORMAL:
        return torch.randn(shape, generator=g)
    if dist is Dist.UNIFORM:
        return (torch.rand(shape, generator=g) * 2 - 1) * math.sqrt(3.0)
    if dist is Dist.HEAVY:  # Student-t, 3 dof: normal / sqrt(chi2_3 / 3)
        z = torch.randn(shape, generator=g)
        chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0)
        return z / (chi2 / 3).sqrt().clamp(min=1e-3)
    if dist is Dist.OUTLIER:
        x = torch.randn(shape, generator=g)
        channel = int(torch.randint(shape[-1], (1,), generator=g))
        x[..., channel] *= outlier_ratio
        return x
    if dist is Dist.ZEROS:
        return torch.zeros(shape)
    if dist is Dist.NEAR_MAX:
        sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
        x = sign * (0.9 + 0.1 * torch.rand(shape, generator=g)) * NEAR_MAX
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = NEAR_MAX  # amax exactly at the fp8 max
        return x
    if dist is Dist.TINY:
        sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
        return sign * torch.exp2(-30 + 20 * torch.rand(shape, generator=g))
    if dist is Dist.ZERO_ROWS:
        x = torch.randn(shape, generator=g)
        x[..., torch.randperm(shape[-2], generator=g)[: max(1, shape[-2] // 4)], :] = 0
        x[..., torch.randperm(shape[-1], generator=g)[: max(1, shape[-1] // 4)]] = 0
        return x
    if dist is Dist.OUTLIER_ROW:
        x = torch.randn(shape, generator=g)
        x.reshape(-1, shape[-1])[int(torch.randint(math.prod(shape[:-1]), (1,), generator=g))] *= 1e4
        return x
    if dist is Dist.TINY_AMAX:
        return torch.randn(shape, generator=g) * 1e-30
    if dist is Dist.SMALL_AMAX:
        return torch.randn(shape, generator=g) * 2.0 ** -16
    if dist is Dist.NEGATIVE:
        x = -torch.randn(shape, generator=g).abs()
        flip = torch.rand(shape, generator=g) < 0.05
        return torch.where(flip, -x * 0.5, x)
    raise ValueError(f"unknown distribution {dist!r}")


def make_data(case: Case, device: torch.device | str = "cpu") -> CaseData:
    """The tensors of every call of `case`, on `device` (with their CPU twin in `.host`)."""
    g = torch.Generator().manual_seed(case.seed)
    draw = lambda shape: sample(case.dist, shape, g, outlier_ratio=case.outlier_ratio)  # noqa: E731
    # Outlier channels are an activation phenomenon (LLM hidden states): weights and gradients
    # stay normal. With outliers in both operands of grad_weight, tensorwise FP8 loses all
    # accuracy in the one huge, cancelling product term, which says nothing about the code.
    # The same holds for a single huge token (outlier_row) and for a tiny activation amax.
    activation_only = (Dist.OUTLIER, Dist.OUTLIER_ROW, Dist.TINY_AMAX, Dist.SMALL_AMAX)
    draw_param = (lambda shape: sample(Dist.NORMAL, shape, g)) if case.dist in activation_only else draw  # noqa: E731
    in_dtype, w_dtype = case.torch_input_dtype, case.torch_weight_dtype
    weight = draw_param((case.N, case.K))
    bias = torch.randn(case.N, generator=g) * 0.1 if case.bias else None
    steps = []
    for step in range(case.steps):
        if step:  # an in-place update between calls, like an optimizer step
            weight = weight * -0.5 + draw_param((case.N, case.K))
        steps.append(StepData(input=draw(case.input_shape).to(in_dtype), weight=weight.to(w_dtype),
                              grad_output=draw_param(case.output_shape).to(in_dtype)))
    host = CaseData(case=case, steps=steps, bias=None if bias is None else bias.to(w_dtype))
    if torch.device(device).type == "cpu":
        return host
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return CaseData(case, [StepData(move(s.input), move(s.weight), move(s.grad_output)) for s in steps],
                    move(host.bias), host=host)


def materialize(values: torch.Tensor, layout: Layout, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh tensor equal to `values` (cast to `dtype`) stored in `layout`.

    Gaps of non-dense layouts hold NaN, so a kernel that reads memory outside the view
    shows up as NaN in its result instead of passing by luck.
    """
    values = values.to(dtype) if dtype is not None and values.dtype != dtype else values
    layout = Layout(layout)
    if layout is Layout.CONTIGUOUS:
        return values.clone(memory_format=torch.contiguous_format)
    if values.dim() < 2:
        raise ValueError(f"layout {layout.value} needs a tensor of at least 2 dims, got shape {tuple(values.shape)}")
    if layout is Layout.TRANSPOSED:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    *outer, cols = values.shape
    if layout is Layout.SLICED:
        buffer = torch.full((*outer, 2 * cols), float("nan"), dtype=values.dtype, device=values.device)
        view = buffer[..., ::2]
    else:  # PADDED
        buffer = torch.full((*outer, cols + LAYOUT_PAD), float("nan"), dtype=values.dtype, device=values.device)
        view = buffer[..., :cols]
    view.copy_(values)
    return view
