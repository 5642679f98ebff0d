"""Rowwise FP8 linear, module form (author A: autograd.Function + helpers).

``RowwiseFp8Linear.from_float(linear)`` shares the linear's Parameters.
Every GEMM re-quantizes its operands from high precision along its own inner
dimension (e4m3 everywhere, power-of-2 scales). Only the output GEMM uses fast
accumulation; the other two apply the product of the row scales after the GEMM.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
_EPS = 1e-12


def _pow2_scale(t, dim):
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    s = (torch.finfo(E4M3).max / amax).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(t, scale):
    top = torch.finfo(E4M3).max
    return (t.to(torch.float32) * scale).clamp(min=-top, max=top).to(E4M3)


def _quantize_along(t, dim):
    s = _pow2_scale(t, dim)
    return _cast(t, s), s


def _is_row_major(t):
    st = t.stride()
    return st[0] > st[1] and st[1] == 1


def _lhs(t):
    return t if _is_row_major(t) else t.contiguous()


def _rhs(t):
    return t.t().contiguous().t() if _is_row_major(t) else t


def _rowwise_gemm(a8, a_scale, b8, b_scale, out_dtype, fast_accum):
    """a8 [M, K] with a_scale [M, 1]; b8 [K, N] with b_scale [1, N]."""
    inv_a = a_scale.reciprocal()
    inv_b = b_scale.reciprocal()
    post = None
    if not fast_accum:
        post = inv_a * inv_b
        inv_a = inv_a.new_ones(())
        inv_b = inv_a.new_ones(())
    kernel_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(
        _lhs(a8), _rhs(b8), scale_a=inv_a, scale_b=inv_b,
        out_dtype=kernel_dtype, use_fast_accum=fast_accum,
    )
    if post is not None:
        out *= post
    if kernel_dtype != out_dtype:
        out = out.to(out_dtype)
    return out


class _RowwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = _quantize_along(x2, -1)
        w8, sw = _quantize_along(w, 1)
        out = _rowwise_gemm(x8, sx, w8.t(), sw.t(), x.dtype, True)
        return out.reshape(*lead, out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        # grad_input = grad_out @ w, inner dim N
        g8, sg = _quantize_along(g2, -1)
        wn8, swn = _quantize_along(w, 0)
        grad_x = _rowwise_gemm(g8, sg, wn8, swn, grad_out.dtype, False)
        grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        # grad_weight = grad_out.T @ x, inner dim M
        x2 = x.reshape(-1, x.shape[-1])
        gm8, sgm = _quantize_along(g2, 0)
        xm8, sxm = _quantize_along(x2, 0)
        grad_w = _rowwise_gemm(gm8.t(), sgm.t(), xm8, sxm, grad_out.dtype, False)
        return grad_x, grad_w


class RowwiseFp8Linear(nn.Linear):
    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            mod = cls(linear.in_features, linear.out_features, bias=False)
        mod.weight = linear.weight
        mod.bias = linear.bias
        return mod

    def forward(self, x):
        y = _RowwiseFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
