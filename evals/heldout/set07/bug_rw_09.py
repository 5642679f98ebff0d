"""Rowwise FP8 nn.Linear drop-in with a class-based caster and NamedTuple operands."""
from typing import NamedTuple

import torch
from torch import nn


class RowwiseCast:
    def __init__(self, fp8_dtype=torch.float8_e4m3fn, eps=1e-12):
        self.fp8_dtype = fp8_dtype
        self.fmax = torch.finfo(fp8_dtype).max
        self.eps = eps

    @torch.no_grad()
    def scale(self, t, dim):
        amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
        s = (self.fmax / torch.clamp(amax, min=self.eps)).to(torch.float32)
        return torch.exp2(torch.floor(torch.log2(s)))

    @torch.no_grad()
    def cast(self, t, scale):
        scaled = t.to(torch.float32) * scale
        return scaled.clamp(min=-self.fmax, max=self.fmax).to(self.fp8_dtype)


class Operand(NamedTuple):
    data: torch.Tensor
    inv_scale: torch.Tensor


def _row_major(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _col_major(t):
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _gemm(a: Operand, b: Operand, out_dtype, fast_accum):
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(
            a.data, b.data, scale_a=a.inv_scale, scale_b=b.inv_scale,
            out_dtype=mm_dtype, use_fast_accum=True,
        )
    else:
        one = a.inv_scale.new_ones(())
        out = torch._scaled_mm(
            a.data, b.data, scale_a=one, scale_b=one, out_dtype=mm_dtype, use_fast_accum=False
        )
        out *= a.inv_scale * b.inv_scale
    return out.to(out_dtype)


class _RowwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, caster, fast_accum_output):
        ctx.caster = caster
        ctx.save_for_backward(x, weight)
        k = x.shape[-1]
        xs = caster.scale(x, -1)
        xq = caster.cast(x, xs).reshape(-1, k)
        xs = xs.movedim(0, -2).reshape(-1, 1)
        ws = caster.scale(weight, -1)
        wq = caster.cast(weight, ws)
        a = Operand(_row_major(xq), xs.reciprocal())
        b = Operand(_col_major(wq.t()), ws.t().reciprocal())
        out = _gemm(a, b, x.dtype, fast_accum_output)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        caster = ctx.caster
        x, weight = ctx.saved_tensors
        go2 = grad_output.reshape(-1, grad_output.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])

        gos = caster.scale(go2, -1)
        goq = caster.cast(go2, gos)
        ws = caster.scale(weight, 0)
        wq = caster.cast(weight, ws)
        grad_input = _gemm(
            Operand(_row_major(goq), gos.reciprocal()),
            Operand(_col_major(wq), ws.reciprocal()),
            grad_output.dtype, False,
        ).reshape(x.shape)

        gos_m = caster.scale(go2, 0)
        goq_m = caster.cast(go2, gos_m)
        xs_m = caster.scale(x2, 0)
        xq_m = caster.cast(x2, xs_m)
        grad_weight = _gemm(
            Operand(_row_major(goq_m.t()), gos_m.t().reciprocal()),
            Operand(_col_major(xq_m), xs_m.reciprocal()),
            grad_output.dtype, False,
        )
        return grad_input, grad_weight, None, None


class Float8RowwiseLinear(nn.Linear):
    caster = RowwiseCast(torch.float8_e4m3fn)
    fast_accum_output = True

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def forward(self, input):
        out = _RowwiseFn.apply(input, self.weight, self.caster, self.fast_accum_output)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out
