"""[planted bug: The e5m2 grad_output for grad_weight is 'transposed' with reshape(N, M) instead of .t(), scrambling the left operand of grad_weight.]

Tensorwise FP8 training, converter form: ``convert_to_float8(module) -> module``.

Every ``nn.Linear`` in ``module`` (or ``module`` itself) is swapped for a
``_TensorwiseFP8Linear`` that shares its weight and bias Parameters.  Numerics follow
torchao 0.18's tensorwise recipe:

* input and weight are cast to e4m3, grad_output to e5m2, one dynamic scale per tensor
  (``fp8_max / max(amax, 1e-12)`` in float64, rounded to float32), saturating cast;
* output = x8 @ w8.T with fast accumulation, grad_input = g8 @ w8 and
  grad_weight = g8.T @ x8 with slow accumulation; outputs in the activation dtype;
* the bias is added after the GEMM in the output dtype (as torchao does).

The module computes the forward fp8 weight itself (``_weight_fp8``) and hands it to the
autograd function; the backward re-quantizes the weight from the saved Parameter.
Operand layouts are fixed at each call site: A row-major, B column-major.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


def _amax_scale(t, fp8_dtype):
    amax = torch.max(torch.abs(t)).to(torch.float64)
    return (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)


def _cast(t, fp8_dtype):
    """(fp8 tensor, float32 scale) with the layout of ``t`` preserved."""
    with torch.no_grad():
        scale = _amax_scale(t, fp8_dtype)
        fmax = torch.finfo(fp8_dtype).max
        data = (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)
    return data, scale


def _row_major(t):
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def _as_lhs(t):
    return t if _row_major(t) else t.contiguous()


def _as_rhs(t):
    return t.t().contiguous().t() if _row_major(t) else t


def _fp8_mm(a, sa, b, sb, out_dtype, fast_accum):
    return torch._scaled_mm(
        a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
        out_dtype=out_dtype, use_fast_accum=fast_accum,
    )


class _TensorwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w8t, sw):
        ctx.save_for_backward(x, weight)
        x8, sx = _cast(x.reshape(-1, x.shape[-1]), E4M3)
        a = _as_lhs(x8)
        out = _fp8_mm(a, sx, _as_rhs(w8t), sw, x.dtype, True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        g8, sg = _cast(g, E5M2)
        w8t, sw = _cast(weight.t(), E4M3)
        grad_x = _fp8_mm(_as_lhs(g8), sg, _as_rhs(w8t.t()), sw, grad_out.dtype, False)
        g8_for_w, sg_for_w = _cast(g, E5M2)
        x8, sx = _cast(x.reshape(-1, x.shape[-1]), E4M3)
        grad_w = _fp8_mm(_as_lhs(g8_for_w.reshape(g8_for_w.shape[1], -1)), sg_for_w, _as_rhs(x8), sx, grad_out.dtype, False)
        grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        return grad_x, grad_w, None, None


class _TensorwiseFP8Linear(nn.Linear):
    def _weight_fp8(self):
        return _cast(self.weight.t(), E4M3)

    def forward(self, x):
        w8t, sw = self._weight_fp8()
        out = _TensorwiseFn.apply(x, self.weight, w8t, sw)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_linear(cls, lin):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight = lin.weight
        new.bias = lin.bias
        return new


def convert_to_float8(module: nn.Module, **kwargs) -> nn.Module:
    """Swap every nn.Linear for a tensorwise FP8 linear (in place); returns the module."""
    if type(module) is nn.Linear:
        return _TensorwiseFP8Linear.from_linear(module)
    for name, child in module.named_children():
        setattr(module, name, convert_to_float8(child, **kwargs))
    return module
