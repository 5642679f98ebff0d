"""Exact float64 emulation of tensorwise FP8 linear-layer math.

The emulation quantizes exactly as torchao's tensorwise recipe does (amax, float64 scale
rounded to float32, float32 product, saturating round-to-nearest-even onto the fp8 grid),
but rounds onto the grid with its own arithmetic rather than torch's fp8 cast, and then
multiplies the fp8 values in float64. Products of two fp8 values have at most 8
significant bits, so the float64 sums are exact for any K a GPU can hold; the two inverse
scales are applied once at the end. What separates a real FP8 GEMM from this oracle is
therefore its accumulation (fp32 or fast-accum partial sums) and the final rounding, and
nothing else: a mismatch beyond that bound is a bug, not noise.

The float64 and bfloat16 nn.Linear references need no code here: they are nn.Linear run
with the case's data cast to that dtype (see parity.impls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-12  # the amax floor of torchao's amax_to_scale
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Fp8Format:
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal number
    max: float


FORMATS = {
    torch.float8_e4m3fn: Fp8Format(3, -6, 448.0),
    torch.float8_e5m2: Fp8Format(2, -14, 57344.0),
    torch.float8_e4m3fnuz: Fp8Format(3, -7, 240.0),
    torch.float8_e5m2fnuz: Fp8Format(2, -15, 57344.0),
}


def round_to_fp8_grid(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round float64 `x` (already within +-max) to the nearest fp8 value, ties to even."""
    fmt = FORMATS[fp8_dtype]
    _, exponent = torch.frexp(x)  # x = m * 2**exponent with 0.5 <= |m| < 1
    binade = torch.clamp(exponent - 1, min=fmt.min_exponent)  # subnormals share the lowest quantum
    quantum = torch.exp2((binade - fmt.mantissa_bits).to(torch.float64))
    return torch.round(x / quantum) * quantum  # torch.round: half to even; * and / by 2^n are exact


@dataclass
class Quantized:
    values: torch.Tensor  # float64 values on the fp8 grid (x * scale, saturated and rounded)
    inv_scale: torch.Tensor  # float64 0-dim: the float32 inverse scale handed to _scaled_mm
    fp8_dtype: torch.dtype

    def dequantized(self) -> torch.Tensor:
        return self.values * self.inv_scale


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype) -> Quantized:
    """Tensorwise dynamic scaling, emulated in float64."""
    fmt = FORMATS[fp8_dtype]
    amax = x.abs().max().to(torch.float64)
    scale = (fmt.max / torch.clamp(amax, min=EPS)).to(torch.float32)
    scaled = (x.to(torch.float64) * scale.to(torch.float64)).to(torch.float32)  # one fp32 rounding
    saturated = scaled.to(torch.float64).clamp(-fmt.max, fmt.max)
    return Quantized(round_to_fp8_grid(saturated, fp8_dtype), scale.reciprocal().to(torch.float64), fp8_dtype)


def gemm(a: Quantized, b: Quantized, *, transpose_a: bool = False, transpose_b: bool = False) -> torch.Tensor:
    """Exact product of two quantized operands (op(a) @ op(b)), float64."""
    av = a.values.t() if transpose_a else a.values
    bv = b.values.t() if transpose_b else b.values
    return (av @ bv) * (a.inv_scale * b.inv_scale)


def gemm_magnitude(a: Quantized, b: Quantized, *, transpose_a: bool = False, transpose_b: bool = False) -> torch.Tensor:
    """|op(a)| @ |op(b)| with scales: the size of the terms an accumulation error is relative to."""
    av = a.values.t() if transpose_a else a.values
    bv = b.values.t() if transpose_b else b.values
    return (av.abs() @ bv.abs()) * (a.inv_scale * b.inv_scale)


@dataclass
class EmulatedStep:
    """Exact FP8 results of one call (float64, before rounding to the output dtypes), with
    the magnitudes an accumulation error scales with and each GEMM's inner dimension."""

    output: torch.Tensor  # [M, N]
    grad_input: torch.Tensor  # [M, K]
    grad_weight: torch.Tensor  # [N, K]
    magnitude: dict[str, torch.Tensor]
    inner_dim: dict[str, int]


def emulate_linear(input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, *,
                   input_fp8: torch.dtype = E4M3, weight_fp8: torch.dtype = E4M3,
                   grad_output_fp8: torch.dtype = E5M2) -> EmulatedStep:
    """The three GEMMs of a tensorwise FP8 linear layer, exactly (2-D views of N-D tensors)."""
    K, N = input.shape[-1], weight.shape[0]
    qx = quantize(input.reshape(-1, K), input_fp8)
    qw = quantize(weight, weight_fp8)
    qgo = quantize(grad_output.reshape(-1, N), grad_output_fp8)
    return EmulatedStep(
        output=gemm(qx, qw, transpose_b=True),
        grad_input=gemm(qgo, qw),
        grad_weight=gemm(qgo, qx, transpose_a=True),
        magnitude=dict(output=gemm_magnitude(qx, qw, transpose_b=True), grad_input=gemm_magnitude(qgo, qw),
                       grad_weight=gemm_magnitude(qgo, qx, transpose_a=True)),
        inner_dim=dict(output=K, grad_input=N, grad_weight=qx.values.shape[0]),
    )


class _EmulatedMatmul(torch.autograd.Function):
    """`input_2d @ weight.T` with exact tensorwise-FP8 numerics, as a differentiable function."""

    @staticmethod
    def forward(ctx, input_2d, weight):
        qx, qw = quantize(input_2d, E4M3), quantize(weight, E4M3)
        ctx.quantized = (qx, qw)
        ctx.weight_dtype = weight.dtype
        return gemm(qx, qw, transpose_b=True).to(input_2d.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        qx, qw = ctx.quantized
        qgo = quantize(grad_output, E5M2)
        # Rounded to grad_output's dtype first, as a real FP8 GEMM writes it, then cast.
        grad_input = gemm(qgo, qw).to(grad_output.dtype)
        grad_weight = gemm(qgo, qx, transpose_a=True).to(grad_output.dtype).to(ctx.weight_dtype)
        return grad_input, grad_weight


def emulated_matmul(input_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The `emulated` built-in: exact FP8 math in the function form of an implementation."""
    return _EmulatedMatmul.apply(input_2d, weight)
