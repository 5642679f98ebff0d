"""Row-wise scaled FP8 matmul, functional API.

    out = rowwise_fp8_mm(x, w)    # x [M, K], w [N, K] -> [M, N], differentiable in x and w

All operands e4m3; one power-of-two scale per row of the left operand and per column of the
right operand, both taken along the GEMM's inner dimension.
"""
import torch

_F8 = torch.float8_e4m3fn
_F8_MAX = torch.finfo(_F8).max

# the rowwise CUTLASS kernel writes bf16 (or the caller's bf16); wider outputs are cast after
_MM_OUT = {torch.bfloat16: torch.bfloat16, torch.float16: torch.bfloat16,
           torch.float32: torch.bfloat16}


def _pow2_floor(s):
    return torch.exp2(torch.floor(torch.log2(s)))


def _scale(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double()
    return _pow2_floor((_F8_MAX / amax.clamp(min=1e-12)).float())


_ACT_AMAX_FLOOR = 1e-2   # padding / near-empty tokens must not blow up the scale


def _quant_act(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double()
    s = _pow2_floor((_F8_MAX / amax.clamp(min=_ACT_AMAX_FLOOR)).float())
    return (t.float() * s).clamp(-_F8_MAX, _F8_MAX).to(_F8), s.reciprocal()


def _quant_weight(w, dim):
    s = _scale(w, dim)
    return (w.float() * s).clamp(-_F8_MAX, _F8_MAX).to(_F8), s.reciprocal()


def _quant_grad(g, dim):
    s = _scale(g, dim)
    return (g.float() * s).clamp(-_F8_MAX, _F8_MAX).to(_F8), s.reciprocal()


def _gemm(a, sa, b, sb, out_dtype, fast):
    a = a if (a.stride(1) == 1 and a.stride(0) >= a.size(1)) else a.contiguous()
    b = b if (b.stride(0) == 1 and b.stride(1) >= b.size(0)) else b.t().contiguous().t()
    mm_dtype = _MM_OUT[out_dtype]
    if fast:
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=mm_dtype, use_fast_accum=True)
    else:
        one = sa.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=mm_dtype,
                             use_fast_accum=False)
        y *= sa * sb
    return y if mm_dtype == out_dtype else y.to(out_dtype)


class _RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = _quant_act(x, 1)
        wq, ws = _quant_weight(w, 1)
        return _gemm(xq, xs, wq.t(), ws.t(), x.dtype, fast=True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gq, gs = _quant_grad(g, 1)
        wq, ws = _quant_weight(w, 0)
        dx = _gemm(gq, gs, wq, ws, g.dtype, fast=False)
        gq_t, gs_t = _quant_grad(g, 0)
        xq_t, xs_t = _quant_act(x, 0)
        dw = _gemm(gq_t.t(), gs_t.t(), xq_t, xs_t, g.dtype, fast=False)
        return dx, dw


def rowwise_fp8_mm(x, w):
    return _RowwiseMM.apply(x, w)
