"""Tensorwise FP8 linear as a plain differentiable function (autograd.Function)."""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def _to_fp8(x, dtype):
    fmax = torch.finfo(dtype).max
    amax = x.abs().max().to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=1e-12)).to(torch.float32)
    xs = x.to(torch.float32) * scale
    return xs.clamp(-fmax, fmax).to(dtype), scale.reciprocal()


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x_fp8, x_inv = _to_fp8(x, E4M3)
        w_fp8, w_inv = _to_fp8(w, E4M3)
        return torch._scaled_mm(
            x_fp8.contiguous(), w_fp8.contiguous().t(),
            scale_a=x_inv, scale_b=w_inv,
            out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        go_fp8, go_inv = _to_fp8(grad_out, E4M3)
        w_fp8, w_inv = _to_fp8(w, E4M3)
        grad_x = torch._scaled_mm(
            go_fp8.contiguous(), w_fp8.t().contiguous().t(),
            scale_a=go_inv, scale_b=w_inv,
            out_dtype=grad_out.dtype, use_fast_accum=False)
        x_fp8, x_inv = _to_fp8(x, E4M3)
        grad_w = torch._scaled_mm(
            go_fp8.t().contiguous(), x_fp8.t().contiguous().t(),
            scale_a=go_inv, scale_b=x_inv,
            out_dtype=grad_out.dtype, use_fast_accum=False)
        return grad_x, grad_w


def fp8_linear(input, weight, bias=None):
    lead = input.shape[:-1]
    out = _Fp8Matmul.apply(input.reshape(-1, input.shape[-1]), weight)
    out = out.reshape(*lead, out.shape[-1])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
