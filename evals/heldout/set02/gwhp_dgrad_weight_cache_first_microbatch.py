"""FP8 linear with a high-precision weight gradient ("rowwise_with_gw_hp").

  fprop : y  = x_fp8 (per-row, e4m3) @ W_fp8.T (per-output-channel, e4m3)    fast accumulation
  dgrad : dx = dy_fp8 (per-row, e4m3) @ W_fp8 (one per-tensor e4m3 scale)
  wgrad : dW = dy.T @ x in the activations' precision (no quantization)
Scales are powers of two, rounded down.

Entry points: `gwhp_linear(x, w)`, `GwHpLinear.from_float(linear)`, `convert_gwhp(model)`.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def _p2(scale):
    return torch.exp2(torch.floor(torch.log2(scale)))


def quant_axis(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True)
    scale = _p2((E4M3_MAX / amax.double().clamp(min=1e-12)).float())
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def quant_tensor(t):
    amax = t.abs().max()
    scale = _p2((E4M3_MAX / amax.double().clamp(min=1e-12)).float())
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def _a(t):
    return t if (t.stride(1) == 1 and t.stride(0) >= t.size(1)) else t.contiguous()


def _b(t):
    return t if (t.stride(0) == 1 and t.stride(1) >= t.size(0)) else t.t().contiguous().t()


def _mm_dtype(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


def fprop(x2d, w):
    xq, xs = quant_axis(x2d, -1)
    wq, ws = quant_axis(w, -1)
    y = torch._scaled_mm(_a(xq), _b(wq.t()), scale_a=xs, scale_b=ws.t(),
                         out_dtype=_mm_dtype(x2d.dtype), use_fast_accum=True)
    return y.to(x2d.dtype)


def dgrad(dy2d, wq, ws):
    """wq/ws: per-tensor quantized weight."""
    dyq, dys = quant_axis(dy2d, -1)
    rescale = dys * ws.repeat(wq.shape[1]).reshape(1, -1)
    one = dys.new_ones(())
    dx = torch._scaled_mm(_a(dyq), _b(wq), scale_a=one, scale_b=one,
                          out_dtype=_mm_dtype(dy2d.dtype), use_fast_accum=False)
    dx *= rescale
    return dx.to(dy2d.dtype)


class _GwHpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w, wq, ws):
        ctx.save_for_backward(x2d, w, wq, ws)
        return fprop(x2d, w)

    @staticmethod
    def backward(ctx, dy):
        x2d, w, wq, ws = ctx.saved_tensors
        dx = dgrad(dy, wq, ws)
        dw = torch.mm(dy.t(), x2d)
        return dx, dw, None, None


def gwhp_linear(x2d, w):
    return _GwHpFn.apply(x2d, w, *quant_tensor(w.detach()))


class GwHpLinear(nn.Linear):
    is_first_microbatch = True     # set by the training loop at the start of each step

    def forward(self, x):
        if self.is_first_microbatch or getattr(self, "_w_dgrad", None) is None:
            self._w_dgrad = quant_tensor(self.weight.detach())   # reused by every micro-batch
        self.is_first_microbatch = False
        y = _GwHpFn.apply(x.reshape(-1, self.in_features), self.weight, *self._w_dgrad)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            m = cls(lin.in_features, lin.out_features, bias=False)
        m.weight = lin.weight
        m.bias = lin.bias
        return m


def convert_gwhp(model, **kwargs):
    if isinstance(model, nn.Linear) and not isinstance(model, GwHpLinear):
        return GwHpLinear.from_float(model)
    for name, child in list(model.named_children()):
        setattr(model, name, convert_gwhp(child, **kwargs))
    return model
