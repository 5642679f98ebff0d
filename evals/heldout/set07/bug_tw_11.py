"""Tensorwise FP8 nn.Linear drop-in built on small quantizer objects and a ScaledFp8 pair."""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ScaledFp8:
    data: torch.Tensor
    scale: torch.Tensor

    def t(self):
        return ScaledFp8(self.data.t(), self.scale)

    def row_major(self):
        return ScaledFp8(self.data.contiguous(), self.scale)

    def col_major(self):
        return ScaledFp8(self.data.t().contiguous().t(), self.scale)


class Float8Quantizer:
    eps = 1e-12

    def __init__(self, fp8_dtype):
        self.fp8_dtype = fp8_dtype
        self.max_value = torch.finfo(fp8_dtype).max

    @torch.no_grad()
    def scale_for(self, t):
        amax = torch.max(torch.abs(t)).to(torch.float64)
        target = torch.finfo(self.fp8_dtype).max
        return (target / torch.clamp(amax, min=self.eps)).to(torch.float32)

    @torch.no_grad()
    def __call__(self, t):
        scale = self.scale_for(t)
        scaled = t.to(torch.float32) * scale
        data = scaled.clamp(min=-self.max_value, max=self.max_value).to(self.fp8_dtype)
        return ScaledFp8(data, scale)


def scaled_gemm(a: ScaledFp8, b: ScaledFp8, out_dtype, use_fast_accum):
    return torch._scaled_mm(
        a.data,
        b.data,
        scale_a=a.scale.reciprocal(),
        scale_b=b.scale.reciprocal(),
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )


class _TensorwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, q_input, q_weight, q_grad):
        ctx.save_for_backward(x, weight)
        ctx.quantizers = (q_input, q_weight, q_grad)
        x2 = x.view(-1, x.shape[-1])
        xq = q_input(x2).row_major()
        wq = q_weight(weight)
        out = scaled_gemm(xq, wq.t().col_major(), x.dtype, use_fast_accum=True)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        q_input, q_weight, q_grad = ctx.quantizers
        go2 = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        goq = q_grad(go2)
        wq = q_weight(weight)
        grad_input = scaled_gemm(goq, wq.col_major(), grad_output.dtype, use_fast_accum=False)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], weight.shape[1])

        xq = q_input(x.reshape(-1, x.shape[-1]))
        grad_weight = scaled_gemm(
            goq.t().row_major(), xq.col_major(), grad_output.dtype, use_fast_accum=False
        )
        return grad_input, grad_weight, None, None, None


class TwFloat8Linear(nn.Linear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.q_input = Float8Quantizer(torch.float8_e4m3fn)
        self.q_weight = Float8Quantizer(torch.float8_e4m3fn)
        self.q_grad = Float8Quantizer(torch.float8_e5m2)

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def forward(self, input):
        out = _TensorwiseLinearFn.apply(
            input, self.weight, self.q_input, self.q_weight, self.q_grad
        )
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out
