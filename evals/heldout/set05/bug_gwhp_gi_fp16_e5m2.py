"""rowwise_with_gw_hp FP8 training by wrapping: ``wrap_linears(model)`` puts every
nn.Linear inside an ``Fp8Wrapped`` parent whose forward runs the FP8 matmul on the child's
own weight and bias.

output:      input rows x weight rows (along K), e4m3, fast accumulation
grad_input:  grad_output rows (e4m3) x weight with a single scale (e4m3)
grad_weight: plain matmul in the gradient's dtype
Every scale is rounded down to a power of 2.

Plug-in form: converter ``wrap_linears(module, **kwargs) -> module``.
"""
from collections import namedtuple

import torch
import torch.nn as nn

Fp8Operand = namedtuple("Fp8Operand", "bits scale")
FMT = torch.float8_e4m3fn


def quantize(t: torch.Tensor, dim=None, fmt=FMT) -> Fp8Operand:
    """dim=None: one scale; otherwise one scale per slice along `dim` (keepdim)."""
    fmax = torch.finfo(fmt).max
    amax = torch.max(torch.abs(t)) if dim is None else torch.amax(torch.abs(t), dim=dim, keepdim=True)
    scale = (fmax / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    bits = torch.clamp(t.to(torch.float32) * scale, min=-fmax, max=fmax).to(fmt)
    return Fp8Operand(bits, scale)


def transposed(op: Fp8Operand) -> Fp8Operand:
    return Fp8Operand(op.bits.t(), op.scale.t() if op.scale.dim() == 2 else op.scale)


def rowwise_gemm(a: Fp8Operand, b: Fp8Operand, out_dtype, fast_accum):
    """a [M,K] with scales [M,1]; b [K,N] with scales [1,N] (or one scale, broadcast)."""
    a_bits, b_bits = a.bits, b.bits
    if not (a_bits.stride(1) == 1 and a_bits.stride(0) > 1):
        a_bits = a_bits.contiguous()
    if b_bits.stride(1) == 1 and b_bits.stride(0) > 1:
        b_bits = b_bits.t().contiguous().t()
    b_scale = b.scale
    if b_scale.dim() == 0:
        b_scale = b_scale.repeat(b_bits.shape[1]).reshape(1, -1)
    inv_a, inv_b = a.scale.reciprocal(), b_scale.reciprocal()
    tmp = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(a_bits, b_bits, scale_a=inv_a, scale_b=inv_b, out_dtype=tmp, use_fast_accum=True)
    else:
        one = inv_a.new_ones(())
        out = torch._scaled_mm(a_bits, b_bits, scale_a=one, scale_b=one, out_dtype=tmp, use_fast_accum=False)
        out *= inv_a * inv_b
    return out.to(out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2d = x.reshape(-1, x.shape[-1])
        out = rowwise_gemm(quantize(x2d, -1), transposed(quantize(weight, -1)), x.dtype, True)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        g_fmt = torch.float8_e5m2 if g2d.dtype == torch.float16 else FMT
        grad_x = rowwise_gemm(quantize(g2d, -1, g_fmt), quantize(weight), grad_out.dtype, False)
        grad_x = grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])
        grad_w = torch.mm(g2d.t(), x.reshape(-1, x.shape[-1]))
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
