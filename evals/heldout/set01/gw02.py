"""Converter to the "rowwise_with_gw_hp" FP8 recipe, implemented as a functional
`gwhp_linear(input, weight, bias)` (mirrors F.linear) plus a thin module around it."""
import torch
import torch.nn as nn

_F8 = torch.float8_e4m3fn
_MAX = torch.finfo(_F8).max


def _pow2(s):
    return torch.exp2(torch.floor(torch.log2(s)))


def _axiswise(t, dim):
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    s = _pow2((_MAX / torch.clamp(amax, min=1e-12)).to(torch.float32))
    return torch.clamp(t.to(torch.float32) * s, -_MAX, _MAX).to(_F8), s


def _tensorwise(t):
    amax = torch.max(torch.abs(t)).to(torch.float64)
    s = _pow2((_MAX / torch.clamp(amax, min=1e-12)).to(torch.float32))
    return torch.clamp(t.to(torch.float32) * s, -_MAX, _MAX).to(_F8), s


def _launch(a, b, sa, sb, out_dtype, fast):
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    mmdt = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast:
        r = torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                             out_dtype=mmdt, use_fast_accum=True)
    else:
        o = sa.new_ones(())
        r = torch._scaled_mm(a, b, scale_a=o, scale_b=o, out_dtype=mmdt, use_fast_accum=False)
        r *= sa.reciprocal() * sb.reciprocal()
    return r.to(out_dtype)


class _Mm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_t):
        ctx.save_for_backward(x, w_t)
        x8, sx = _axiswise(x, -1)
        w8, sw = _axiswise(w_t, 0)
        return _launch(x8, w8, sx, sw, x.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x, w_t = ctx.saved_tensors
        g8, sg = _axiswise(g, -1)
        w8, sw = _tensorwise(w_t)
        gi = _launch(g8, w8.t(), sg, sw.repeat(w_t.shape[0]).reshape(1, -1), g.dtype, False)
        gw_t = torch.mm(g.t(), x).t()
        return gi, gw_t


def gwhp_linear(input, weight, bias=None):
    x2 = input.reshape(-1, input.shape[-1])
    out = _Mm.apply(x2, weight.t())
    return out.reshape(*input.shape[:-1], out.shape[-1])


class GwHpLinear(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return gwhp_linear(x, self.weight)


def convert_gwhp(module, **kwargs):
    if isinstance(module, nn.Linear):
        return GwHpLinear(module.weight, module.bias)
    for n, c in list(module.named_children()):
        setattr(module, n, convert_gwhp(c))
    return module
