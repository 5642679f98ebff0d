"""Rowwise FP8 training linear + converter.

Scales are capped so that a near-zero row can never produce an infinite or absurdly
large scale (see the "tiny amax drives the scale to fp32 max" class of bugs); the cap is
the largest finite fp16 value, which keeps the scale usable by fp16 epilogues too."""
import torch
import torch.nn as nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
SCALE_CAP = float(torch.finfo(torch.float16).max)


def quantize_rows(t, dim):
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).double().clamp(min=1e-12)
    scale = (FP8_MAX / amax).float().clamp(max=SCALE_CAP)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    return torch.clamp(t.float() * scale, -FP8_MAX, FP8_MAX).to(FP8), scale


def _gemm(a, sa, b, sb, out_dtype, fast_accum):
    a = a if (a.stride(1) == 1 and a.stride(0) > 1) else a.contiguous()
    b = b if (b.stride(0) == 1 and b.stride(1) > 1) else b.t().contiguous().t()
    mm_dtype = torch.bfloat16 if out_dtype != torch.bfloat16 else out_dtype
    if fast_accum:
        out = torch._scaled_mm(a, b, scale_a=1 / sa, scale_b=1 / sb, out_dtype=mm_dtype,
                               use_fast_accum=True)
    else:
        unit = torch.tensor(1.0, device=a.device)
        out = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=mm_dtype)
        out *= (1 / sa) * (1 / sb)
    return out.to(out_dtype)


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        xq, xs = quantize_rows(x, 1)
        wq, ws = quantize_rows(weight, 1)
        return _gemm(xq, xs, wq.t(), ws.t(), x.dtype, True)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dyq, dys = quantize_rows(dy, 1)
        wq, ws = quantize_rows(weight, 0)
        dx = _gemm(dyq, dys, wq, ws, dy.dtype, False)
        dyq0, dys0 = quantize_rows(dy, 0)
        xq0, xs0 = quantize_rows(x, 0)
        dw = _gemm(dyq0.t(), dys0.t(), xq0, xs0, dy.dtype, False)
        return dx, dw


class RowwiseLinear(nn.Linear):
    def forward(self, x):
        y = _RowwiseLinearFn.apply(x.reshape(-1, x.shape[-1]), self.weight)
        y = y.reshape(*x.shape[:-1], -1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert_to_rowwise_fp8(model, **kwargs):
    def make(lin):
        with torch.device("meta"):
            new = RowwiseLinear(lin.in_features, lin.out_features, bias=False)
        new.weight, new.bias = lin.weight, lin.bias
        return new

    if type(model) is nn.Linear:
        return make(model)
    for name, mod in list(model.named_children()):
        setattr(model, name, convert_to_rowwise_fp8(mod))
    return model
