"""rowwise_with_gw_hp FP8 nn.Linear built on a small Quantizer class hierarchy.

output:      input rows x weight rows (along K), e4m3, fast accumulation
grad_input:  grad_output rows (e4m3) x weight with one scale (e4m3)
grad_weight: high precision (no fp8)
Scales rounded down to powers of 2.

Plug-in form: module ``Float8Linear`` (``Float8Linear.from_float(linear)``).
"""
import torch
import torch.nn as nn


class Quantizer:
    """Base class: one recipe's way of casting operands and running the three GEMMs."""

    round_pow2 = False

    def __init__(self, fmt=torch.float8_e4m3fn, grad_fmt=torch.float8_e4m3fn):
        self.fmt = fmt
        self.grad_fmt = grad_fmt

    # -- casting -------------------------------------------------------------------
    def amax(self, t, axis):
        if axis is None:
            return torch.max(torch.abs(t))
        return torch.amax(torch.abs(t), dim=axis, keepdim=True)

    def scale_from_amax(self, amax, fmt):
        amax = amax.to(torch.float64)
        s = (torch.finfo(fmt).max / torch.clamp(amax, min=1e-12)).to(torch.float32)
        if self.round_pow2:
            s = torch.exp2(torch.floor(torch.log2(s)))
        return s

    def cast(self, t, fmt, axis=None):
        s = self.scale_from_amax(self.amax(t, axis), fmt)
        lim = torch.finfo(fmt).max
        return (t.to(torch.float32) * s).clamp(min=-lim, max=lim).to(fmt), s

    # -- layouts the GPU kernels want ---------------------------------------------------
    @staticmethod
    def _is_row_major(t):
        return t.stride(0) > t.stride(1) and t.stride(1) == 1

    def as_lhs(self, t):
        return t if self._is_row_major(t) else t.contiguous()

    def as_rhs(self, t):
        return t.t().contiguous().t() if self._is_row_major(t) else t

    # -- the three GEMMs, per recipe -----------------------------------------------------
    def output(self, x2d, w):
        raise NotImplementedError

    def grad_input(self, g2d, w):
        raise NotImplementedError

    def grad_weight(self, g2d, x2d):
        raise NotImplementedError


class RowwiseHpQuantizer(Quantizer):
    round_pow2 = True

    def _mm_rows(self, a, sa, b, sb, out_dtype, fast):
        """a [M,K] with sa [M,1]; b [K,N] with sb [1,N]."""
        inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
        acc_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
        a, b = self.as_lhs(a), self.as_rhs(b)
        if fast:
            y = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=acc_dtype, use_fast_accum=True)
        else:
            unit = inv_a.new_ones(())
            y = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=acc_dtype, use_fast_accum=False)
            y *= inv_a * inv_b
        return y.to(out_dtype)

    def output(self, x2d, w):
        xq, xs = self.cast(x2d, self.fmt, axis=-1)
        wq, ws = self.cast(w, self.fmt, axis=-1)
        return self._mm_rows(xq, xs, wq.t(), ws.t(), x2d.dtype, True)

    def grad_input(self, g2d, w):
        gq, gs = self.cast(g2d, self.grad_fmt, axis=-1)
        wq, ws = self.cast(w, self.fmt, axis=None)
        ws_row = ws.repeat(wq.shape[1]).reshape(1, -1)
        return self._mm_rows(gq, gs, wq, ws_row, g2d.dtype, False)

    def grad_weight(self, g2d, x2d):
        return torch.mm(g2d.t(), x2d)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, quantizer):
        ctx.save_for_backward(x, weight)
        ctx.quantizer = quantizer
        x2d = x.reshape(-1, x.shape[-1])
        y = quantizer.output(x2d, weight)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        q = ctx.quantizer
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        gx = q.grad_input(g2d, weight).reshape(*grad_out.shape[:-1], weight.shape[1])
        gw = q.grad_weight(g2d, x.reshape(-1, x.shape[-1]))
        return gx, gw, None


class Float8Linear(nn.Linear):
    quantizer_cls = RowwiseHpQuantizer

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.quantizer = self.quantizer_cls()

    def forward(self, x):
        y = _LinearFn.apply(x, self.weight, self.quantizer)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        return new
