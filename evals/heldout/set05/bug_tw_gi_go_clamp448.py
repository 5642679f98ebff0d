"""Tensorwise FP8 nn.Linear built on a small Quantizer class hierarchy.

Plug-in form: module ``Float8Linear`` (``Float8Linear.from_float(linear)``).
"""
import torch
import torch.nn as nn


class Quantizer:
    """Base class: one recipe's way of casting operands and running the three GEMMs."""

    def __init__(self, fmt=torch.float8_e4m3fn, grad_fmt=torch.float8_e5m2):
        self.fmt = fmt
        self.grad_fmt = grad_fmt

    # -- casting -------------------------------------------------------------------
    def amax(self, t, axis):
        raise NotImplementedError

    def scale_from_amax(self, amax, fmt):
        amax = amax.to(torch.float64)
        return (torch.finfo(fmt).max / torch.clamp(amax, min=1e-12)).to(torch.float32)

    def cast(self, t, fmt, axis=None):
        s = self.scale_from_amax(self.amax(t, axis), fmt)
        lim = torch.finfo(self.fmt).max
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


class TensorwiseQuantizer(Quantizer):
    def amax(self, t, axis):
        return torch.max(torch.abs(t))

    def _mm(self, a, sa, b, sb, out_dtype, fast):
        return torch._scaled_mm(
            self.as_lhs(a), self.as_rhs(b),
            scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
            out_dtype=out_dtype, use_fast_accum=fast,
        )

    def output(self, x2d, w):
        xq, xs = self.cast(x2d, self.fmt)
        wq, ws = self.cast(w, self.fmt)
        return self._mm(xq, xs, wq.t(), ws, x2d.dtype, True)

    def grad_input(self, g2d, w):
        gq, gs = self.cast(g2d, self.grad_fmt)
        wq, ws = self.cast(w, self.fmt)
        return self._mm(gq, gs, wq, ws, g2d.dtype, False)

    def grad_weight(self, g2d, x2d):
        gq, gs = self.cast(g2d, self.grad_fmt)
        xq, xs = self.cast(x2d, self.fmt)
        return self._mm(gq.t(), gs, xq, xs, g2d.dtype, False)


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
    quantizer_cls = TensorwiseQuantizer

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
