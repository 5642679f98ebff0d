"""Float8 training Linear (tensorwise scaling), drop-in replacement for nn.Linear.

    fp8_lin = Float8Linear.from_float(linear)             # shares linear's parameters
    fp8_lin = Float8Linear.from_float(linear, Fp8Config(fast_accum_output=False))

Recipe: input and weight in e4m3, grad_output in e5m2, one dynamic scale per tensor
(fp8_max / amax, computed in float64), torch._scaled_mm with inverse scales.
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class Fp8Config:
    fwd_dtype: torch.dtype = torch.float8_e4m3fn
    bwd_dtype: torch.dtype = torch.float8_e5m2
    eps: float = 1e-12
    fast_accum_output: bool = True


class ScaledTensor:
    """fp8 payload plus the inverse scale that turns it back into the original values."""

    __slots__ = ("data", "inv_scale")

    def __init__(self, data: torch.Tensor, inv_scale: torch.Tensor):
        self.data = data
        self.inv_scale = inv_scale

    def t(self) -> "ScaledTensor":
        return ScaledTensor(self.data.t(), self.inv_scale)


@torch.no_grad()
def quantize(t: torch.Tensor, fp8_dtype: torch.dtype, eps: float) -> ScaledTensor:
    fp8_max = torch.finfo(fp8_dtype).max
    amax = torch.max(torch.abs(t)).to(torch.float64)
    scale = (fp8_max / torch.clamp(amax, min=eps)).to(torch.float32)
    data = torch.clamp(t.to(torch.float32) * scale, min=-fp8_max, max=fp8_max).to(fp8_dtype)
    return ScaledTensor(data, scale.reciprocal())


def scaled_mm(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype, fast_accum: bool):
    a_data, b_data = a.data, b.data
    if not (a_data.stride(-1) == 1 and a_data.stride(0) >= a_data.size(1)):
        a_data = a_data.contiguous()
    if not (b_data.stride(0) == 1 and b_data.stride(1) >= b_data.size(0)):
        b_data = b_data.t().contiguous().t()
    return torch._scaled_mm(a_data, b_data, scale_a=a.inv_scale, scale_b=b.inv_scale,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, cfg: Fp8Config):
        ctx.save_for_backward(x2d, weight)
        ctx.cfg = cfg
        x_fp8 = quantize(x2d, cfg.fwd_dtype, cfg.eps)
        w_fp8 = quantize(weight, cfg.fwd_dtype, cfg.eps)
        return scaled_mm(x_fp8, w_fp8.t(), x2d.dtype, cfg.fast_accum_output)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        cfg = ctx.cfg
        go_fp8 = quantize(grad_out, cfg.bwd_dtype, cfg.eps)
        w_fp8 = quantize(weight, cfg.fwd_dtype, cfg.eps)
        grad_x = scaled_mm(go_fp8, w_fp8, grad_out.dtype, False)
        x_fp8 = quantize(x2d, cfg.fwd_dtype, cfg.eps)
        # wgrad in the usual X^T @ dY form, then shaped like the weight
        grad_w = scaled_mm(x_fp8.t(), go_fp8, grad_out.dtype, False)
        return grad_x, grad_w.view(weight.shape), None


class Float8Linear(nn.Linear):
    def __init__(self, *args, config: Optional[Fp8Config] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.config = config or Fp8Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = _Fp8LinearFn.apply(x2d, self.weight, self.config)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, mod: nn.Linear, config: Optional[Fp8Config] = None) -> "Float8Linear":
        with torch.device("meta"):
            new_mod = cls(mod.in_features, mod.out_features, bias=False, config=config)
        new_mod.weight = mod.weight
        new_mod.bias = mod.bias
        return new_mod
