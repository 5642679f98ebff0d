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


def _as_kn(w, k):
    """Weights arrive as [N, K] (nn.Linear) or already as [K, N] (exported checkpoints)."""
    if w.shape[0] == k:
        return w, False
    return w.t(), True


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
        w_kn, ctx.w_is_nk = _as_kn(w, x.shape[1])
        ctx.save_for_backward(x, w_kn)
        x8, xs = _to_fp8(x, FWD)
        w8, ws = _to_fp8(w_kn, FWD)
        return _smm(x8, xs, w8, ws, x.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x, w_kn = ctx.saved_tensors
        g8, gs = _to_fp8(g, BWD)
        w8, ws = _to_fp8(w_kn, FWD)
        x8, xs = _to_fp8(x, FWD)
        dx = _smm(g8, gs, w8.t(), ws, g.dtype, False)
        dw = _smm(g8.t(), gs, x8, xs, g.dtype, False)      # [N, K]
        return dx, (dw if ctx.w_is_nk else dw.t())


def fp8_mm(x, w):
    return _FP8Matmul.apply(x, w)
