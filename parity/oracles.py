"""Exact float64 emulation of the FP8 math of a linear layer, for any recipe of parity.recipes.

The emulation quantizes exactly as the recipe says (amax over the elements sharing a scale,
float64 scale rounded to float32, optionally down to a power of two, float32 product,
saturating round-to-nearest-even onto the fp8 grid), but rounds onto the grid with its own
arithmetic rather than torch's fp8 cast, and then multiplies the fp8 values in float64.
Products of two fp8 values have at most 8 significant bits, so float64 sums of them are exact
for any K a GPU can hold (and the sums of one block of the inner dim, which block scales need,
are exact too); the inverse scales are applied once per block. What separates a real FP8 GEMM from
this oracle is therefore its accumulation (fp32 or fast-accum partial sums) and the final
rounding, and nothing else: a mismatch beyond that bound is a bug, not noise.

Every operand is handled in its "inner dim last" orientation, as the GEMM reads it: A as
[rows, inner], B as B.T = [cols, inner] (output: input [M,K] and weight [N,K]; grad_input:
grad_output [M,N] and weight.T [K,N]; grad_weight: grad_output.T [N,M] and input.T [K,M]).

The quantization is the recipe's alone, written as its stages (CastStages); the wrong quantizations
bisect tries are data of parity.mistakes, each a transform of one of those stages.

The float64 and bfloat16 nn.Linear references need no code here: they are nn.Linear run
with the case's data cast to that dtype (see parity.impls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Sequence

import torch

from parity import mx
from parity.recipes import DEFAULT_RECIPE, FP8_FORMATS, GEMMS, Cast, Fp8Format, Recipe, Scaling

EPS = 1e-12  # the amax floor of torchao's amax_to_scale
TENSORWISE = DEFAULT_RECIPE
FORMATS = {fmt.dtype: fmt for fmt in FP8_FORMATS.values()}  # parity.recipes' table of fp8 formats, by dtype


def round_to_fp8_grid(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round float64 `x` (already within +-max) to the nearest fp8 value, ties to even."""
    fmt = FORMATS[fp8_dtype]
    quantum = mx.grid_quantum(x, fmt.mantissa_bits, fmt.min_exponent)
    return torch.round(x / quantum) * quantum  # torch.round: half to even; * and / by 2^n are exact


@dataclass
class Quantized:
    """One GEMM operand as the GEMM consumes it, laid out [rows, inner]."""

    values: torch.Tensor  # float64 values on the fp8 grid (x * scale, saturated and rounded); hp: x itself
    inv_scale: torch.Tensor  # float64 [rows / r, inner / i]: the inverse scales handed to the GEMM
    tile: tuple[int, int]  # (r, i): the elements sharing one scale
    fp8_dtype: torch.dtype | None  # None: a high-precision operand

    def per_block(self, block: int) -> torch.Tensor:
        """The inverse scale of each row and each `block`-long stretch of the inner dim: [rows, inner / block]."""
        r, i = self.tile
        return self.inv_scale.repeat_interleave(r, dim=0).repeat_interleave(i // block, dim=1)

    def dequantized(self) -> torch.Tensor:
        r, i = self.tile
        return self.values * self.inv_scale.repeat_interleave(r, dim=0).repeat_interleave(i, dim=1)


# ---- the recipe's cast of one operand, stage by stage ----------------------------------------------
# amax over the elements sharing a scale -> scale (the float64 quotient fp8_max / amax rounded to float32;
# rounded down to a power of two, or computed through a float32 reciprocal, where the recipe says so) ->
# the values times their scale, rounded to float32 -> a saturating round onto the fp8 grid; the GEMM is
# handed the inverse scales. Each stage is one function below; CastStages composes them, and its fields
# (the recipe's stages by default) are what parity.mistakes replaces, one at a time, to make a mistake.

def format_of(cast: Cast) -> Fp8Format | None:
    """The fp8 format `cast` rounds onto (None: the operand stays in high precision)."""
    return None if cast.fp8 is None else FP8_FORMATS[cast.fp8]


def tile_of(cast: Cast, rows: int, inner: int) -> tuple[int, int]:
    """The elements sharing one scale, (r, i), of an operand [rows, inner] under `cast`."""
    return cast.scaling.tile(rows, inner)


def grouped(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """`x` [rows, inner] as [rows / r, r, inner / i, i]: each (r, i) tile one group (a RuntimeError where
    the tile does not divide x)."""
    (rows, inner), (r, i) = x.shape, tile
    return x.reshape(rows // r, r, inner // i, i)


def group_amax(groups: torch.Tensor) -> torch.Tensor:
    """max |x| of each group: float64 [rows / r, inner / i]."""
    return groups.abs().amax(dim=(1, 3)).to(torch.float64)


def amax_to_scale(amax: torch.Tensor, fp8_max: float, *, pow2: bool = False, via_reciprocal: bool = False,
                  eps: float = EPS) -> torch.Tensor:
    """float32 scales fp8_max / max(amax, eps): the float64 quotient rounded once (torchao), or with
    `via_reciprocal` fp8_max * (1 / amax) in float32 (two roundings: what torch does with `448.0 / amax`
    for a float32 tensor amax); with `pow2` rounded down to a power of two."""
    if via_reciprocal:
        reciprocal = (1.0 / torch.clamp(amax, min=eps).to(torch.float32).to(torch.float64)).to(torch.float32)
        scale = (fp8_max * reciprocal.to(torch.float64)).to(torch.float32)
    else:
        scale = (fp8_max / torch.clamp(amax, min=eps)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def scaled_values(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each group times its scale, exact in float64 and rounded once to float32."""
    return (groups.to(torch.float64) * scale.to(torch.float64)[:, None, :, None]).to(torch.float32)


def saturated(scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The scaled values clamped to +-max and rounded onto the format's grid (float64)."""
    return round_to_fp8_grid(scaled.to(torch.float64).clamp(-fmt.max, fmt.max), fmt.dtype)


def inverse_of(scale: torch.Tensor) -> torch.Tensor:
    """What the GEMM is handed: the float32 inverse of each scale."""
    return scale.reciprocal()


@dataclass(frozen=True)
class CastStages:
    """The cast of one operand as its stages: the recipe's scale rounding and a function per stage (the
    recipe's by default; parity.mistakes replaces one, keeping the others and their exact arithmetic)."""

    pow2: bool = False  # scales rounded down to a power of two (Recipe.pow2_scales)
    via_reciprocal: bool = False  # scales through a float32 reciprocal (Recipe.reciprocal_scales)
    fp8_format: Callable[[Cast], Fp8Format | None] = format_of
    tiles: Callable[[Cast, int, int], tuple[int, int]] = tile_of
    amax: Callable[[torch.Tensor], torch.Tensor] = group_amax
    scale: Callable[..., torch.Tensor] = amax_to_scale  # (amax, fp8_max, *, pow2, via_reciprocal)
    scaled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = scaled_values
    saturation: Callable[[torch.Tensor, Fp8Format], torch.Tensor] = saturated
    inverse: Callable[[torch.Tensor], torch.Tensor] = inverse_of
    mx_rule: str = mx.ScaleRule.RCEIL.value  # how a 1x32 cast rounds its E8M0 scale (Recipe.mx_rule)

    def for_cast(self, cast: Cast) -> "CastStages":
        """These stages with the float8 defaults swapped for the microscaled cast's own (parity.mx): a 1x32
        scale is a power of two by the E8M0 rule; a 1x16 scale is the decode scale s * global, which the values
        are divided by and the GEMM applies as it is. A stage a mistake replaced stays replaced."""
        if not cast.scaling.microscaled:
            return self
        own = ({"scale": partial(mx.mxfp8_scale, rule=self.mx_rule)} if cast.scaling is Scaling.MX_1X32 else
               {"scale": mx.nvfp4_scale, "scaled": mx.divided_by_decode_scale, "inverse": mx.unchanged})
        defaults = {"scale": amax_to_scale, "scaled": scaled_values, "inverse": inverse_of}
        return replace(self, **{name: stage for name, stage in own.items() if getattr(self, name) is defaults[name]})

    def cast(self, x: torch.Tensor, cast: Cast) -> Quantized:
        """`x` [rows, inner] (1-D: one row) cast with `cast`, emulated in float64."""
        x = x.reshape(1, -1) if x.dim() == 1 else x
        rows, inner = x.shape
        stages = self.for_cast(cast)
        fmt = stages.fp8_format(cast)
        if fmt is None:
            return Quantized(x.to(torch.float64), x.new_ones((1, 1), dtype=torch.float64), (rows, inner), None)
        tile = stages.tiles(cast, rows, inner)
        if cast.scaling.microscaled:
            mx.check_whole_blocks(inner, cast.scaling.tile(rows, inner)[1])
        groups = grouped(x, tile)
        scale = stages.scale(stages.amax(groups), fmt.max, pow2=stages.pow2, via_reciprocal=stages.via_reciprocal)
        values = stages.saturation(stages.scaled(groups, scale), fmt)
        return Quantized(values.reshape(rows, inner), stages.inverse(scale).to(torch.float64), tile, fmt.dtype)


def scale_rounding(recipe: Recipe) -> dict:
    """quantize()'s keyword arguments for how `recipe` rounds its scales."""
    rounding = dict(pow2=recipe.pow2_scales, via_reciprocal=recipe.reciprocal_scales)
    return {**rounding, "mx_rule": recipe.mx_rule} if recipe.mx_rule else rounding


def recipe_stages(recipe: Recipe) -> CastStages:
    """The recipe's own cast stages (its scale rounding), which parity.mistakes changes one at a time."""
    return CastStages(**scale_rounding(recipe))


def quantize(x: torch.Tensor, cast: Cast | torch.dtype, *, pow2: bool = False,
             via_reciprocal: bool = False, mx_rule: str = mx.ScaleRule.RCEIL.value) -> Quantized:
    """Dynamic scaling of the operand `x` [rows, inner] (1-D: one row) as the recipe casts it, emulated
    in float64. `cast` is a parity.recipes.Cast (or an fp8 dtype: tensorwise); `pow2`, `via_reciprocal`
    and `mx_rule` are the recipe's scale rounding (scale_rounding). The wrong casts bisect tries
    are parity.mistakes'."""
    if isinstance(cast, torch.dtype):
        cast = Cast(Scaling.TENSORWISE, FORMATS[cast].name)
    return CastStages(pow2=pow2, via_reciprocal=via_reciprocal, mx_rule=mx_rule).cast(x, cast)


def _block_of(a: Quantized, b: Quantized) -> int:
    """The longest stretch of the inner dim over which both operands keep one scale."""
    return math.gcd(a.tile[1], b.tile[1])


def gemm(a: Quantized, b: Quantized, *, magnitude: bool = False) -> torch.Tensor:
    """Exact A @ B (float64 [rows of A, rows of B]) of A [R, I] and B.T [C, I]; with
    magnitude=True, |A| @ |B| with the scales: the size of the terms an accumulation error is
    relative to. Sums of each block of the inner dim are exact; each block's scales multiply it
    once (a single float64 rounding) and the blocks are summed."""
    av, bv = (a.values.abs(), b.values.abs()) if magnitude else (a.values, b.values)
    (rows, inner), cols = av.shape, bv.shape[0]
    block = _block_of(a, b)
    if block == inner:  # one scale (or one row/column of scales) along the whole inner dim
        return (av @ bv.t()) * (a.per_block(inner) * b.per_block(inner).t())
    blocks = inner // block
    partial = torch.bmm(av.reshape(rows, blocks, block).transpose(0, 1),
                        bv.reshape(cols, blocks, block).permute(1, 2, 0))
    scales = a.per_block(block).t()[:, :, None] * b.per_block(block).t()[:, None, :]  # [blocks, R, C], exact
    return (partial * scales).sum(0)


def operand_views(input_2d: torch.Tensor, weight: torch.Tensor, grad_output_2d: torch.Tensor) -> dict:
    """(A [rows, inner], B.T [cols, inner]) of each GEMM of a linear layer."""
    return {"output": (input_2d, weight), "grad_input": (grad_output_2d, weight.t()),
            "grad_weight": (grad_output_2d.t(), input_2d.t())}


@dataclass
class EmulatedStep:
    """Exact FP8 results of one call (float64, before rounding to the output dtypes), with
    the magnitudes an accumulation error scales with, each GEMM's inner dimension and, when
    kept, the quantized operands each GEMM consumed (for comparing recorded _scaled_mm calls)."""

    output: torch.Tensor  # [M, N]
    grad_input: torch.Tensor  # [M, K]
    grad_weight: torch.Tensor  # [N, K]
    magnitude: dict[str, torch.Tensor]
    inner_dim: dict[str, int]
    operands: dict[str, tuple[Quantized, Quantized]] = field(default_factory=dict, repr=False)


def emulate_linear(input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor,
                   recipe: Recipe = TENSORWISE, *, keep_operands: bool = False) -> EmulatedStep:
    """The three GEMMs of an FP8 linear layer under `recipe`, exactly (2-D views of N-D tensors)."""
    K, N = input.shape[-1], weight.shape[0]
    views = operand_views(input.reshape(-1, K), weight, grad_output.reshape(-1, N))
    results, magnitude, operands = {}, {}, {}
    for spec in recipe.gemms:
        a, bt = views[spec.name]
        quantized = [quantize(a, spec.a, **scale_rounding(recipe)), quantize(bt, spec.b, **scale_rounding(recipe))]
        results[spec.name] = gemm(*quantized)
        magnitude[spec.name] = gemm(*quantized, magnitude=True)
        if keep_operands:
            operands[spec.name] = tuple(quantized)
    return EmulatedStep(**results, magnitude=magnitude, inner_dim=dict(output=K, grad_input=N,
                                                                       grad_weight=views["output"][0].shape[0]),
                        operands=operands)


def result_dtypes(recipe: Recipe, gemm_name: str, out_dtype: torch.dtype) -> list[torch.dtype]:
    """The dtypes a GEMM's result is rounded to on its way to `out_dtype` (axis- and block-scaled
    GEMMs of recipes with scaled_out_bf16 write bf16 first)."""
    if recipe.scaled_out_bf16 and recipe.gemm(gemm_name).kind in ("RowWise", "BlockWise") \
            and out_dtype != torch.bfloat16:
        return [torch.bfloat16, out_dtype]
    return [out_dtype]


class RecipeMatmul(torch.autograd.Function):
    """`input_2d @ weight.T` whose three GEMMs `compute(recipe, name, A, B.T, out_dtype)` computes, as a
    differentiable function: the float64 emulation here (_emulated_gemm), the Hopper model in
    parity.hopper_oracle."""

    @staticmethod
    def forward(ctx, input_2d, weight, recipe: Recipe, compute):
        ctx.save_for_backward(input_2d, weight)
        ctx.recipe, ctx.compute = recipe, compute
        return compute(recipe, "output", input_2d, weight, input_2d.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input_2d, weight = ctx.saved_tensors
        views = operand_views(input_2d, weight, grad_output)
        grad_input = ctx.compute(ctx.recipe, "grad_input", *views["grad_input"], grad_output.dtype)
        # Rounded to grad_output's dtype first, as a real FP8 GEMM writes it, then cast.
        grad_weight = ctx.compute(ctx.recipe, "grad_weight", *views["grad_weight"], grad_output.dtype)
        return grad_input, grad_weight.to(weight.dtype), None, None


def _emulated_gemm(recipe: Recipe, name: str, a: torch.Tensor, bt: torch.Tensor, out_dtype: torch.dtype):
    spec = recipe.gemm(name)
    value = gemm(quantize(a, spec.a, **scale_rounding(recipe)), quantize(bt, spec.b, **scale_rounding(recipe)))
    for dtype in result_dtypes(recipe, name, out_dtype):
        value = value.to(dtype)
    return value


def emulated_matmul(recipe: Recipe = TENSORWISE):
    """The `emulated:<recipe>` built-in: exact FP8 math in the function form of an implementation."""
    def matmul(input_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return RecipeMatmul.apply(input_2d, weight, recipe, _emulated_gemm)
    matmul.__name__ = f"emulated_{recipe.name}"
    return matmul


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


def rounding_chain(case, tensor: str, recipe: Recipe = TENSORWISE) -> list[torch.dtype]:
    """The dtypes a tensor's GEMM result is rounded to, in order (as torchao and fp8_impl write it)."""
    out = case.torch_input_dtype  # the output (and grad_output) dtype
    target = {"output": out, "grad_input": out, "grad_weight": case.torch_weight_dtype,
              "grad_bias": case.torch_weight_dtype}[tensor]
    chain = result_dtypes(recipe, tensor, out) if tensor in GEMMS else [out]
    if tensor == "output" and case.bias:
        chain.append(out)  # the bias is added in the output dtype: a second rounding
    if target != out:
        chain.append(target)
    return chain


def rounded_like_result(value: torch.Tensor, case, tensor: str, recipe: Recipe = TENSORWISE) -> torch.Tensor:
    """An exact float64 result rounded the way an implementation writes it (rounding_chain)."""
    for dtype in rounding_chain(case, tensor, recipe):
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
