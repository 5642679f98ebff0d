"""Swap nn.Linear children for row-wise FP8 linears.

swap_linears(model) walks the module tree and replaces each nn.Linear child
by a RowwiseFP8Linear that shares its parameters; a bare nn.Linear passed as
the root is returned converted.
"""
import torch
from torch import nn

_F8 = torch.float8_e4m3fn
_F8_MAX = torch.finfo(_F8).max


def _pow2_scale(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double()
    s = (_F8_MAX / amax.clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def _q(t, dim):
    """float8 payload and inverse scale, amax taken along `dim` (kept)."""
    with torch.no_grad():
        s = _pow2_scale(t, dim)
        data = (t.float() * s).clamp(-_F8_MAX, _F8_MAX).to(_F8)
    return data, s.reciprocal()


def _mm(a, a_inv, b, b_inv, out_dtype, fast):
    # a: [m, k] (scale [m, 1]); b: [k, n] (scale [1, n])
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    mm_dtype = out_dtype if out_dtype == torch.bfloat16 else torch.bfloat16
    if fast:
        y = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv,
                             out_dtype=mm_dtype, use_fast_accum=True)
    else:
        unit = a_inv.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit,
                             out_dtype=mm_dtype, use_fast_accum=False)
        y *= a_inv * b_inv
    return y.to(out_dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x2 = x.view(x.shape[0], x.shape[-1])
        xd, xi = _q(x2, dim=1)
        wd, wi = _q(w, dim=1)
        y = _mm(xd, xi, wd.t(), wi.view(1, -1), x.dtype, fast=True)
        ctx.save_for_backward(x, w)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gd, gi = _q(dy2, dim=1)
            wd, wi = _q(w, dim=0)
            dx = _mm(gd, gi, wd, wi, dy.dtype, fast=False).reshape(*dy.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            gd, gi = _q(dy2, dim=0)
            xd, xi = _q(x2, dim=0)
            dw = _mm(gd.t(), gi.t(), xd, xi, dy.dtype, fast=False)
        return dx, dw


class RowwiseFP8Linear(nn.Linear):
    def forward(self, x):
        y = _Fn.apply(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, lin: nn.Linear):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight, new.bias = lin.weight, lin.bias
        return new


def swap_linears(model: nn.Module) -> nn.Module:
    if type(model) is nn.Linear:
        return RowwiseFP8Linear.from_float(model)
    for name, child in model.named_children():
        if type(child) is nn.Linear:
            setattr(model, name, RowwiseFP8Linear.from_float(child))
        else:
            swap_linears(child)
    return model
