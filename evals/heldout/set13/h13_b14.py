"""[planted bug: Operands are rounded to bf16 before scaling, a double rounding for fp32 tensors (also shows with an fp32 weight).]

Tensorwise FP8 linear, converter form: ``swap_linears(module) -> module``.

Every nn.Linear inside ``module`` (or ``module`` itself) is replaced by a
``TensorwiseFp8Linear`` sharing the same weight and bias Parameters.

Recipe (torchao 0.18 "tensorwise"): e4m3 input and weight, e5m2 grad_output,
one float32 scale per tensor (fp8_max / amax in float64, amax floored at 1e-12),
fast accumulation only for the forward GEMM.  N-D inputs are flattened to
[tokens, in_features] for the three GEMMs.
"""
import torch
from torch import nn

FMT_FWD = torch.float8_e4m3fn
FMT_BWD = torch.float8_e5m2
TINY = 1e-12


class Quantized:
    """An fp8 payload, its quantisation scale and the value _scaled_mm wants (1/scale)."""

    def __init__(self, hp, fmt):
        amax = torch.max(torch.abs(hp)).to(torch.float64)
        self.scale = (torch.finfo(fmt).max / torch.clamp(amax, min=TINY)).to(torch.float32)
        lim = torch.finfo(fmt).max
        scaled = hp.to(torch.bfloat16).to(torch.float32) * self.scale
        self.data = scaled.clamp(min=-lim, max=lim).to(fmt)
        self.inv = self.scale.reciprocal()


def _gemm(a, b, a_data, b_data, out_dtype, fast):
    return torch._scaled_mm(a_data, b_data, scale_a=a.inv, scale_b=b.inv,
                            out_dtype=out_dtype, use_fast_accum=fast)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, qw):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.lead, ctx.qw = x.shape[:-1], qw
        qx = Quantized(x2, FMT_FWD)
        y = _gemm(qx, qw, qx.data.contiguous(), qw.data.contiguous().t(), x.dtype, True)
        return y.reshape(*ctx.lead, y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        qg = Quantized(g2, FMT_BWD)
        qw = ctx.qw
        gx = _gemm(qg, qw, qg.data.contiguous(), qw.data.t().contiguous().t(), g2.dtype, False)
        qx = Quantized(x2, FMT_FWD)
        gw = _gemm(qg, qx, qg.data.t().contiguous(), qx.data.t().contiguous().t(), g2.dtype, False)
        return gx.reshape(*ctx.lead, gx.shape[-1]), gw, None


class TensorwiseFp8Linear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x):
        qw = Quantized(self.weight.detach(), FMT_FWD)
        y = _Fn.apply(x, self.weight, qw)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def swap_linears(module: nn.Module, **kwargs) -> nn.Module:
    if isinstance(module, nn.Linear):
        return TensorwiseFp8Linear(module)
    for name, child in module.named_children():
        setattr(module, name, swap_linears(child))
    return module
