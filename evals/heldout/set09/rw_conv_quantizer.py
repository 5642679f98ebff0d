"""Rowwise FP8 linear, converter form, class-based axiswise quantizer.

`AxiswiseCast(dim)` quantizes a 2-D tensor to e4m3 with one power-of-2 scale per
slice along `dim` (the GEMM's inner dimension). Each GEMM casts its own
operands from the saved high-precision input and weight. `swap_linears`
replaces nn.Linear children (or a bare nn.Linear) by RowwiseLinear.
"""
import torch
from torch import nn


class AxiswiseCast:
    dtype = torch.float8_e4m3fn
    eps = 1e-12

    def __init__(self, dim):
        self.dim = dim  # reduce along this dim (keepdim)
        self.fmax = torch.finfo(self.dtype).max

    def scale(self, t):
        amax = torch.amax(torch.abs(t), dim=self.dim, keepdim=True)
        s = self.fmax / torch.clamp(amax.to(torch.float64), min=self.eps)
        s = s.to(torch.float32)
        return torch.exp2(torch.floor(torch.log2(s)))

    def __call__(self, t):
        s = self.scale(t)
        q = torch.clamp(t.to(torch.float32) * s, min=-self.fmax, max=self.fmax).to(self.dtype)
        return q, s


ALONG_ROWS = AxiswiseCast(dim=1)   # one scale per row: an A operand, or a weight read as [N, K]
ALONG_COLS = AxiswiseCast(dim=0)   # one scale per column


def _mm_rowwise(a, a_s, b, b_s, out_dtype, fast_accum):
    """a [M, K] with a_s [M, 1]; b [K, N] with b_s [1, N] (scales, not inverses)."""
    a = a if a.is_contiguous() else a.contiguous()
    b = b if b.t().is_contiguous() else b.t().contiguous().t()
    a_inv, b_inv = a_s.reciprocal(), b_s.reciprocal()
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        y = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype, use_fast_accum=True)
    else:
        unit = a_inv.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=mm_dtype, use_fast_accum=False)
        y *= a_inv * b_inv
    return y.to(out_dtype)


class _RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        xq, xs = ALONG_ROWS(x2d)
        wq, ws = ALONG_ROWS(weight)                      # [N, K], scales [N, 1]
        return _mm_rowwise(xq, xs, wq.t(), ws.t(), x2d.dtype, True)

    @staticmethod
    def backward(ctx, gy):
        x2d, weight = ctx.saved_tensors
        gq, gs = ALONG_ROWS(gy)                          # [M, N], scales [M, 1]
        wq, ws = ALONG_COLS(weight)                      # [N, K], scales [1, K]
        dx = _mm_rowwise(gq, gs, wq, ws, gy.dtype, False)
        gq0, gs0 = ALONG_COLS(gy)                        # scales [1, N]
        xq0, xs0 = ALONG_COLS(x2d)                       # scales [1, K]
        dw = _mm_rowwise(gq0.t(), gs0.t(), xq0, xs0, gy.dtype, False)
        return dx, dw


class RowwiseLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        y = _RowwiseMM.apply(flat, self.weight)
        y = y.unflatten(0, x.shape[:-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)


def swap_linears(module, **kwargs):
    if type(module) is nn.Linear:
        return RowwiseLinear(module)
    for name, child in module.named_children():
        new = swap_linears(child, **kwargs)
        if new is not child:
            setattr(module, name, new)
    return module
