"""Tensorwise FP8 linear tuned for throughput.

All three GEMMs use cuBLASLt's fast-accumulation mode (the backward GEMMs are as large as
the forward one, so they benefit the same ~1.1-1.2x)."""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
GEMM_FAST_ACCUM = {"fprop": True, "dgrad": True, "wgrad": True}


def quant(t: torch.Tensor, dtype: torch.dtype):
    m = torch.finfo(dtype).max
    amax = torch.max(torch.abs(t)).to(torch.float64)
    s = (m / torch.clamp(amax, min=1e-12)).to(torch.float32)
    return torch.clamp(t.to(torch.float32) * s, min=-m, max=m).to(dtype), s


def scaled_gemm(kind, a, sa, b, sb, out_dtype):
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=GEMM_FAST_ACCUM[kind])


class FastFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = quant(x, E4M3)
        wq, ws = quant(w.t(), E4M3)
        return scaled_gemm("fprop", xq, xs, wq, ws, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dyq, dys = quant(dy, E5M2)
        wq, ws = quant(w, E4M3)
        dx = scaled_gemm("dgrad", dyq, dys, wq, ws, dy.dtype)
        xq, xs = quant(x, E4M3)
        dw = scaled_gemm("wgrad", dyq.t(), dys, xq, xs, dy.dtype)
        return dx, dw


def fast_fp8_linear(x, w):
    return FastFp8Linear.apply(x, w)
