"""Tensorwise FP8 matmul for nn.Linear, compact autograd.Function style.

fp8_mm(x, w) == x @ w.T with input/weight in e4m3 and grad_output in e5m2.
"""
import torch

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@torch.no_grad()
def _act_to_fp8(x, fp8_dtype):
    # activations / grads: the scale is kept in the activation's dtype so that the
    # fused scale-multiply runs in the same precision as the tensor it scales
    fmax = torch.finfo(fp8_dtype).max
    amax = x.abs().max().to(torch.float64).clamp(min=1e-12)
    scale = (fmax / amax).to(x.dtype)
    x8 = (x.float() * scale.float()).clamp(-fmax, fmax).to(fp8_dtype)
    return x8, scale.float().reciprocal()


@torch.no_grad()
def _weight_to_fp8(w):
    fmax = torch.finfo(_E4M3).max
    amax = w.abs().max().to(torch.float64).clamp(min=1e-12)
    scale = (fmax / amax).float()
    return (w.float() * scale).clamp(-fmax, fmax).to(_E4M3), scale.reciprocal()


def _rm(t):
    return t if (t.stride(1) == 1 and t.stride(0) > 1) else t.contiguous()


def _cm(t):
    return t if (t.stride(0) == 1 and t.stride(1) > 1) else t.t().contiguous().t()


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, xs = _act_to_fp8(x, _E4M3)
        w8, ws = _weight_to_fp8(w)
        return torch._scaled_mm(_rm(x8), _cm(w8.t()), scale_a=xs, scale_b=ws,
                                out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g8, gs = _act_to_fp8(g, _E5M2)
        w8, ws = _weight_to_fp8(w)
        dx = torch._scaled_mm(_rm(g8), _cm(w8), scale_a=gs, scale_b=ws,
                              out_dtype=g.dtype, use_fast_accum=False)
        x8, xs = _act_to_fp8(x, _E4M3)
        dw = torch._scaled_mm(_rm(g8.t()), _cm(x8), scale_a=gs, scale_b=xs,
                              out_dtype=g.dtype, use_fast_accum=False)
        return dx, dw


def fp8_mm(x, w):
    return _FP8Matmul.apply(x, w)
