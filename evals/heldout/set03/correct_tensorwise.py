"""Tensorwise FP8 matmul for a linear layer, function form.

    out = fp8_linear(x_2d, weight)      # x_2d [M, K], weight [N, K] -> [M, N]

Dynamic per-tensor scaling: input and weight in e4m3, the incoming gradient
in e5m2.  All three GEMMs go through torch._scaled_mm; the forward GEMM uses
fast accumulation, the two backward GEMMs do not.
"""
import torch

F8_FWD = torch.float8_e4m3fn
F8_BWD = torch.float8_e5m2
AMAX_FLOOR = 1e-12


def _cast(t, f8):
    """Scale `t` into the range of `f8`; return (fp8 data, inverse scale)."""
    top = torch.finfo(f8).max
    amax = t.abs().max().double()
    scale = (top / torch.clamp(amax, min=AMAX_FLOOR)).float()
    data = (t.float() * scale).clamp(-top, top).to(f8)
    return data, scale.reciprocal()


def _colmajor(t):
    # cuBLASLt wants the right-hand operand column-major
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _mm(a, a_inv, b, b_inv, out_dtype, fast):
    return torch._scaled_mm(
        a.contiguous(), _colmajor(b),
        scale_a=a_inv, scale_b=b_inv,
        out_dtype=out_dtype, use_fast_accum=fast,
    )


class _Fp8Matmul(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, x_inv = _cast(x, F8_FWD)
        w8, w_inv = _cast(w, F8_FWD)
        return _mm(x8, x_inv, w8.t(), w_inv, x.dtype, True)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g8, g_inv = _cast(grad_out, F8_BWD)
        w8, w_inv = _cast(w, F8_FWD)
        x8, x_inv = _cast(x, F8_FWD)
        # dX = dY @ W
        grad_x = _mm(g8, g_inv, w8, w_inv, grad_out.dtype, False)
        # dW = dY^T @ X
        grad_w = _mm(g8.t(), g_inv, x8, x_inv, grad_out.dtype, False)
        return grad_x.to(x.dtype), grad_w.to(w.dtype)


def fp8_linear(x, weight):
    return _Fp8Matmul.apply(x, weight)
