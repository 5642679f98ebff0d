"""Rowwise FP8 matmul for a linear layer, function form.

    out = fp8_linear_rowwise(x_2d, weight)      # x_2d [M, K], weight [N, K]

All operands e4m3.  Every GEMM quantizes its two operands along the GEMM's
reduction dim (scale_a [rows, 1], scale_b [1, cols]), power-of-two scales.
Forward: scales inside _scaled_mm with fast accumulation.  Backward: unit
scales in the kernel, scales multiplied into the bf16 result afterwards.
"""
import torch

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max


def _cast(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double()
    s = (F8_MAX / torch.clamp(amax, min=1e-12)).float()
    s = torch.exp2(torch.floor(torch.log2(s)))
    return (t.float() * s).clamp(-F8_MAX, F8_MAX).to(F8), s.reciprocal()


def _colmajor(t):
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _kernel_dtype(dt):
    return torch.bfloat16 if dt in (torch.float16, torch.float32) else dt


def _mm_fast(a, sa, b, sb, out_dtype):
    y = torch._scaled_mm(a.contiguous(), _colmajor(b), scale_a=sa, scale_b=sb,
                         out_dtype=_kernel_dtype(out_dtype), use_fast_accum=True)
    return y.float() if out_dtype == torch.float32 else y


def _mm_exact(a, sa, b, sb, out_dtype):
    one = torch.ones((), dtype=torch.float32, device=a.device)
    y = torch._scaled_mm(a.contiguous(), _colmajor(b), scale_a=one, scale_b=one,
                         out_dtype=_kernel_dtype(out_dtype), use_fast_accum=False)
    y *= sa * sb
    return y.to(out_dtype)


class _RowwiseMatmul(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, sx = _cast(x, 1)          # [M,1]
        w8, sw = _cast(w, 1)          # [N,1]
        return _mm_fast(x8, sx, w8.t(), sw.t(), x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g8, sg = _cast(g, 1)          # [M,1]
        wk8, swk = _cast(w, 0)        # [1,K]
        grad_x = _mm_exact(g8, sg, wk8, swk, g.dtype)
        gm8, sgm = _cast(g, 0)        # [1,N]
        xm8, sxm = _cast(x, 0)        # [1,K]
        grad_w = _mm_exact(gm8.t(), sgm.t(), xm8, sxm, g.dtype)
        return grad_x.to(x.dtype), grad_w.to(w.dtype)


def fp8_linear_rowwise(x, weight):
    return _RowwiseMatmul.apply(x, weight)
