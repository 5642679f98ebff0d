"""Tensorwise FP8 linear as a plain autograd.Function with small helpers (author A).

Function form: ``fp8_linear(input_2d, weight) -> output``.
input [M, K] @ weight[N, K].T, e4m3 for input and weight, e5m2 for grad_output,
one dynamic scale per tensor, fast accumulation only for the output GEMM.
"""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


def _scale_of(t, fp8_dtype):
    amax = torch.max(torch.abs(t)).to(torch.float64)
    return (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=_EPS)).to(torch.float32)


def _cast(t, scale, fp8_dtype):
    top = torch.finfo(E4M3).max
    return (t.to(torch.float32) * scale).clamp(min=-top, max=top).to(fp8_dtype)


def _quantize(t, fp8_dtype):
    s = _scale_of(t, fp8_dtype)
    return _cast(t, s, fp8_dtype), s


def _is_row_major(t):
    st = t.stride()
    return st[0] > st[1] and st[1] == 1


def _lhs(t):
    return t if _is_row_major(t) else t.contiguous()


def _rhs(t):
    return t.t().contiguous().t() if _is_row_major(t) else t


def _gemm(a8, a_scale, b8, b_scale, out_dtype, fast_accum):
    return torch._scaled_mm(
        _lhs(a8),
        _rhs(b8),
        scale_a=a_scale.reciprocal(),
        scale_b=b_scale.reciprocal(),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


class _TensorwiseFP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, sx = _quantize(x, E4M3)
        w8, sw = _quantize(w, E4M3)
        return _gemm(x8, sx, w8.t(), sw, x.dtype, True)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g8, sg = _quantize(grad_out, E5M2)
        w8, sw = _quantize(w, E4M3)
        grad_x = _gemm(g8, sg, w8, sw, grad_out.dtype, False)
        x8, sx = _quantize(x, E4M3)
        grad_w = _gemm(g8.t(), sg, x8, sx, grad_out.dtype, False)
        return grad_x, grad_w


def fp8_linear(input_2d, weight):
    return _TensorwiseFP8Matmul.apply(input_2d, weight)
