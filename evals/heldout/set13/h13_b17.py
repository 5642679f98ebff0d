"""[planted bug: The [N,K] weight is reinterpreted with reshape(K, N).t() instead of being used as stored (a view mistaken for a transpose).]

Rowwise FP8 linear, module form: ``RowwiseFp8Linear.from_float(nn.Linear)``.

Recipe (torchao 0.18 "rowwise"): input, weight and grad_output all e4m3; each GEMM
re-quantises its two operands from the saved high-precision tensors with one scale
per row of A and per column of B, the amax taken along that GEMM's inner dimension:
  output      = x [M,K] (amax over K)   @ W.T [K,N] (amax over K)   fast accumulation
  grad_input  = g [M,N] (amax over N)   @ W   [N,K] (amax over N)
  grad_weight = g.T [N,M] (amax over M) @ x   [M,K] (amax over M)
scale = 2**floor(log2(fp32(448 / max(amax, 1e-12)))).  The backward GEMMs run
_scaled_mm with unit scales and multiply the bf16 result by 1/sa * 1/sb afterwards
(torchao's non-fast-accum rowwise path); fp16/fp32 results are produced in bf16
and converted, as torchao does.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
FLOOR = 1e-12


def _pow2_scale(amax, fp8=E4M3):
    s = torch.finfo(fp8).max / torch.clamp(amax.to(torch.float64), min=FLOOR)
    return torch.exp2(torch.floor(torch.log2(s.to(torch.float32))))


def _rows(t, dim, fp8=E4M3, amax=None):
    """Quantise ``t`` with one scale per slice, reducing ``dim`` (keepdim)."""
    if amax is None:
        amax = torch.amax(torch.abs(t), dim=dim, keepdim=True)
    s = _pow2_scale(amax, fp8)
    top = torch.finfo(fp8).max
    return (t.to(torch.float32) * s).clamp(min=-top, max=top).to(fp8), s


def _rowwise_mm(a, sa, b, sb, out_dtype, fast):
    """a [m,k] row-major fp8 with sa [m,1]; b [k,n] column-major fp8 with sb [1,n]."""
    ia, ib = sa.reciprocal(), sb.reciprocal()
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast:
        out = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=mm_dtype,
                               use_fast_accum=True)
    else:
        one = ia.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=mm_dtype,
                               use_fast_accum=False)
        out *= ia * ib
    return out.to(out_dtype)


class _RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w8, sw):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = _rows(x2, -1)
        y = _rowwise_mm(x8.contiguous(), sx, w8.t(), sw.t(), x.dtype, True)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        # grad_input: scales along N
        g8, sg = _rows(g2, -1)
        wn8, swn = _rows(weight, 0)
        gx = _rowwise_mm(g8.contiguous(), sg, wn8.t().contiguous().t(), swn, g2.dtype, False)
        # grad_weight: scales along M
        gm8, sgm = _rows(g2, 0)
        xm8, sxm = _rows(x2, 0)
        gw = _rowwise_mm(gm8.t().contiguous(), sgm.t(), xm8.t().contiguous().t(), sxm,
                         g2.dtype, False)
        return gx.reshape(*grad.shape[:-1], gx.shape[-1]), gw, None, None


class RowwiseFp8Linear(nn.Linear):
    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x):
        w8, sw = _rows(self.weight.detach().reshape(self.in_features, -1).t(), 1)
        y = _RowwiseMM.apply(x, self.weight, w8.contiguous(), sw)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
