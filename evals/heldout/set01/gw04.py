"""Float8 training Linear, rowwise FP8 for output / grad_input and a high-precision
grad_weight; supports fp32 master weights (grad_weight then accumulates in fp32)."""
import torch
import torch.nn as nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _scale(amax):
    s = (FP8_MAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(t, s):
    return torch.clamp(t.to(torch.float32) * s, -FP8_MAX, FP8_MAX).to(FP8)


def _rm(t):
    return t if t.stride(1) == 1 and t.stride(0) > 1 else t.contiguous()


def _cm(t):
    return t if t.stride(0) == 1 and t.stride(1) > 1 else t.t().contiguous().t()


def _dt(d):
    return torch.bfloat16 if d in (torch.float16, torch.float32) else d


class _Fp8GwHp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        sx = _scale(x.abs().amax(-1, keepdim=True))
        swt = _scale(w.t().abs().amax(0, keepdim=True))
        y = torch._scaled_mm(_rm(_cast(x, sx)), _cm(_cast(w.t(), swt)), scale_a=sx.reciprocal(),
                             scale_b=swt.reciprocal(), out_dtype=_dt(x.dtype), use_fast_accum=True)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        sdy = _scale(dy.abs().amax(-1, keepdim=True))
        sw = _scale(w.abs().max())
        one = torch.ones((), device=dy.device)
        dx = torch._scaled_mm(_rm(_cast(dy, sdy)), _cm(_cast(w, sw)), scale_a=one, scale_b=one,
                              out_dtype=_dt(dy.dtype), use_fast_accum=False)
        dx *= sdy.reciprocal() * sw.reciprocal().repeat(w.shape[1]).reshape(1, -1)
        if w.dtype == torch.float32 and dy.dtype != torch.float32:
            # fp32 master weights: accumulate the high-precision grad in fp32
            dw = torch.mm(dy.t().float(), x)
        else:
            dw = torch.mm(dy.t(), x)
        return dx.to(dy.dtype), dw


class GwHpFloat8Linear(nn.Linear):
    def forward(self, x):
        y = _Fp8GwHp.apply(x.reshape(-1, x.shape[-1]), self.weight)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            m = cls(lin.in_features, lin.out_features, bias=False)
        m.weight, m.bias = lin.weight, lin.bias
        return m
