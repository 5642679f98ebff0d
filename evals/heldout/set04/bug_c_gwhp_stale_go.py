"""rowwise_with_gw_hp FP8 training, converter form (author C: functional, F.scaled_mm).

``convert(module)`` re-classes every nn.Linear in place (its Parameters stay
where they are). output: rowwise e4m3 x rowwise e4m3 (fast accumulation);
grad_input: rowwise e4m3 grad_output x tensorwise e4m3 weight; grad_weight:
high-precision matmul. Power-of-2 scales.
"""
import functools

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
TINY = 1e-12
RowWise = F.ScalingType.RowWise
TensorWise = F.ScalingType.TensorWise


def pow2(s):
    return torch.exp2(torch.floor(torch.log2(s)))


def rowscale(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double().clamp(min=TINY)
    return pow2((FP8_MAX / amax).float())


def wholescale(t):
    amax = t.abs().max().double().clamp(min=TINY)
    return pow2((FP8_MAX / amax).float())


def quant(t, s):
    return (t.float() * s).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def row_major(t):
    return t if (t.stride(1) == 1 and t.stride(0) > 1) else t.contiguous()


def col_major(t):
    return t if not (t.stride(1) == 1 and t.stride(0) > 1) else t.t().contiguous().t()


def mm_rows(a, sa, b, sb, dtype, fused):
    ra, rb = sa.reciprocal(), sb.reciprocal()
    kdtype = torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype
    call = functools.partial(F.scaled_mm, row_major(a), col_major(b),
                             output_dtype=kdtype, use_fast_accum=fused)
    if fused:
        out = call(ra, RowWise, rb, RowWise)
    else:
        one = ra.new_ones(())
        out = call(one, TensorWise, one, TensorWise)
        out *= ra * rb
    return out if kdtype == dtype else out.to(dtype)


class GwHpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.owner = w
        x2 = x.reshape(-1, x.shape[-1])
        xs = rowscale(x2, 1)
        ws = rowscale(w, 1)
        y = mm_rows(quant(x2, xs), xs, quant(w, ws).t(), ws.t(), x.dtype, True)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gs = getattr(ctx.owner, "_last_grad_scale", None)
        if gs is None:
            gs = rowscale(g2, 1)
            ctx.owner._last_grad_scale = gs
        ws = wholescale(w)
        ws_cols = ws.repeat(w.shape[1]).reshape(1, -1)
        gx = mm_rows(quant(g2, gs), gs, quant(w, ws), ws_cols, gy.dtype, False)
        gx = gx.reshape(*gy.shape[:-1], gx.shape[-1])
        gw = torch.mm(g2.t(), x.reshape(-1, x.shape[-1]))
        return gx, gw


class GwHpLinear(nn.Linear):
    def forward(self, x):
        y = GwHpFn.apply(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def convert(module, **kwargs):
    if type(module) is nn.Linear:
        module.__class__ = GwHpLinear
        return module
    for child in module.children():
        convert(child)
    return module
