"""[planted bug: row-major weight handed to _scaled_mm as B in the grad_input GEMM]

Held-out set 15, twin h15_c06.py; labels in manifest.json.
"""
import torch
from torch import nn

FP8 = torch.float8_e4m3fn
AMAX_FLOOR = 1e-12


def _scale_from_amax(amax, fp8_max):
    """float64 division, float32 storage, rounded down to a power of two."""
    s = (fp8_max / torch.clamp(amax.double(), min=AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def _rowwise(t, dim, fp8_dtype=FP8):
    fp8_max = torch.finfo(fp8_dtype).max
    s = _scale_from_amax(t.abs().amax(dim=dim, keepdim=True), fp8_max)
    return torch.clamp(t.float() * s, -fp8_max, fp8_max).to(fp8_dtype), s


def _tensorwise(t, fp8_dtype=FP8):
    fp8_max = torch.finfo(fp8_dtype).max
    s = _scale_from_amax(t.abs().max(), fp8_max)
    return torch.clamp(t.float() * s, -fp8_max, fp8_max).to(fp8_dtype), s


def _result_dtype(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


class _GwHpLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = _rowwise(x2, 1)                          # [M, K], [M, 1]
        wq, ws = _rowwise(weight, 1)                      # [N, K], [N, 1]
        y = torch._scaled_mm(
            xq.contiguous(), wq.contiguous().t(),
            scale_a=xs.reciprocal(), scale_b=ws.reciprocal().t(),
            out_dtype=_result_dtype(x.dtype), use_fast_accum=True,
        )
        y = y.to(x.dtype)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq, dys = _rowwise(dy2, 1)                       # [M, N], [M, 1]
        wq, ws = _tensorwise(weight)                      # [N, K], scalar
        unit = ws.new_ones(())
        dx = torch._scaled_mm(
            dyq.contiguous(), wq,
            scale_a=unit, scale_b=unit,
            out_dtype=_result_dtype(dy.dtype), use_fast_accum=False,
        )
        dx *= dys.reciprocal() * ws.reciprocal()
        dx = dx.to(dy.dtype).reshape(*dy.shape[:-1], weight.shape[1])
        dw = torch.mm(dy2.t(), x.reshape(-1, x.shape[-1]))
        return dx, dw


class Float8GwHpLinear(nn.Linear):
    def forward(self, input):
        out = _GwHpLinearFn.apply(input, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, mod):
        new = cls(mod.in_features, mod.out_features, bias=False, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        return new
