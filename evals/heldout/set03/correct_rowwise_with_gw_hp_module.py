"""FP8 linear, "rowwise with high-precision grad_weight" recipe.

Two entry points over one autograd function:
    y = linear_fp8_gw_hp(x_2d, weight)                 # function form
    layer = Fp8GwHpLinear.from_float(nn_linear)        # nn.Linear drop-in

  output      = x (e4m3, per row) @ w.T (e4m3, per output row), fast accum
  grad_input  = dy (e4m3, per row) @ w (e4m3, ONE scale for the tensor)
  grad_weight = dy.T @ x in the gradient's own precision, no fp8
All fp8 scales are powers of two.
"""
from typing import Tuple

import torch
import torch.nn as nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max      # 448.0


@torch.no_grad()
def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    s = (FP8_MAX / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


@torch.no_grad()
def to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8)


def quant_rows(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (amax along the last dim). Returns (fp8, 1/scale [R,1])."""
    s = pow2_scale(t.abs().amax(dim=-1, keepdim=True))
    return to_fp8(t, s), s.reciprocal()


def quant_tensor(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    s = pow2_scale(t.abs().max())
    return to_fp8(t, s), s.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _bf16_if_wide(dt: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dt in (torch.float16, torch.float32) else dt


class _LinearGwHp(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        x2d = x.reshape(-1, x.shape[-1])
        xq, xs = quant_rows(x2d)                        # [M,1]
        wq, ws = quant_rows(w)                          # [N,1]
        kdt = _bf16_if_wide(x.dtype)
        y = torch._scaled_mm(xq.contiguous(), _col_major(wq.t()), scale_a=xs, scale_b=ws.t(),
                             out_dtype=kdt, use_fast_accum=True)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        x2d = x.reshape(-1, x.shape[-1])
        kdt = _bf16_if_wide(dy.dtype)

        # grad_input: unit scales in the kernel, scales applied to the result
        gq, gs = quant_rows(dy2d)                       # [M,1]
        wq, ws = quant_tensor(w)                        # scalar
        ws_row = ws.reshape(1, 1).expand(1, w.shape[1])
        one = torch.ones((), device=dy.device)
        dx = torch._scaled_mm(gq.contiguous(), _col_major(wq), scale_a=one, scale_b=one,
                              out_dtype=kdt, use_fast_accum=False)
        dx = (dx * (gs * ws_row)).to(dy.dtype)

        # grad_weight: plain high-precision matmul
        dw = dy2d.t().mm(x2d)
        return dx.reshape(x.shape).to(x.dtype), dw.to(w.dtype)


def linear_fp8_gw_hp(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _LinearGwHp.apply(x, weight)


class Fp8GwHpLinear(nn.Linear):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _LinearGwHp.apply(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, mod: nn.Linear) -> "Fp8GwHpLinear":
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new
