"""Rowwise FP8 linear that runs on both NVIDIA (e4m3fn) and AMD MI300 (e4m3fnuz) builds.

Weights are cast by their own helper so the (static-shape) weight cast can later be moved
to the optimizer step. The weight clamp uses the portable bound, which is safe on every
FP8 flavour."""
import torch
import torch.nn as nn

F8 = torch.float8_e4m3fn
PORTABLE_E4M3_MAX = min(torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e4m3fnuz).max)


def _pow2_floor(s):
    return torch.exp2(torch.floor(torch.log2(s)))


def cast_activation(t, dim):
    fmax = torch.finfo(F8).max
    amax = t.abs().amax(dim, keepdim=True).to(torch.float64).clamp(min=1e-12)
    scale = _pow2_floor((fmax / amax).to(torch.float32))
    return (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(F8), scale


def cast_weight(w, dim):
    amax = w.abs().amax(dim, keepdim=True).to(torch.float64).clamp(min=1e-12)
    scale = _pow2_floor((torch.finfo(F8).max / amax).to(torch.float32))
    q = (w.to(torch.float32) * scale).clamp(-PORTABLE_E4M3_MAX, PORTABLE_E4M3_MAX).to(F8)
    return q, scale


def scaled_mm(a, sa, b, sb, out_dtype, fast_accum):
    if not (a.stride(1) == 1 and a.stride(0) > 1):
        a = a.contiguous()
    if a.dim() == 2 and b.stride(1) == 1 and b.stride(0) > 1:
        b = b.t().contiguous().t()
    tmp_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        r = torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                             out_dtype=tmp_dtype, use_fast_accum=True)
    else:
        post = sa.reciprocal() * sb.reciprocal()
        u = sa.new_ones(())
        r = torch._scaled_mm(a, b, scale_a=u, scale_b=u, out_dtype=tmp_dtype, use_fast_accum=False)
        r *= post
    return r.to(out_dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = cast_activation(x, -1)
        wq, ws = cast_weight(w, -1)
        return scaled_mm(xq, xs, wq.t(), ws.t(), x.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gq, gs = cast_activation(g, -1)
        wq, ws = cast_activation(w, 0)
        dx = scaled_mm(gq, gs, wq, ws, g.dtype, False)
        gq0, gs0 = cast_activation(g, 0)
        xq0, xs0 = cast_activation(x, 0)
        dw = scaled_mm(gq0.t(), gs0.t(), xq0, xs0, g.dtype, False)
        return dx, dw


class PortableRowwiseLinear(nn.Linear):
    @classmethod
    def from_float(cls, lin):
        m = cls(lin.in_features, lin.out_features, bias=False, device="meta")
        m.weight = lin.weight
        m.bias = lin.bias
        return m

    def forward(self, x):
        lead = x.shape[:-1]
        y = _Fn.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
