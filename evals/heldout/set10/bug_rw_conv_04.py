"""Rowwise FP8 linear, converter form; a quantizer class holding the axis; N-D via flatten."""
import torch
import torch.nn as nn


class AxisQuantizer:
    def __init__(self, reduce_dim, dtype=torch.float8_e4m3fn):
        self.reduce_dim = reduce_dim
        self.dtype = dtype
        self.fmax = float(torch.finfo(dtype).max)

    def scale(self, t):
        amax = t.abs().amax(dim=self.reduce_dim, keepdim=True)
        s = self.fmax / amax.double().clamp(min=1e-12)
        s = s.float()
        return s.log2().floor().exp2()

    def __call__(self, t):
        s = self.scale(t)
        return (t.float() * s).clamp(-self.fmax, self.fmax).to(self.dtype), s


ALONG_LAST = AxisQuantizer(-1)
ALONG_FIRST = AxisQuantizer(0)


def _gemm(a, inv_a, b, inv_b, dtype, fast):
    tmp_dtype = torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype
    a = a if (a.stride(1) == 1 and a.stride(0) > 1) else a.contiguous()
    b = b if (b.stride(0) == 1 and b.stride(1) > 1) else b.t().contiguous().t()
    if fast:
        r = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=tmp_dtype,
                             use_fast_accum=True)
    else:
        ones = inv_a.new_ones(())
        r = torch._scaled_mm(a, b, scale_a=ones, scale_b=ones, out_dtype=tmp_dtype)
        r *= inv_a * inv_b
    return r.to(dtype)


class _RW(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xf = x.flatten(0, -2)
        xq, xs = ALONG_LAST(xf)
        wq, ws = ALONG_LAST(w)
        y = _gemm(xq, xs.reciprocal(), wq.t(), ws.reciprocal().t(), x.dtype, True)
        return y.unflatten(0, x.shape[:-1])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gf = gy.flatten(0, -2)
        xf = x.flatten(0, -2)
        gq, gs = ALONG_LAST(gf)
        wq, ws = ALONG_FIRST(w)
        gx = _gemm(gq, gs.reciprocal(), wq, ws.reciprocal(), gy.dtype, False)
        gq2, gs2 = ALONG_FIRST(gf)
        xq2, xs2 = ALONG_FIRST(xf)
        gw = _gemm(gq2.t(), gs2.reciprocal().t(), xq2, xs2.reciprocal(), gy.dtype, True)
        return gx.unflatten(0, x.shape[:-1]).to(x.dtype), gw.to(w.dtype)


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, x):
        out = _RW.apply(x, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out


def convert_to_rowwise(module, **kwargs):
    def make(lin):
        with torch.device("meta"):
            m = RowwiseFloat8Linear(lin.in_features, lin.out_features, bias=False)
        m.weight, m.bias = lin.weight, lin.bias
        return m
    if type(module) is nn.Linear:
        return make(module)
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, make(child))
        else:
            convert_to_rowwise(child)
    return module
