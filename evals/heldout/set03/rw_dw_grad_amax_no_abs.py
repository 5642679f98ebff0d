"""Rowwise-scaled FP8 training linear, as an nn.Linear drop-in.

    layer = RowwiseFp8Linear.from_float(nn_linear)

Every operand is e4m3.  Each GEMM re-quantizes its operands from the
high-precision tensors with one scale per row of A and per column of B, taken
along that GEMM's reduction dimension; scales are rounded down to a power of
two.  The forward GEMM uses fast accumulation and applies the scales inside
_scaled_mm.  The backward GEMMs run with unit scales and the row/column scales
are multiplied into the result afterwards (the rowwise kernel without fast
accumulation is slow).  _scaled_mm has no fp16/fp32 rowwise output, so those
results are produced in bf16 and converted.
"""
import torch
import torch.nn as nn


class AxisQuantizer:
    """amax along one axis -> power-of-two scale -> saturating e4m3 cast."""

    eps = 1e-12

    def __init__(self, fp8_dtype=torch.float8_e4m3fn):
        self.fp8_dtype = fp8_dtype
        self.fp8_max = torch.finfo(fp8_dtype).max

    def scale(self, t, dim):
        amax = torch.amax(t.abs(), dim=dim, keepdim=True).to(torch.float64)
        s = (self.fp8_max / torch.clamp(amax, min=self.eps)).to(torch.float32)
        return torch.exp2(torch.floor(torch.log2(s)))

    def __call__(self, t, dim):
        s = self.scale(t, dim)
        q = (t.to(torch.float32) * s).clamp(-self.fp8_max, self.fp8_max).to(self.fp8_dtype)
        return q, s.reciprocal()


_q = AxisQuantizer()


class ColumnQuantizer(AxisQuantizer):
    """Column scales of the gradient (amax over tokens): reduce the [M, N]
    gradient directly instead of materializing |dy| first."""

    def scale(self, t, dim):
        amax = torch.amax(t, dim=dim, keepdim=True).to(torch.float64)
        s = (self.fp8_max / torch.clamp(amax, min=self.eps)).to(torch.float32)
        return torch.exp2(torch.floor(torch.log2(s)))


_q_cols = ColumnQuantizer()
_WIDE = (torch.float16, torch.float32)


def _as_col_major(t):
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _rowwise_mm(a, a_inv, b, b_inv, out_dtype, fast_accum):
    """a [M,K] fp8 with a_inv [M,1]; b [K,N] fp8 with b_inv [1,N]."""
    kernel_dtype = torch.bfloat16 if out_dtype in _WIDE else out_dtype
    a = a.contiguous()
    b = _as_col_major(b)
    if fast_accum:
        out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv,
                               out_dtype=kernel_dtype, use_fast_accum=True)
    else:
        post = a_inv * b_inv
        one = a_inv.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                               out_dtype=kernel_dtype, use_fast_accum=False)
        out *= post
    return out.to(out_dtype) if kernel_dtype != out_dtype else out


class _RowwiseLinearFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_inv = _q(x2, -1)                  # [M,1]
        wq, w_inv = _q(weight, -1)              # [N,1], per output row
        y = _rowwise_mm(xq, x_inv, wq.t(), w_inv.t(), x.dtype, True)
        return y.reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])

        # grad_input = dy @ W, reduction over N
        dyq, dy_inv = _q(dy2, -1)               # [M,1]
        wq, w_inv = _q(weight, 0)               # [1,K], per input column
        dx = _rowwise_mm(dyq, dy_inv, wq, w_inv, dy.dtype, False)

        # grad_weight = dy^T @ x, reduction over M
        dyq_t, dy_inv_t = _q_cols(dy2, 0)       # [1,N]
        xq_t, x_inv_t = _q(x2, 0)               # [1,K]
        dw = _rowwise_mm(dyq_t.t(), dy_inv_t.t(), xq_t, x_inv_t, dy.dtype, False)

        return dx.reshape(x.shape).to(x.dtype), dw.to(weight.dtype)


class RowwiseFp8Linear(nn.Linear):

    def forward(self, x):
        y = _RowwiseLinearFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        return new
