"""Tensorwise FP8 linear, function form, helper-heavy style.

Recipe (torchao "tensorwise"): input and weight e4m3, grad_output e5m2, one
dynamic scale per tensor (scale = fp8_max / max(amax, 1e-12), computed in
float64 and stored as float32), torch._scaled_mm takes the inverse scales.
Fast accumulation on the output GEMM only. The forward saves the
high-precision input and weight and every GEMM re-quantizes them.
"""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


def _fp8_max(dtype):
    return torch.finfo(dtype).max


def _amax(t):
    return torch.max(torch.abs(t))


def _scale_from_amax(amax, dtype):
    amax64 = amax.to(torch.float64)
    return (_fp8_max(dtype) / torch.clamp(amax64, min=_EPS)).to(torch.float32)


def _saturate(t, dtype):
    m = _fp8_max(dtype)
    return t.clamp(min=-m, max=m).to(dtype)


def _to_fp8(t, dtype):
    """Returns (fp8 data, inverse scale)."""
    scale = _scale_from_amax(_amax(t), dtype)
    data = _saturate(t.to(torch.float32) * scale, dtype)
    return data, scale.reciprocal()


def _row_major(t):
    return t if (t.stride(1) == 1 and t.stride(0) > t.stride(1)) else t.contiguous()


def _col_major(t):
    return t if (t.stride(0) == 1 and t.stride(1) > t.stride(0)) else t.t().contiguous().t()


def _gemm(a, a_inv, b, b_inv, out_dtype, fast_accum):
    return torch._scaled_mm(
        _row_major(a),
        _col_major(b),
        scale_a=a_inv,
        scale_b=b_inv,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


class _TensorwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        xq, x_inv = _to_fp8(x2d, E4M3)
        wq, w_inv = _to_fp8(weight, E4M3)
        return _gemm(xq, x_inv, wq.t(), w_inv, x2d.dtype, True)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        gq, g_inv = _to_fp8(grad_out, E5M2)
        wq, w_inv = _to_fp8(weight, E4M3)
        grad_x = _gemm(gq, g_inv, wq, w_inv, grad_out.dtype, False)
        xq, x_inv = _to_fp8(x2d, E4M3)
        grad_w = _gemm(gq.t(), g_inv, xq, x_inv, grad_out.dtype, False)
        return grad_x, grad_w


def fp8_linear(input, weight, bias=None):
    lead = input.shape[:-1]
    out = _TensorwiseLinearFn.apply(input.reshape(-1, input.shape[-1]), weight)
    out = out.reshape(*lead, out.shape[-1])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
