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

import math
from typing import Sequence

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


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, *, absolute_amax: bool = True,
             scale_dtype: torch.dtype = torch.float32, target_max: float | None = None,
             clamp_max: float | None = None, inverse_scale: bool = True) -> Quantized:
    """Tensorwise dynamic scaling, emulated in float64.

    The keyword arguments describe *wrong* quantizations, for parity.bisect's "nearest wrong
    oracle": amax without abs, a scale rounded to bf16, a scale aimed at another format's max,
    a clamp at another bound, or the scale handed to the GEMM instead of its inverse.
    """
    fmt = FORMATS[fp8_dtype]
    amax = (x.abs() if absolute_amax else x).max().to(torch.float64)
    scale = ((target_max or fmt.max) / torch.clamp(amax, min=EPS)).to(torch.float32)
    scale = scale.to(scale_dtype).to(torch.float32)
    scaled = (x.to(torch.float64) * scale.to(torch.float64)).to(torch.float32)  # one fp32 rounding
    bound = min(fmt.max, clamp_max or fmt.max)
    saturated = scaled.to(torch.float64).clamp(-bound, bound)
    handed = scale.reciprocal() if inverse_scale else scale
    return Quantized(round_to_fp8_grid(saturated, fp8_dtype), handed.to(torch.float64), fp8_dtype)


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


# ---- how far a real FP8 GEMM may be from the exact result ------------------------------------------

# How a GEMM accumulates, for the bound. CPUs sum in fp32 (unit roundoff 2^-24) and ignore
# use_fast_accum. Hopper's FP8 tensor cores keep about 14 mantissa bits in their partial sums
# (DeepSeek-V3 report, section 3.3.2, measured on H800); we allow 2^-13, twice that, since
# the width is undocumented. With fast accumulation the whole K-long sum stays at that
# precision; without it, cuBLAS "periodically promotes" partial sums to fp32 (its docs; the
# period is undocumented): we assume blocks of at most 256 products (CUTLASS promotes every
# 4 x 32 = 128, doubled for margin), summed in fp32. Measured on the H200: fp32-accumulation
# bounds fail there by up to 13.6x even without fast accumulation (K = 16), these hold.
FP32_UNIT_ROUNDOFF = 2.0 ** -24
TENSOR_CORE_UNIT_ROUNDOFF = 2.0 ** -13
PROMOTION_INTERVAL = 256


def _gamma(k: int, u: float) -> float:
    """Higham's gamma_k = k u / (1 - k u): any order of a k-term sum errs by <= gamma_k sum |terms|."""
    return k * u / max(1 - k * u, 1e-3)


def accumulation_gamma(inner_dim: int, *, device_type: str, fast_accum: bool) -> float:
    """The gamma of a GEMM's K-long accumulation on this kind of device (see above)."""
    if device_type != "cuda":
        return _gamma(inner_dim, FP32_UNIT_ROUNDOFF)
    if fast_accum:
        return _gamma(inner_dim, TENSOR_CORE_UNIT_ROUNDOFF)
    block = min(inner_dim, PROMOTION_INTERVAL)
    blocks = -(-inner_dim // block)
    inner = _gamma(block, TENSOR_CORE_UNIT_ROUNDOFF)
    return inner + _gamma(blocks, FP32_UNIT_ROUNDOFF) * (1 + inner)


UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24,
                 torch.float64: 2.0 ** -53}
_SMALLEST_SUBNORMAL = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149,
                       torch.float64: 2.0 ** -1074}


def rounding_chain(case, tensor: str) -> list[torch.dtype]:
    """The dtypes a tensor's GEMM result is rounded to, in order (as torchao and fp8_impl write it)."""
    out = case.torch_input_dtype  # the output (and grad_output) dtype
    target = {"output": out, "grad_input": out, "grad_weight": case.torch_weight_dtype,
              "grad_bias": case.torch_weight_dtype}[tensor]
    chain = [out]
    if tensor == "output" and case.bias:
        chain.append(out)  # the bias is added in the output dtype: a second rounding
    if target != out:
        chain.append(target)
    return chain


def rounded_like_result(value: torch.Tensor, case, tensor: str) -> torch.Tensor:
    """An exact float64 result rounded the way an implementation writes it (rounding_chain)."""
    for dtype in rounding_chain(case, tensor):
        value = value.to(dtype)
    return value


def magnitude_of(step: EmulatedStep, step_data, tensor: str) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(|A| @ |B| of the tensor's GEMM, its inner dimension, its exact value before any rounding);
    grad_bias sums grad_output over M."""
    if tensor == "grad_bias":
        go = step_data.grad_output.reshape(-1, step_data.grad_output.shape[-1]).to(torch.float64)
        return go.abs().sum(0), go.shape[0], go.sum(0)
    return step.magnitude[tensor], step.inner_dim[tensor], getattr(step, tensor)


def accumulation_excess(candidate: torch.Tensor, exact: torch.Tensor, *, magnitude: torch.Tensor, gamma: float,
                        gemm_value: torch.Tensor, rounding_chain: Sequence[torch.dtype],
                        bias: torch.Tensor | None = None, sides: int = 1) -> tuple[float, int, tuple]:
    """(max |c - e| / allowed, count beyond 1, index of the max) for the elementwise bound

        allowed = sides * (gamma + 2 u_fp32) * (|A| @ |B|)
                  + sum over the roundings d of the result: u_d (2 |G| + |c| + |e|) (1 + 2^-7)
                  + u_out |bias| + smallest subnormals

    G is the exact GEMM result (what is rounded first; with a bias, the final value can be far
    smaller). gamma bounds the accumulation (accumulation_gamma: Higham, Accuracy and
    Stability of Numerical Algorithms, section 3.1); 2 u_fp32 covers applying the two inverse
    scales in fp32; u_out |bias| lets a correct implementation
    add the bias at another precision. `exact` is the emulated result rounded like the
    candidate's; sides=2 when both sides are real GEMMs (each with its own error).
    """
    c = candidate.detach().to(torch.float64).reshape(magnitude.shape)
    e = exact.detach().to(torch.float64).reshape(magnitude.shape)
    # At a dtype's overflow threshold, accumulation error decides between its max and inf (fp16:
    # 65504 vs inf): an infinity counts as the threshold, max + half an ulp.
    narrowest = min((torch.finfo(dtype) for dtype in rounding_chain), key=lambda f: f.max)
    threshold = narrowest.max * (1 + narrowest.eps / 2)
    same = (c == e) | (torch.isnan(c) & torch.isnan(e))
    c, e = c.clamp(-threshold, threshold), e.clamp(-threshold, threshold)
    rounded = 2 * gemm_value.detach().to(torch.float64).abs().reshape(magnitude.shape) + c.abs() + e.abs()
    allowed = sides * (gamma + 2 * FP32_UNIT_ROUNDOFF) * magnitude
    for dtype in rounding_chain:
        allowed = allowed + UNIT_ROUNDOFF[dtype] * rounded * (1 + 2 ** -7) + 2 * _SMALLEST_SUBNORMAL[dtype]
    if bias is not None:
        allowed = allowed + UNIT_ROUNDOFF[rounding_chain[0]] * bias.detach().to(torch.float64).abs()
    excess = (c - e).abs() / allowed
    excess = torch.where(same, 0.0, torch.nan_to_num(excess, nan=math.inf))
    worst = excess.reshape(-1).argmax()
    ratio, beyond, flat = torch.stack([excess.reshape(-1)[worst], (excess > 1).sum().to(torch.float64),
                                       worst.to(torch.float64)]).tolist()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(int(flat)), tuple(candidate.shape)))
    return ratio, int(beyond), index
