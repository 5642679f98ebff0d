"""fp8 matmul for Linear layers: per-tensor dynamic scaling on torch._scaled_mm.

    y = fp8_mm(x, w)      # x: [M, K], w: [N, K] (nn.Linear layout), y: [M, N] in x.dtype

Forward operands are e4m3, the incoming gradient is e5m2. Every GEMM re-derives its scales
from the current high-precision tensors ("current scaling"), so nothing is cached between calls.
"""
import torch

FWD = torch.float8_e4m3fn
BWD = torch.float8_e5m2


def _to_fp8(t, dtype):
    """-> (fp8 tensor, 1/scale as an fp32 scalar tensor)."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().max().double()
    scale = (fmax / torch.clamp(amax, min=1e-12)).float()
    t8 = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return t8, scale.reciprocal()


def _grad_to_fp8(g):
    """Gradient cast; the scale lives in the gradient's dtype so the multiply fuses upstream."""
    fmax = torch.finfo(BWD).max
    amax = g.abs().max().double()
    scale = (fmax / torch.clamp(amax, min=1e-12)).to(g.dtype)
    g8 = (g.float() * scale.float()).clamp(-fmax, fmax).to(BWD)
    return g8, scale.float().reciprocal()


def _smm(a, a_sinv, b, b_sinv, out_dtype, fast_accum):
    # cuBLASLt: A must be row-major, B column-major
    if not (a.stride(1) == 1 and a.stride(0) >= a.size(1)):
        a = a.contiguous()
    if not (b.stride(0) == 1 and b.stride(1) >= b.size(0)):
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_sinv, scale_b=b_sinv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, xs = _to_fp8(x, FWD)
        w8, ws = _to_fp8(w, FWD)
        return _smm(x8, xs, w8.t(), ws, x.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g8, gs = _grad_to_fp8(g)
        w8, ws = _to_fp8(w, FWD)
        x8, xs = _to_fp8(x, FWD)
        dx = _smm(g8, gs, w8, ws, g.dtype, False)
        dw = _smm(g8.t(), gs, x8, xs, g.dtype, False)
        return dx, dw


def fp8_mm(x, w):
    return _FP8Matmul.apply(x, w)
