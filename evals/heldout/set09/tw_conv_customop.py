"""Tensorwise FP8 linear, converter form, built on torch.library custom ops.

Two custom ops (namespace derived from this file's name, so copies of the file
do not collide): `quantize` (dynamic per-tensor scale, saturating cast, returns
fp8 data and the inverse scale) and `scaled_gemm` (torch._scaled_mm with the
A row-major / B column-major contract). An autograd.Function strings them
together; `convert_to_fp8` swaps nn.Linear children for Fp8Linear.
"""
import os

import torch
from torch import nn

_NS = "h9_" + os.path.splitext(os.path.basename(__file__))[0]


def _quantize_impl(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(fp8_dtype).max
    amax = torch.amax(t.abs()).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=1e-12)).to(torch.float32)
    q = torch.clamp(t.to(torch.float32) * scale, -fmax, fmax).to(fp8_dtype)
    return q, scale.reciprocal()


def _scaled_gemm_impl(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                      out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    a = a.contiguous()
    b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _register(name, fn):
    try:
        return torch.library.custom_op(f"{_NS}::{name}", mutates_args=())(fn)
    except Exception:  # already registered by an earlier import of this file
        return getattr(getattr(torch.ops, _NS), name)


quantize = _register("quantize", _quantize_impl)
scaled_gemm = _register("scaled_gemm", _scaled_gemm_impl)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        xq, xs = quantize(x2d, torch.float8_e4m3fn)
        wq, ws = quantize(weight, torch.float8_e4m3fn)
        return scaled_gemm(xq, xs, wq.t(), ws, x2d.dtype, True)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        gq, gs = quantize(grad_out, torch.float8_e5m2)
        wq, ws = quantize(weight, torch.float8_e4m3fn)
        grad_x = scaled_gemm(gq, gs, wq, ws, grad_out.dtype, False)
        xq, xs = quantize(x2d, torch.float8_e4m3fn)
        grad_w = scaled_gemm(gq.t(), gs, xq, xs, grad_out.dtype, False)
        return grad_x, grad_w


class Fp8Linear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x):
        y = _LinearFn.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(x.shape[:-1] + (self.out_features,))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert_to_fp8(module: nn.Module, **kwargs) -> nn.Module:
    if isinstance(module, nn.Linear):
        return Fp8Linear(module)
    for name, child in list(module.named_children()):
        setattr(module, name, convert_to_fp8(child, **kwargs))
    return module
