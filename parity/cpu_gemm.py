"""A fast CPU kernel for torch._scaled_mm, used while the harness runs implementations on a CPU.

No CPU has FP8 arithmetic: torch's CPU _scaled_mm is itself an emulation, and in torch 2.13 a
slow one (measured on a 2-core machine: 64x1280x1280 took 3.4 s, an fp32 matmul of the same
shape 1.9 ms). While active, FastScaledMM computes tensorwise and rowwise _scaled_mm calls on
the CPU as the same emulation done with the fast kernels: the fp8 operands converted to fp32
(exact), one fp32 matmul (products of two fp8 values are exact in fp32; the sum is an fp32
accumulation, like torch's kernel and within parity.oracles' bound), the inverse scales
multiplied into the result, then the bias, then the cast to out_dtype. With unit scales this
is bitwise torch's own CPU result (measured); with other scales torch's kernel rounds the
scaling in another order, so the last fp32 bit can differ. The operands are multiplied in one
layout (A row-major, B column-major, the GPU contract's), whatever strides they came with: the
same values give the same bits, as on a GPU, where any other layout is rejected.

The harness runs every implementation of a case under the same kernel, so two implementations
that make the same calls stay bitwise equal, and the accumulation bound holds as before. Calls
it does not handle (block scales, scale_result, a non-fp8 operand, CUDA tensors) go to torch
unchanged. Set FP8_PARITY_CPU_SCALED_MM=torch to use torch's kernel throughout.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity.contract import custom_op_kernel

aten = torch.ops.aten
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def enabled() -> bool:
    return os.environ.get("FP8_PARITY_CPU_SCALED_MM", "fast") != "torch"


def _fast(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """The emulation, or None when the call is not one it handles."""
    if (a.device.type != "cpu" or a.dtype not in _FP8 or b.dtype not in _FP8 or scale_result is not None
            or a.dim() != 2 or b.dim() != 2 or scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32):
        return None
    M, N = a.shape[0], b.shape[1]
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (M, 1) and tuple(scale_b.shape) == (1, N)
    if not (tensorwise or rowwise) or a.shape[1] != b.shape[0]:
        return None
    if rowwise and (scale_a.stride(1) != 1 or scale_b.stride(1) != 1):
        return None  # torch's kernel rejects these scales ("expected scale_a.stride(1) to be 1"): let it say so
    # In the GPU contract's layout whatever strides the call came with: the CPU matmul's summation
    # order follows the operands' memory layout, so two implementations passing the same values with
    # other (valid) strides would differ in the last bit on a CPU and not on a GPU.
    out = a.to(torch.float32).contiguous() @ b.to(torch.float32).t().contiguous().t()
    out = out * (scale_a.reshape(()) * scale_b.reshape(())) if tensorwise else out * scale_a * scale_b
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype or a.dtype)


class FastScaledMM(TorchDispatchMode):
    """While active, CPU tensorwise and rowwise aten._scaled_mm calls run as an fp32 matmul."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented
        if func is aten._scaled_mm.default:
            names = ("a", "b", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
            bound = dict(zip(names, args))
            bound.update({("a" if k == "self" else "b" if k == "mat2" else k): v for k, v in kwargs.items()})
            out = _fast(**bound)
            if out is not None:
                return out
        kernel = custom_op_kernel(func, args)
        if kernel is not None:  # a torch.library custom op: the _scaled_mm calls in its body run here too
            with self:
                return kernel(*args, **kwargs)
        return func(*args, **kwargs)
