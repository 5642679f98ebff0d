"""Rowwise FP8 linear, function form (author C: functional, torch.nn.functional.scaled_mm).

``rowwise_linear(input_2d, weight)``. Scales: one per row along the GEMM's inner
dimension, power-of-2, e4m3 for all operands including grad_output. The output
GEMM fuses the row scales (fast accumulation); the backward GEMMs run with unit
scales and multiply the outer product of the inverse scales afterwards.
"""
import functools

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
TINY = 1e-12
RowWise = F.ScalingType.RowWise
TensorWise = F.ScalingType.TensorWise


def rowscale(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double().clamp(min=TINY)
    return torch.exp2(torch.floor(torch.log2((FP8_MAX / amax).float())))


def quant(t, dim):
    s = rowscale(t, dim)
    return (t.float() * s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def row_major(t):
    return t if (t.stride(1) == 1 and t.stride(0) > 1) else t.contiguous()


def col_major(t):
    return t if not (t.stride(1) == 1 and t.stride(0) > 1) else t.t().contiguous().t()


def mm_rows(a, sa, b, sb, dtype, fused):
    """a [M, K] scaled per row (sa [M, 1]); b [K, N] scaled per column (sb [1, N])."""
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


class RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = quant(x, 1)
        wq, ws = quant(w, 1)
        return mm_rows(xq, xs, wq.t(), ws.t(), x.dtype, True)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gq, gs = quant(gy, 1)
        wq, ws = quant(w, 0)
        gx = mm_rows(gq, gs, wq, ws, gy.dtype, False)
        gtq, gts = quant(gy, 0)
        xq, xs = quant(x, 0)
        gw = mm_rows(xq.t(), xs.t(), gtq, gts, gy.dtype, False).view(w.shape)
        return gx, gw


def rowwise_linear(input_2d, weight):
    return RowwiseLinearFn.apply(input_2d, weight)
