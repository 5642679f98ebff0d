"""Rowwise FP8 converter (model -> model); the autograd.Function takes N-D inputs like torchao."""
import torch
from torch import nn

_E4M3 = torch.float8_e4m3fn
_MAX = torch.finfo(_E4M3).max
_EPS = 1e-12


def _scale(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double()
    s = (_MAX / amax.clamp(min=_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(t, s):
    return (t.float() * s).clamp(-_MAX, _MAX).to(_E4M3)


def _mm(a, sa, b, sb, dt, fast):
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    ia, ib = sa.reciprocal(), sb.reciprocal()
    odt = torch.bfloat16 if dt in (torch.float16, torch.float32) else dt
    if fast:
        y = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=odt, use_fast_accum=True)
    else:
        post = ia * ib
        y = torch._scaled_mm(a, b, scale_a=ia.new_ones(()), scale_b=ia.new_ones(()),
                             out_dtype=odt, use_fast_accum=False)
        y *= post
    return y.to(dt)


class _RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, state):
        ctx.save_for_backward(x, w)
        ctx.state = state
        x2 = x.reshape(-1, x.shape[-1])
        sx = _scale(x2, -1)
        sw = _scale(w, 1)
        y = _mm(_cast(x2, sx), sx, _cast(w, sw).t(), sw.t(), x.dtype, True)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        g2 = go.reshape(-1, go.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        sg = _scale(g2, -1)
        if "wq" not in ctx.state:
            ctx.state["wq"] = (_cast(w, _scale(w, 0)), _scale(w, 0))
        wq, sw = ctx.state["wq"]
        gx = _mm(_cast(g2, sg), sg, wq, sw, go.dtype, False)
        sg0 = _scale(g2, 0)
        sx0 = _scale(x2, 0)
        gw = _mm(_cast(g2, sg0).t(), sg0.t(), _cast(x2, sx0), sx0, go.dtype, False)
        return gx.reshape(x.shape), gw, None


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, x):
        y = _RowwiseMM.apply(x, self.weight, self._state)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def _swap(lin):
    with torch.device("meta"):
        new = RowwiseFloat8Linear(lin.in_features, lin.out_features, bias=False)
    new.weight = lin.weight
    new.bias = lin.bias
    new._state = {}
    return new


def convert(model: nn.Module) -> nn.Module:
    if type(model) is nn.Linear:
        return _swap(model)
    for name, child in list(model.named_children()):
        setattr(model, name, convert(child))
    return model
