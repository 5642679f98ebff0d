"""Tensorwise FP8 training linear, as an nn.Linear drop-in.

    layer = Fp8Linear.from_float(nn_linear)

One dynamic scale per tensor.  Forward: input x weight in e4m3 with fast
accumulation.  Backward: the gradient in e5m2 against e4m3 weight / input,
without fast accumulation.
"""
import torch
import torch.nn as nn


class TensorQuantizer:
    """amax over the whole tensor -> scale -> saturating cast."""

    eps = 1e-12

    def __init__(self, fp8_dtype):
        self.fp8_dtype = fp8_dtype
        self.fp8_max = torch.finfo(fp8_dtype).max

    def scale(self, t):
        amax = torch.max(torch.abs(t)).to(torch.float64)
        return (self.fp8_max / torch.clamp(amax, min=self.eps)).to(torch.float32)

    def __call__(self, t):
        s = self.scale(t)
        q = (t.to(torch.float32) * s).clamp(-self.fp8_max, self.fp8_max).to(self.fp8_dtype)
        return q, s.reciprocal()


act_q = TensorQuantizer(torch.float8_e4m3fn)
weight_q = TensorQuantizer(torch.float8_e4m3fn)
class GradQuantizer(TensorQuantizer):
    """Gradients: the scale is computed on-device in the gradient's own dtype
    (no float64 round trip in the backward pass)."""

    def scale(self, t):
        amax = torch.max(torch.abs(t))
        return (self.fp8_max / torch.clamp(amax, min=self.eps)).to(torch.float32)


grad_q = GradQuantizer(torch.float8_e5m2)


def _as_col_major(t):
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _gemm(a, a_inv, b, b_inv, out_dtype, fast_accum):
    return torch._scaled_mm(a.contiguous(), _as_col_major(b), scale_a=a_inv, scale_b=b_inv,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _Fp8LinearFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_inv = act_q(x2)
        wq, w_inv = weight_q(weight)
        y = _gemm(xq, x_inv, wq.t(), w_inv, x.dtype, True)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gq, g_inv = grad_q(dy2)
        wq, w_inv = weight_q(weight)
        dx = _gemm(gq, g_inv, wq, w_inv, dy.dtype, False)
        xq, x_inv = act_q(x2)
        dw = _gemm(gq.t(), g_inv, xq, x_inv, dy.dtype, False)
        return dx.reshape(x.shape).to(x.dtype), dw.to(weight.dtype)


class Fp8Linear(nn.Linear):

    def forward(self, x):
        y = _Fp8LinearFn.apply(x, self.weight)
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
