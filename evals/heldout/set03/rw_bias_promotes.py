"""Config-driven FP8 linear layers with a module-swap converter.

    model = convert_linears(model)                 # recipe RECIPE below
    model = convert_linears(model, recipe="rowwise", skip=lambda name, mod: ...)

A recipe says, for each of the three GEMMs of a linear layer and each of its
two operands, how the operand is cast: fp8 format and scale granularity
("tensor" or "axis"), or None for a high-precision operand.

    output      = x  @ w.T      (reduction over K)
    grad_input  = dy @ w        (reduction over N)
    grad_weight = dy.T @ x      (reduction over M)
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

RECIPE = "rowwise"

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class Cast:
    dtype: torch.dtype
    granularity: str = "tensor"        # "tensor" | "axis"
    clip: Optional[float] = None       # saturation bound; None: the format's max


@dataclass(frozen=True)
class Gemm:
    a: Optional[Cast]
    b: Optional[Cast]
    fast_accum: bool = False


@dataclass(frozen=True)
class Recipe:
    output: Gemm
    grad_input: Gemm
    grad_weight: Gemm
    pow2_scales: bool = False


RECIPES = {
    "tensorwise": Recipe(
        output=Gemm(Cast(E4M3), Cast(E4M3), fast_accum=True),
        grad_input=Gemm(Cast(E5M2), Cast(E4M3)),
        grad_weight=Gemm(Cast(E5M2), Cast(E4M3)),
    ),
    "rowwise": Recipe(
        output=Gemm(Cast(E4M3, "axis"), Cast(E4M3, "axis"), fast_accum=True),
        grad_input=Gemm(Cast(E4M3, "axis"), Cast(E4M3, "axis")),
        grad_weight=Gemm(Cast(E4M3, "axis"), Cast(E4M3, "axis")),
        pow2_scales=True,
    ),
    "rowwise_with_gw_hp": Recipe(
        output=Gemm(Cast(E4M3, "axis"), Cast(E4M3, "axis"), fast_accum=True),
        grad_input=Gemm(Cast(E4M3, "axis"), Cast(E4M3, "tensor")),
        grad_weight=Gemm(None, None),
        pow2_scales=True,
    ),
}


def _scale_from_amax(amax, fp8_dtype, pow2=False):
    amax = amax.to(torch.float64)
    s = (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=1e-12)).to(torch.float32)
    if pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


def _quantize(t, cast, reduce_dim, pow2):
    """Cast a 2-D operand.  Axiswise scales are taken along `reduce_dim`,
    the GEMM's reduction dimension for this operand.  Returns (fp8, 1/scale)."""
    if cast.granularity == "axis":
        amax = torch.amax(t.abs(), dim=reduce_dim, keepdim=True)
    else:
        amax = torch.max(t.abs())
    s = _scale_from_amax(amax, cast.dtype, pow2)
    fmax = cast.clip if cast.clip is not None else torch.finfo(cast.dtype).max
    q = torch.clamp(t.to(torch.float32) * s, -fmax, fmax).to(cast.dtype)
    return q, s.reciprocal()


def _scaled_gemm(a_hp, b_hp, gemm, out_dtype, pow2):
    """a_hp [M,K] @ b_hp [K,N] under `gemm`'s casts."""
    if gemm.a is None:
        return torch.mm(a_hp, b_hp)
    a, sa = _quantize(a_hp, gemm.a, 1, pow2)
    b, sb = _quantize(b_hp, gemm.b, 0, pow2)
    a = a.contiguous()
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    axiswise = gemm.a.granularity == "axis" or gemm.b.granularity == "axis"
    if not axiswise:
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                                use_fast_accum=gemm.fast_accum)
    # one operand may be tensorwise: broadcast its scale to a vector
    sa = sa.expand(a.shape[0], 1) if sa.dim() == 0 else sa
    sb = sb.expand(1, b.shape[1]) if sb.dim() == 0 else sb
    kernel_out = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if gemm.fast_accum:
        out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=kernel_out,
                               use_fast_accum=True)
    else:
        unit = torch.ones((), dtype=torch.float32, device=a.device)
        out = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=kernel_out,
                               use_fast_accum=False)
        out = out * (sa * sb)
    return out.to(out_dtype)


class _Fp8LinearFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, recipe):
        ctx.recipe = recipe
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        y = _scaled_gemm(x2, weight.t(), recipe.output, x.dtype, recipe.pow2_scales)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        r = ctx.recipe
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx = _scaled_gemm(dy2, weight, r.grad_input, dy.dtype, r.pow2_scales)
        dw = _scaled_gemm(dy2.t(), x2, r.grad_weight, dy.dtype, r.pow2_scales)
        return dx.reshape(x.shape).to(x.dtype), dw.to(weight.dtype), None


class Fp8Linear(nn.Linear):
    recipe: Recipe

    def forward(self, x):
        y = _Fp8LinearFunction.apply(x, self.weight, self.recipe)
        if self.bias is not None:
            y = y + self.bias
        return y


def _swap(lin, recipe):
    with torch.device("meta"):
        new = Fp8Linear(lin.in_features, lin.out_features, bias=False)
    new.weight, new.bias = lin.weight, lin.bias
    new.recipe = recipe
    return new


def convert_linears(module, *, recipe=RECIPE, skip=None, prefix=""):
    """Swap every nn.Linear in `module` (or `module` itself) for Fp8Linear."""
    r = RECIPES[recipe] if isinstance(recipe, str) else recipe
    if type(module) is nn.Linear:
        return _swap(module, r)
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if type(child) is nn.Linear:
            if skip is None or not skip(full, child):
                setattr(module, name, _swap(child, r))
        else:
            convert_linears(child, recipe=r, skip=skip, prefix=full)
    return module
