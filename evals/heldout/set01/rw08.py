"""Float8 rowwise Linear: per-token activation scales, per-output-channel weight scales,
e4m3 everywhere, power-of-two scales; grads re-quantized along each GEMM's inner dim."""
import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn


def amax_scale(t, dim):
    amax = t.detach().abs().amax(dim=dim, keepdim=True).to(torch.float64)
    s = (448.0 / amax.clamp(min=1e-12)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def quant(t, s):
    return (t.to(torch.float32) * s).clamp(-448.0, 448.0).to(E4M3)


def _row_major(t):
    return t if (t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1]) else t.contiguous()


def _col_major_2d(t):
    return t if (t.stride(0) == 1 and t.stride(1) >= t.shape[0]) else t.t().contiguous().t()


def _bf16_or(dt):
    return torch.bfloat16 if dt in (torch.float16, torch.float32) else dt


class _RowwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        # x: [..., K] (per-token scales work on any number of leading dims)
        ctx.save_for_backward(x, weight)
        sx = amax_scale(x, -1)
        sw = amax_scale(weight, -1)
        y = torch._scaled_mm(_row_major(quant(x, sx)), _col_major_2d(quant(weight, sw).t()),
                             scale_a=sx.reciprocal(), scale_b=sw.reciprocal().t(),
                             out_dtype=_bf16_or(x.dtype), use_fast_accum=True)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        one = torch.ones((), device=g2.device)
        sg = amax_scale(g2, -1)
        swc = amax_scale(weight, 0)
        dx = torch._scaled_mm(_row_major(quant(g2, sg)), _col_major_2d(quant(weight, swc)),
                              scale_a=one, scale_b=one, out_dtype=_bf16_or(g2.dtype))
        dx *= sg.reciprocal() * swc.reciprocal()
        sg0 = amax_scale(g2, 0)
        sx0 = amax_scale(x2, 0)
        dw = torch._scaled_mm(_row_major(quant(g2, sg0).t()), _col_major_2d(quant(x2, sx0)),
                              scale_a=one, scale_b=one, out_dtype=_bf16_or(g2.dtype))
        dw *= sg0.reciprocal().t() * sx0.reciprocal()
        return dx.to(g2.dtype).reshape(x.shape), dw.to(g2.dtype)


class Float8RowwiseLinear(nn.Linear):
    def forward(self, x):
        y = _RowwiseLinear.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            out = cls(mod.in_features, mod.out_features, bias=False)
        out.weight = mod.weight
        out.bias = mod.bias
        return out
