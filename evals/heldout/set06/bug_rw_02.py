"""Row-wise scaled FP8 linear (functional API).

    y = rowwise_linear(x, w, b)

Each GEMM re-quantizes its operands from high precision with one scale per
row of the left operand and one per column of the right operand, taken over
the GEMM's reduction dimension. Scales are powers of two. All operands,
gradients included, are e4m3.
"""
from typing import NamedTuple

import torch


class QTensor(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor          # multiplicative: data ~= hp * scale

    def t(self) -> "QTensor":
        return QTensor(self.data.t(), self.scale)

    def flat(self) -> "QTensor":
        k = self.data.shape[-1]
        return QTensor(self.data.reshape(-1, k), self.scale.reshape(-1, 1))


class RowwiseQuantizer:
    def __init__(self, dtype=torch.float8_e4m3fn, eps=1e-12, pow2=True):
        self.dtype = dtype
        self.eps = eps
        self.pow2 = pow2
        self.qmax = torch.finfo(dtype).max

    @torch.no_grad()
    def scale_for(self, hp: torch.Tensor, dim: int) -> torch.Tensor:
        amax = torch.amax(torch.abs(hp), dim=dim, keepdim=True)
        amax = amax.to(torch.float64)
        scale = (self.qmax / torch.clamp(amax, min=self.eps)).to(torch.float32)
        if self.pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return scale

    @torch.no_grad()
    def __call__(self, hp: torch.Tensor, dim: int) -> QTensor:
        scale = self.scale_for(hp, dim)
        data = (hp.to(torch.float32) * scale).clamp(-self.qmax, self.qmax).to(self.dtype)
        return QTensor(data, scale)


QUANT = RowwiseQuantizer()


def _row_major(t):
    return t.stride(1) == 1 and t.stride(0) > t.stride(1)


def scaled_mm_rowwise(a: QTensor, b: QTensor, out_dtype, fast_accum: bool):
    """a.data [M, K] with scale [M, 1]; b.data [K, N] with scale [1, N]."""
    a_data = a.data if _row_major(a.data) else a.data.contiguous()
    b_data = b.data.t().contiguous().t() if _row_major(b.data) else b.data
    a_inv, b_inv = a.scale.reciprocal(), b.scale.reciprocal()
    # torch._scaled_mm has no float32/float16 rowwise output: go through bf16
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(a_data, b_data, scale_a=a_inv, scale_b=b_inv,
                               out_dtype=mm_dtype, use_fast_accum=True)
    else:
        # the slow-accumulation rowwise kernel is slow: unit scales, rescale after
        post = a_inv * b_inv
        one = a_inv.new_ones(())
        out = torch._scaled_mm(a_data, b_data, scale_a=one, scale_b=one,
                               out_dtype=mm_dtype, use_fast_accum=False)
        out *= post
    return out.to(out_dtype)


class _RowwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq = QUANT(x, dim=-1).flat()            # per token, over K
        wq = QUANT(w.t(), dim=0)                 # per output feature, over K
        out = scaled_mm_rowwise(xq, wq, x.dtype, fast_accum=True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = QUANT(g, dim=-1)                # per token, over N
            wq = QUANT(w.t(), dim=-1).t()        # per input feature, over N
            grad_x = scaled_mm_rowwise(gq, wq, grad_out.dtype, fast_accum=False)
            grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        if ctx.needs_input_grad[1]:
            gq_t = QUANT(g, dim=0).t()           # per output feature, over M
            xq = QUANT(x2, dim=0)                # per input feature, over M
            grad_w = scaled_mm_rowwise(gq_t, xq, grad_out.dtype, fast_accum=False)
        return grad_x, grad_w


def rowwise_linear(input, weight, bias=None):
    out = _RowwiseLinear.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
