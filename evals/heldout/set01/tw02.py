"""Drop-in FP8 nn.Linear (dynamic tensorwise scaling) with a small recipe config."""
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Fp8Recipe:
    fwd_dtype: torch.dtype = torch.float8_e4m3fn   # input and weight
    bwd_dtype: torch.dtype = torch.float8_e4m3fn   # grad_output
    amax_eps: float = 1e-12
    fast_accum_fwd: bool = True
    fast_accum_bwd: bool = False


def _quantize(t, dtype, eps):
    fmax = torch.finfo(dtype).max
    amax = torch.amax(torch.abs(t)).double()
    scale = (fmax / torch.clamp(amax, min=eps)).float()
    data = torch.clamp(t.float() * scale, -fmax, fmax).to(dtype)
    return data, scale


def _gemm(a, a_scale, b, b_scale, out_dtype, fast):
    # cuBLASLt wants A row-major and B column-major
    if not (a.stride(1) == 1 and a.stride(0) > 1):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > 1:
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=fast)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, recipe):
        ctx.recipe = recipe
        ctx.save_for_backward(inp, weight)
        i8, i_s = _quantize(inp, recipe.fwd_dtype, recipe.amax_eps)
        w8, w_s = _quantize(weight, recipe.fwd_dtype, recipe.amax_eps)
        return _gemm(i8, i_s, w8.t(), w_s, inp.dtype, recipe.fast_accum_fwd)

    @staticmethod
    def backward(ctx, grad_out):
        r = ctx.recipe
        inp, weight = ctx.saved_tensors
        g8, g_s = _quantize(grad_out, r.bwd_dtype, r.amax_eps)
        w8, w_s = _quantize(weight, r.fwd_dtype, r.amax_eps)
        i8, i_s = _quantize(inp, r.fwd_dtype, r.amax_eps)
        grad_in = _gemm(g8, g_s, w8, w_s, grad_out.dtype, r.fast_accum_bwd)
        grad_w = _gemm(g8.t(), g_s, i8, i_s, grad_out.dtype, r.fast_accum_bwd)
        return grad_in, grad_w, None


class Fp8Linear(nn.Linear):
    recipe = Fp8Recipe()

    def forward(self, x):
        shape = x.shape
        y = _Fp8LinearFunction.apply(x.reshape(-1, shape[-1]), self.weight, self.recipe)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, mod):
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = mod.in_features, mod.out_features
        new.weight = mod.weight
        new.bias = mod.bias
        return new
