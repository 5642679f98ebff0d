"""Drop-in nn.Linear with dynamic tensorwise float8 GEMMs.

Usage:
    layer = TensorwiseFloat8Linear.from_float(nn.Linear(1024, 4096))

Everything that matters numerically is in ``Float8Recipe``; the module only
wires it to an autograd.Function.
"""
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class CastSpec:
    dtype: torch.dtype
    scale_dtype: torch.dtype = torch.float32

    @property
    def max(self) -> float:
        return torch.finfo(self.dtype).max


@dataclass(frozen=True)
class Float8Recipe:
    input: CastSpec = field(default_factory=lambda: CastSpec(torch.float8_e4m3fn))
    weight: CastSpec = field(default_factory=lambda: CastSpec(torch.float8_e4m3fn))
    grad_output: CastSpec = field(default_factory=lambda: CastSpec(torch.float8_e5m2, torch.bfloat16))
    # per-GEMM accumulation mode: output, grad_input, grad_weight
    fast_accum: tuple = (True, False, False)
    amax_floor: float = 1e-12


class ScaledTensor(NamedTuple):
    data: torch.Tensor   # float8 payload
    inv: torch.Tensor    # multiply by this to get back to real units

    def t(self):
        return ScaledTensor(self.data.t(), self.inv)


@torch.no_grad()
def cast_to_float8(x: torch.Tensor, spec: CastSpec, floor: float) -> ScaledTensor:
    amax = x.abs().max().to(torch.float64)
    scale = (spec.max / amax.clamp(min=floor)).to(torch.float32)
    scale = scale.to(spec.scale_dtype).to(torch.float32)
    scaled = x.to(torch.float32) * scale
    payload = scaled.clamp(min=-spec.max, max=spec.max).to(spec.dtype)
    return ScaledTensor(payload, scale.reciprocal())


def _is_row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) > t.stride(1)


def as_mat1(t: torch.Tensor) -> torch.Tensor:
    return t if _is_row_major(t) else t.contiguous()


def as_mat2(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t() if _is_row_major(t) else t


def scaled_gemm(a: ScaledTensor, b: ScaledTensor, out_dtype, fast_accum):
    return torch._scaled_mm(
        as_mat1(a.data), as_mat2(b.data),
        scale_a=a.inv, scale_b=b.inv,
        out_dtype=out_dtype, use_fast_accum=fast_accum,
    )


class _TensorwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_q: ScaledTensor, recipe: Float8Recipe):
        x2 = x.reshape(-1, x.shape[-1])
        x_q = cast_to_float8(x2, recipe.input, recipe.amax_floor)
        out = scaled_gemm(x_q, w_q.t(), x.dtype, recipe.fast_accum[0])
        ctx.recipe = recipe
        ctx.w_q = w_q
        ctx.save_for_backward(x)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        r = ctx.recipe
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_q = cast_to_float8(g2, r.grad_output, r.amax_floor)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_gemm(g_q, ctx.w_q, grad_out.dtype, r.fast_accum[1])
            grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            x_q = cast_to_float8(x2, r.input, r.amax_floor)
            grad_w = scaled_gemm(g_q.t(), x_q, grad_out.dtype, r.fast_accum[2])
        return grad_x, grad_w, None, None


class TensorwiseFloat8Linear(nn.Linear):
    def __init__(self, *args, recipe: Optional[Float8Recipe] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe = recipe or Float8Recipe()
        self._w_key = None
        self._w_q = None

    def _quantized_weight(self) -> ScaledTensor:
        # re-cast only when the weight changed (optimizer step, load_state_dict)
        key = (self.weight.data_ptr(), self.weight._version, self.weight.shape)
        if self._w_key != key:
            self._w_q = cast_to_float8(self.weight, self.recipe.weight, self.recipe.amax_floor)
            self._w_key = key
        return self._w_q

    def forward(self, x):
        out = _TensorwiseLinearFn.apply(x, self.weight, self._quantized_weight(), self.recipe)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, mod: nn.Linear, recipe: Optional[Float8Recipe] = None):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, recipe=recipe)
        new.weight = mod.weight
        new.bias = mod.bias
        return new
