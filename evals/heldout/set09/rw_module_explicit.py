"""Rowwise FP8 linear, module form, explicit step-by-step style.

Recipe (torchao "rowwise"): input, weight and grad_output all e4m3; every GEMM
re-quantizes its operands from the saved high-precision tensors with one scale
per row of A and per column of B along that GEMM's inner dimension; scales are
rounded down to powers of two. _scaled_mm has no fp16/fp32 rowwise output, so
the GEMM writes bf16 and the result is cast to the caller's dtype. Output GEMM:
fast accumulation with the scales inside _scaled_mm. Gradient GEMMs: unit scales
inside _scaled_mm and the outer product of inverse scales applied afterwards
(in place, on the bf16 result).
"""
import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12


def _pow2_scale(amax):
    s = (FP8_MAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _gemm_dtype(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


def _colmajor(t):
    return t if t.stride(0) == 1 else t.t().contiguous().t()


class _RowwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)

        # step 1: input, one scale per row (along K)
        x_amax = x2.abs().amax(dim=1, keepdim=True)
        x_s = _pow2_scale(x_amax)
        x_q = (x2.to(torch.float32) * x_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)

        # step 2: weight, one scale per output row (along K)
        w_amax = w.abs().amax(dim=1, keepdim=True)
        w_s = _pow2_scale(w_amax)
        w_q = (w.to(torch.float32) * w_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)

        # step 3: scaled GEMM, bf16 (or the input dtype) out, fast accumulation
        y = torch._scaled_mm(
            x_q.contiguous(),
            _colmajor(w_q.t()),
            scale_a=x_s.reciprocal(),
            scale_b=w_s.reciprocal().t(),
            out_dtype=_gemm_dtype(x.dtype),
            use_fast_accum=True,
        )
        y = y.to(x.dtype)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        n = grad_out.shape[-1]
        k = x.shape[-1]
        g2 = grad_out.reshape(-1, n)
        x2 = x.reshape(-1, k)
        one = torch.ones((), dtype=torch.float32, device=g2.device)
        mm_dtype = _gemm_dtype(grad_out.dtype)

        # grad_input = grad_out @ w, inner dim N
        g_s = _pow2_scale(g2.abs().amax(dim=1, keepdim=True))          # [M, 1]
        g_q = (g2.to(torch.float32) * g_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        wn_s = _pow2_scale(w.abs().amax(dim=0, keepdim=True))          # [1, K]
        wn_q = (w.to(torch.float32) * wn_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        gi = torch._scaled_mm(g_q.contiguous(), _colmajor(wn_q), scale_a=one, scale_b=one,
                              out_dtype=mm_dtype, use_fast_accum=False)
        gi.mul_(g_s.reciprocal() * wn_s.reciprocal())
        grad_x = gi.to(grad_out.dtype).reshape(x.shape)

        # grad_weight = grad_out.T @ x, inner dim M
        gm_s = _pow2_scale(g2.abs().amax(dim=0, keepdim=True))         # [1, N]
        gm_q = (g2.to(torch.float32) * gm_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        xm_s = _pow2_scale(x2.abs().amax(dim=0, keepdim=True))         # [1, K]
        xm_q = (x2.to(torch.float32) * xm_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        gw = torch._scaled_mm(gm_q.t().contiguous(), _colmajor(xm_q), scale_a=one, scale_b=one,
                              out_dtype=mm_dtype, use_fast_accum=False)
        gw.mul_(gm_s.reciprocal().t() * xm_s.reciprocal())
        grad_w = gw.to(grad_out.dtype)
        return grad_x, grad_w


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, input):
        out = _RowwiseFn.apply(input, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            mod = cls(linear.in_features, linear.out_features, bias=False)
        mod.weight = linear.weight
        mod.bias = linear.bias
        return mod
