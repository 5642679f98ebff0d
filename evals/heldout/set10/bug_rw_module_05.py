"""Rowwise FP8 linear, module form; the axiswise cast is a torch.library custom op returning (fp8, scale)."""
import os

import torch
import torch.nn as nn


@torch.library.custom_op("heldout10::rw_cast_" + os.path.basename(__file__)[:-3], mutates_args=())
def cast_axis(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(torch.float8_e4m3fn).max
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    s = (fmax / torch.clamp(amax, min=1e-12)).to(torch.float32)
    s = torch.exp2(torch.floor(torch.log2(s)))
    q = torch.clamp(t.to(torch.float32) * s, min=-fmax, max=fmax).to(torch.float8_e4m3fn)
    return q, s


@cast_axis.register_fake
def _(t, dim):
    shp = list(t.shape)
    shp[dim] = 1
    return torch.empty_like(t, dtype=torch.float8_e4m3fn), t.new_empty(shp, dtype=torch.float32)


def _scaled(a, sa, b, sb, dtype, fast_accum):
    """a [M,K] scales sa [M,1]; b [K,N] scales sb [1,N]; result in dtype (through bf16 for fp16/fp32)."""
    mm_dtype = dtype if dtype == torch.bfloat16 else torch.bfloat16
    a = a.contiguous()
    b = b.t().contiguous().t()
    ia, ib = sa.reciprocal(), sb.reciprocal()
    if fast_accum:
        r = torch._scaled_mm(a, b, ia, ib, out_dtype=mm_dtype, use_fast_accum=True)
    else:
        one = torch.ones([], device=a.device)
        r = torch._scaled_mm(a, b, one, one, out_dtype=mm_dtype, use_fast_accum=False)
        r = r.mul(ia * ib).to(mm_dtype)
    return r.to(dtype)


class _Op(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x_mk = x.reshape(-1, x.size(-1))
        xq, xs = cast_axis(x_mk, 1)
        wq, ws = cast_axis(weight, 1)
        y = _scaled(xq, xs, wq.t(), ws.t(), x.dtype, True)
        return y.reshape(x.shape[:-1] + (weight.size(0),))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy_mn = dy.reshape(-1, dy.size(-1))
        x_mk = x.reshape(-1, x.size(-1))
        dq, ds = cast_axis(dy_mn, 1)
        wq, ws = cast_axis(weight, 0)
        dx = _scaled(dq, ds, wq, ws, dy.dtype, False).reshape(x.shape)
        dq0, ds0 = cast_axis(dy_mn, 0)
        xq0, xs0 = cast_axis(x_mk, 0)
        dw = _scaled(dq0.view(dq0.shape[1], dq0.shape[0]), ds0.t(), xq0, xs0, dy.dtype, False)
        return dx.to(x.dtype), dw.to(weight.dtype)


class RowwiseLinear(nn.Linear):
    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            m = cls(linear.in_features, linear.out_features, bias=False)
        m.weight = linear.weight
        m.bias = linear.bias
        return m

    def forward(self, input):
        out = _Op.apply(input, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)
