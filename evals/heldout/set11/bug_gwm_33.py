"""[planted bug: grad_input is transposed before being reshaped back to the input's shape.] rowwise_with_gw_hp FP8 linear, module form: HpGradWeightFloat8Linear.from_float(linear)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

_F8 = torch.float8_e4m3fn
_MAX = torch.finfo(_F8).max
_EPS = 1e-12


def _scale_from_amax(amax):
    amax = amax.double().clamp(min=_EPS)
    sc = (_MAX / amax).float()
    return torch.exp2(torch.floor(torch.log2(sc)))


def _cast(t, sc):
    return (t.float() * sc).clamp(min=-_MAX, max=_MAX).to(_F8)


def _mm_rows(a, sa, b, sb, dtype, fast):
    if not (a.stride(0) > a.stride(1) and a.stride(1) == 1):
        a = a.contiguous()
    if b.stride(0) > b.stride(1) and b.stride(1) == 1:
        b = b.t().contiguous().t()
    ra, rb = sa.reciprocal(), sb.reciprocal()
    if fast:
        acc_dtype = torch.bfloat16 if dtype != torch.bfloat16 else dtype
        r = torch._scaled_mm(a, b, scale_a=ra, scale_b=rb, out_dtype=acc_dtype, use_fast_accum=True)
        return r.to(dtype)
    post = ra * rb
    one = ra.new_ones(())
    r = torch._scaled_mm(a, b, scale_a=one, scale_b=ra.new_ones(()), out_dtype=torch.bfloat16,
                         use_fast_accum=False)
    r *= post
    return r.to(dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xs = _scale_from_amax(x.abs().amax(-1, keepdim=True))
        ws = _scale_from_amax(w.abs().amax(-1, keepdim=True))
        xq, wq = _cast(x, xs), _cast(w, ws)
        k = x.size(-1)
        y = _mm_rows(xq.reshape(-1, k), xs.reshape(-1, 1), wq.t(), ws.t(), x.dtype, True)
        return y.view(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g = gy.reshape(-1, gy.size(-1))
        gs = _scale_from_amax(g.abs().amax(-1, keepdim=True))
        gq = _cast(g, gs)
        wts = _scale_from_amax(torch.max(torch.abs(w)))
        wq = _cast(w, wts)
        gx = _mm_rows(gq, gs, wq, wts.repeat(w.size(1)).reshape(1, -1), g.dtype, False)
        gx = gx.t().reshape(*gy.shape[:-1], w.size(1))
        gw = torch.mm(g.t(), x.reshape(-1, x.size(-1)))
        return gx, gw


class HpGradWeightFloat8Linear(nn.Linear):
    def forward(self, x):
        y = _Fn.apply(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, lin):
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None,
                device="meta", dtype=lin.weight.dtype)
        m.weight = lin.weight
        m.bias = lin.bias
        return m
