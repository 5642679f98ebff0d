"""Tensorwise FP8 linear as a single differentiable function.

fp8_linear(input, weight, bias=None) behaves like F.linear, but the three
GEMMs run through torch._scaled_mm with one dynamic scale per tensor:
e4m3 for input and weight, e5m2 for the incoming gradient.
"""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


@torch.no_grad()
def _quantize(t, fp8_dtype):
    """Return (fp8 data, inverse scale) for one tensor-wide scale."""
    fmax = torch.finfo(fp8_dtype).max
    amax = torch.max(torch.abs(t)).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=_EPS)).to(torch.float32)
    data = (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)
    return data, scale.reciprocal()


def _lhs(t):
    # cuBLASLt wants the first operand row-major
    if t.stride(1) == 1 and t.stride(0) > t.stride(1):
        return t
    return t.contiguous()


def _rhs(t):
    # ... and the second one column-major
    if t.stride(1) == 1 and t.stride(0) > t.stride(1):
        return t.t().contiguous().t()
    return t


def _gemm(a, a_inv, b, b_inv, out_dtype, fast):
    return torch._scaled_mm(
        _lhs(a), _rhs(b), scale_a=a_inv, scale_b=b_inv,
        out_dtype=out_dtype, use_fast_accum=fast,
    )


class _Fp8MatmulTW(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x_f8, x_inv = _quantize(x, E4M3)
        w_f8, w_inv = _quantize(w, E4M3)
        ctx.save_for_backward(x, w)
        return _gemm(x_f8, x_inv, w_f8.t(), w_inv, x.dtype, True)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g_f8, g_inv = _quantize(grad_out, E4M3)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_f8, w_inv = _quantize(w, E4M3)
            w_t = w_f8.t()
            grad_x = _gemm(g_f8, g_inv, w_t.t(), w_inv, grad_out.dtype, False)
        if ctx.needs_input_grad[1]:
            x_f8, x_inv = _quantize(x, E4M3)
            grad_w = _gemm(g_f8.t(), g_inv, x_f8, x_inv, grad_out.dtype, False)
        return grad_x, grad_w


def fp8_linear(input, weight, bias=None):
    lead = input.shape[:-1]
    x2d = input.reshape(-1, input.shape[-1])
    out = _Fp8MatmulTW.apply(x2d, weight)
    out = out.reshape(*lead, out.shape[-1])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
