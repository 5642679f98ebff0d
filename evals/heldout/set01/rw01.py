"""Rowwise-scaled FP8 linear (e4m3 everywhere, power-of-two scales).

Each GEMM quantizes its operands along the GEMM's reduction dim: one scale per row of A,
one per column of B."""
import torch

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max


def rowwise_quant(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).float()
    scale = F8_MAX / amax
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.float() * scale).clamp(-F8_MAX, F8_MAX).to(F8)
    return q, scale


def _a(t):
    return t if t.stride(1) == 1 and t.stride(0) > 1 else t.contiguous()


def _b(t):
    return t if t.stride(0) == 1 and t.stride(1) > 1 else t.t().contiguous().t()


def _hp(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


def mm_fast(a8, sa, b8, sb, out_dtype):
    out = torch._scaled_mm(_a(a8), _b(b8), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                           out_dtype=_hp(out_dtype), use_fast_accum=True)
    return out.to(out_dtype)


def mm_accurate(a8, sa, b8, sb, out_dtype):
    one = torch.ones((), device=a8.device)
    out = torch._scaled_mm(_a(a8), _b(b8), scale_a=one, scale_b=one,
                           out_dtype=_hp(out_dtype), use_fast_accum=False)
    out *= sa.reciprocal() * sb.reciprocal()
    return out.to(out_dtype)


class RowwiseFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = rowwise_quant(x, -1)
        wq, ws = rowwise_quant(w, -1)
        return mm_fast(xq, xs, wq.t(), ws.t(), x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gq, gs = rowwise_quant(go, -1)
        wq, ws = rowwise_quant(w, 0)
        dx = mm_accurate(gq, gs, wq, ws, go.dtype)
        gq0, gs0 = rowwise_quant(go, 0)
        xq0, xs0 = rowwise_quant(x, 0)
        dw = mm_accurate(gq0.t(), gs0.t(), xq0, xs0, go.dtype)
        return dx, dw


def rowwise_fp8_linear(x, w):
    return RowwiseFp8Linear.apply(x, w)
