"""Reference FP8 linear, tensorwise dynamic scaling (held-out set, correct).

Recipe (matches torchao 0.18 Float8LinearConfig.from_recipe_name("tensorwise")):
  output      = input(e4m3)       @ weight.T(e4m3)   fast accumulation
  grad_input  = grad_output(e5m2) @ weight(e4m3)
  grad_weight = grad_output.T(e5m2) @ input(e4m3), computed in grad_output's dtype
One scale per tensor: scale = fp8_max / max(amax, 1e-12) evaluated in float64, stored fp32;
torch._scaled_mm receives the reciprocal scales. A row-major, B column-major.

Three plug-in forms: `fp8_linear` (function), `TensorwiseFp8Linear` (module, from_float) and
`convert` (converter).
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


def _scale_of(t: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    amax = t.abs().max().to(torch.float64)
    return (torch.finfo(fp8).max / amax.clamp(min=_EPS)).to(torch.float32)


def _quantize(t: torch.Tensor, fp8: torch.dtype):
    """Returns (fp8 data with t's strides where possible, inverse scale)."""
    s = _scale_of(t, fp8)
    bound = torch.finfo(fp8).max
    q = (t.to(torch.float32) * s).clamp(-bound, bound).to(fp8)
    return q, s.reciprocal()


def _row_major(t):
    return t if (t.stride(1) == 1 and t.stride(0) >= t.size(1)) else t.contiguous()


def _col_major(t):
    return t if (t.stride(0) == 1 and t.stride(1) >= t.size(0)) else t.t().contiguous().t()


def _mm(a, a_inv, b, b_inv, out_dtype, fast):
    return torch._scaled_mm(_row_major(a), _col_major(b), scale_a=a_inv, scale_b=b_inv,
                            out_dtype=out_dtype, use_fast_accum=fast)


class _TensorwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        xq, x_inv = _quantize(x2d, E4M3)
        wq, w_inv = _quantize(weight, E4M3)
        return _mm(xq, x_inv, wq.t(), w_inv, x2d.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        gq, g_inv = _quantize(g, E5M2)
        wq, w_inv = _quantize(weight, E4M3)
        grad_x = _mm(gq, g_inv, wq, w_inv, g.dtype, False)
        xq, x_inv = _quantize(x2d, E4M3)
        grad_w = _mm(gq.t(), g_inv, xq, x_inv, g.dtype, False)
        return grad_x, grad_w


def fp8_linear(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Function form: output = x2d @ weight.T in FP8 (no bias)."""
    return _TensorwiseMM.apply(x2d, weight)


class TensorwiseFp8Linear(nn.Linear):
    def forward(self, x):
        lead = x.shape[:-1]
        y = _TensorwiseMM.apply(x.reshape(-1, x.shape[-1]), self.weight)
        y = y.reshape(*lead, y.shape[-1])
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, lin: nn.Linear):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight = lin.weight
        new.bias = lin.bias
        return new


def convert(module: nn.Module, **kwargs) -> nn.Module:
    if isinstance(module, nn.Linear) and not isinstance(module, TensorwiseFp8Linear):
        return TensorwiseFp8Linear.from_float(module)
    for name, child in list(module.named_children()):
        setattr(module, name, convert(child, **kwargs))
    return module
