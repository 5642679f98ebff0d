"""Tensorwise FP8 training by wrapping: ``wrap_linears(model)`` puts every nn.Linear inside
an ``Fp8Wrapped`` parent whose forward runs the FP8 matmul on the child's own weight and
bias (the child keeps its Parameters; nothing is copied).

Plug-in form: converter ``wrap_linears(module, **kwargs) -> module``.
"""
from collections import namedtuple

import torch
import torch.nn as nn

Fp8Operand = namedtuple("Fp8Operand", "bits scale")
FWD_FMT = torch.float8_e4m3fn
BWD_FMT = torch.float8_e5m2


def quantize(t: torch.Tensor, fmt: torch.dtype) -> Fp8Operand:
    fmax = torch.finfo(fmt).max
    amax = torch.max(torch.abs(t))
    scale = (fmax / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    bits = torch.clamp(t.to(torch.float32) * scale, min=-fmax, max=fmax).to(fmt)
    return Fp8Operand(bits, scale)


def transposed(op: Fp8Operand) -> Fp8Operand:
    return Fp8Operand(op.bits.t(), op.scale)


def scaled_gemm(a: Fp8Operand, b: Fp8Operand, out_dtype, fast_accum):
    """a @ b with a handed over row-major and b column-major."""
    a_bits, b_bits = a.bits, b.bits
    if not (a_bits.stride(1) == 1 and a_bits.stride(0) > 1):
        a_bits = a_bits.contiguous()
    if b_bits.stride(1) == 1 and b_bits.stride(0) > 1:
        b_bits = b_bits.t().contiguous().t()
    return torch._scaled_mm(
        a_bits,
        b_bits,
        scale_a=a.scale.reciprocal(),
        scale_b=b.scale.reciprocal(),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2d = x.reshape(-1, x.shape[-1])
        out = scaled_gemm(quantize(x2d, FWD_FMT), transposed(quantize(weight, FWD_FMT)), x.dtype, True)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        g8 = quantize(g2d, BWD_FMT)
        grad_x = scaled_gemm(g8, quantize(weight, FWD_FMT), grad_out.dtype, False)
        grad_x = grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])
        x8 = quantize(x.reshape(-1, x.shape[-1]), FWD_FMT)
        grad_w = scaled_gemm(transposed(g8), x8, grad_out.dtype, False)
        return grad_x, grad_w


class Fp8Wrapped(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        lin = self.linear
        out = _Fp8LinearFn.apply(x, lin.weight)
        if lin.bias is not None:
            out = out + lin.bias.to(out.dtype)
        return out


def wrap_linears(module: nn.Module, **kwargs) -> nn.Module:
    if isinstance(module, nn.Linear):
        return Fp8Wrapped(module)
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Fp8Wrapped(child))
        elif not isinstance(child, Fp8Wrapped):
            wrap_linears(child, **kwargs)
    return module
